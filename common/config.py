"""Job configuration: every ``RINGMASTER_*`` environment variable, parsed in one place.

``ringrun`` turns its flags into these variables; ranks started by plain ``mpirun`` read
the same variables. :func:`load_config` returns one frozen :class:`Config`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Mapping, Optional, Tuple

MIB = 1024 * 1024


class ConfigError(ValueError):
    """A ``RINGMASTER_*`` variable holds a value that cannot be used."""


@dataclasses.dataclass(frozen=True)
class Config:
    """The settings of one ringmaster job (all ranks read the same environment).

    Attributes:
        coordinator_addr: ``host:port`` of the coordinator daemon; ``None`` means rank 0
            starts one itself (plain ``mpirun``).
        secret: the job token every coordinator call carries. Never logged (``repr=False``).
        fusion_threshold_bytes: largest fused allreduce buffer (default 64 MiB; 0 disables fusion).
        cycle_time_ms: how long the coordinator waits for more ready tensors to fuse with,
            once tensors are ready while others are still being declared (default 1 ms).
        stall_warning_s: warn when some ranks declared a tensor and others did not for this long.
        stall_shutdown_s: abort the job after a stall this long (0 = never; default 30 min).
        heartbeat_interval_s: how often each rank tells the coordinator it is alive.
        heartbeat_timeout_s: a rank silent this long is declared dead and the job aborted.
        start_timeout_s: how long ranks wait for the coordinator and each other at start.
        allreduce_algorithm: ``"auto"``, ``"ring"`` (ringmaster's ring) or ``"mpi"`` (MPI_Allreduce).
        log_level: Python logging level name for the ``ringmaster`` loggers.
        network_interface: the interface whose address the coordinator binds to and advertises.
        background_nice: nice value of each rank's background thread (Linux): 19 (default)
            lets it run only on cycles the training loop leaves; 0 gives it equal priority.
        timeline: record a timeline from ``init()`` to this path; ``{rank}`` in it is replaced
            by the rank, and without ``{rank}`` only rank 0 records.
        gradient_plan: after its first step, DistributedOptimizer reduces gradients in fixed
            buckets negotiated once per step (see ``ringmaster.worker.runtime.gradient_plan``); off:
            every gradient is negotiated on its own, every step.
        hierarchical_allreduce: across hosts with as many ranks each, big allreduces reduce
            within each host first and run the ring only between hosts
            (``ringmaster.ops.hierarchical``; Horovod's ``HOROVOD_HIERARCHICAL_ALLREDUCE``).
        host_aggregator: the first rank of each host starts a host aggregator
            (``ringmaster.coordinator.aggregator``), through which the host's ranks reach the
            coordinator: requests every rank of the host declared alike go to it once. For
            jobs of hundreds of ranks (docs/benchmarks.md, "The control plane at many ranks").
        plan_overlap: which of the gradient plan's buckets start during the backward pass:
            ``"all"``, ``"small"`` (only those that are one small MPI call; the others wait
            for ``step()``), or ``"auto"``: all when each rank has a core to spare beyond
            its torch threads, else small (on busy cores overlap costs the backward pass
            more than it saves: docs/benchmarks.md).
        max_message_bytes: the largest message a rank or the coordinator sends the other;
            longer request and response lists go as several messages (default 16 MiB; see
            ``ringmaster.common.message_size``).
        max_pending_requests: how many tensors one rank may have declared that still wait for
            other ranks; a request beyond it fails with an error naming the cap (default 65536).
        cache_capacity: how many negotiated collectives the response cache keeps, so that the
            same call again runs without the coordinator (default 1024; 0 turns the cache off;
            see ``ringmaster.worker.runtime.response_cache``).
        autotune: during the first steps, rank 0 tunes the fusion threshold, the cycle time,
            the ring/MPI crossover and the response cache, and every rank uses its choice
            (``ringmaster.worker.runtime.autotune``).
        autotune_log: a CSV file for every autotuning trial and the final choice (rank 0 writes it).
        autotune_warmup_samples: samples measured and discarded before the search (default 3).
        autotune_steps_per_sample: a sample ends when one tensor name has been reduced this
            many times in it (about that many training steps; default 10).
        cache_stall_s: a response-cache cycle that some ranks have waited in this long while
            others never entered it ends the job with an error naming those others (default 10 s;
            0: never; see ``ringmaster.coordinator.cache_stalls``).
        gpu_transport: how collectives of CUDA tensors move data: ``"auto"`` (chosen from where
            the ranks and GPUs are, logged once), ``"nccl"``, ``"ipc"``, ``"mpi"`` (a CUDA-aware
            MPI) or ``"staged"`` (see ``ringmaster.ops.gpu``).
        result_pool: out-of-place allreduces of large tensors write into memory released by the
            caller's earlier results instead of fresh pages (``ringmaster.worker.runtime.result_memory``).
    """

    coordinator_addr: Optional[str] = None
    secret: Optional[str] = dataclasses.field(default=None, repr=False)
    fusion_threshold_bytes: int = 64 * MIB
    cycle_time_ms: float = 1.0
    stall_warning_s: float = 60.0
    # A stall that nothing resolves ends as an error, never as a silent wait: after 30 minutes,
    # the default timeout of torch.distributed's process groups, which users of long
    # evaluations on one rank already plan for.
    stall_shutdown_s: float = 1800.0
    heartbeat_interval_s: float = 1.0
    # A rank that dies breaks its stream at once; this limit only catches a frozen process or a
    # vanished host. 60 s, not less: with 8 ranks on 2 busy cores a live rank's stream was
    # seen silent for 16 s (its threads starved), and the job was aborted blaming it.
    heartbeat_timeout_s: float = 60.0
    start_timeout_s: float = 30.0
    allreduce_algorithm: str = "auto"
    log_level: str = "WARNING"
    network_interface: Optional[str] = None
    timeline: Optional[str] = None
    background_nice: int = 19
    gradient_plan: bool = True
    plan_overlap: str = "auto"
    hierarchical_allreduce: bool = False
    host_aggregator: bool = False
    max_message_bytes: int = 16 * MIB
    max_pending_requests: int = 65536
    cache_capacity: int = 1024
    autotune: bool = False
    autotune_log: Optional[str] = None
    autotune_warmup_samples: int = 3
    autotune_steps_per_sample: int = 10
    result_pool: bool = True
    gpu_transport: str = "auto"
    cache_stall_s: float = 10.0


# environment variable -> (Config field, parser)
def _text(value: str) -> str:
    return value


def _nonnegative_float(value: str) -> float:
    number = float(value)
    if number < 0:
        raise ValueError("must be >= 0")
    return number


def _positive_float(value: str) -> float:
    number = float(value)
    if number <= 0:
        raise ValueError("must be > 0")
    return number


def _nonnegative_int(value: str) -> int:
    number = int(value)
    if number < 0:
        raise ValueError("must be >= 0")
    return number


#: The smallest message limit: the largest single request the coordinator accepts (a 4 KiB
#: name, 64 dimensions, a group name) and its responses fit many times over.
MIN_MESSAGE_BYTES = 64 * 1024
#: The largest: gRPC accepts twice the limit (common/message_size.py), and lengths are int32.
MAX_MESSAGE_BYTES = 1 << 30


def _message_bytes(value: str) -> int:
    number = int(value)
    if not MIN_MESSAGE_BYTES <= number <= MAX_MESSAGE_BYTES:
        raise ValueError(f"must be a number of bytes from {MIN_MESSAGE_BYTES} (64 KiB) to {MAX_MESSAGE_BYTES} (1 GiB)")
    return number


def _positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise ValueError("must be a whole number >= 1")
    return number


#: The most slots a response cache may have: each costs one integer in every cycle's allreduce.
MAX_CACHE_CAPACITY = 1 << 16


def _cache_capacity(value: str) -> int:
    number = int(value)
    if not 0 <= number <= MAX_CACHE_CAPACITY:
        raise ValueError(f"must be a whole number from 0 (no cache) to {MAX_CACHE_CAPACITY}")
    return number


def _nice(value: str) -> int:
    number = int(value)
    if not 0 <= number <= 19:
        raise ValueError("must be a whole number from 0 to 19")
    return number


def _plan_overlap(value: str) -> str:
    value = value.strip().lower()
    if value not in ("auto", "all", "small"):
        raise ValueError("must be one of auto, all, small")
    return value


def _log_level(value: str) -> str:
    value = value.strip().upper()
    if value not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise ValueError("must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL")
    return value


def _timeline(value: str) -> str:
    directory = os.path.dirname(os.path.abspath(value.replace("{rank}", "0")))
    if not os.path.isdir(directory):
        raise ValueError(f"its directory {directory} does not exist; create it first")
    return value


def _csv_path(value: str) -> str:
    directory = os.path.dirname(os.path.abspath(value))
    if not os.path.isdir(directory):
        raise ValueError(f"its directory {directory} does not exist; create it first")
    return value


def _switch(value: str) -> bool:
    value = value.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError("must be 1 or 0 (also true/false, yes/no, on/off)")


def _algorithm(value: str) -> str:
    value = value.strip().lower()
    if value not in ("auto", "ring", "mpi"):
        raise ValueError("must be one of auto, ring, mpi")
    return value


#: Values of RINGMASTER_GPU_TRANSPORT (see ringmaster.ops.gpu).
GPU_TRANSPORTS = ("auto", "nccl", "ipc", "mpi", "staged")


def _gpu_transport(value: str) -> str:
    value = value.strip().lower()
    if value not in GPU_TRANSPORTS:
        raise ValueError(f"must be one of {', '.join(GPU_TRANSPORTS)}")
    return value


@dataclasses.dataclass(frozen=True)
class Setting:
    """One setting of a job, described once: its variable, its :class:`Config` field, its
    parser, and (for those ``ringrun`` offers) its flag. ``ringrun``'s flags, their help
    text with the default, their checks and the variables they set are all derived from
    these (``ringmaster.launch.setting_flags``); ranks read the variables through
    :func:`load_config`.

    Attributes:
        variable: the ``RINGMASTER_*`` environment variable.
        field: the :class:`Config` field it sets (whose default is the setting's default).
        parse: text of the variable -> value; raises ``ValueError`` saying what it must be.
        flag: ``ringrun``'s flag, or ``None`` where only the variable exists.
        help: the flag's help, without the default (added from the field's default).
        group: which of ringrun's option groups lists the flag ("job", "tuning", "network").
        metavar: the flag's value in the help text.
        unit: how many of the variable's units one of the flag's is (MiB flags: bytes).
        choices: the allowed values, for a flag that is a choice.
        switch: the flag takes no value and sets the variable to 1.
        default_text: the default as the help shows it, where the field's default does not
            say it well (``None``: derived from the field).
    """

    variable: str
    field: str
    parse: Callable[[str], Any]
    flag: Optional[str] = None
    help: str = ""
    group: str = "tuning"
    metavar: Optional[str] = None
    unit: int = 1
    choices: Tuple[str, ...] = ()
    switch: bool = False
    default_text: Optional[str] = None

    @property
    def dest(self) -> Optional[str]:
        """The flag's attribute name on ringrun's parsed arguments."""
        return None if self.flag is None else self.flag.lstrip("-").replace("-", "_")

    @property
    def default(self) -> Any:
        """The default value, in the variable's units (the :class:`Config` field's default)."""
        return Config.__dataclass_fields__[self.field].default

    def environment_value(self, value: Any) -> str:
        """A flag's ``value`` (in the flag's units) as the variable's text; ``ValueError`` if
        the variable's parser refuses it."""
        if self.switch:
            text = "1"
        elif self.unit != 1:
            text = str(int(round(float(value) * self.unit)))
        elif isinstance(value, float):
            text = repr(value) if value != int(value) else str(int(value))
        else:
            text = str(value)
        self.parse(text)
        return text


# The order is that of ringrun's help within each group.
SETTINGS: Tuple[Setting, ...] = (
    Setting("RINGMASTER_COORDINATOR_ADDR", "coordinator_addr", _text),
    Setting("RINGMASTER_SECRET", "secret", _text),
    Setting("RINGMASTER_START_TIMEOUT", "start_timeout_s", _positive_float, "--start-timeout",
            "seconds to wait for the coordinator and the ranks to start", group="job", metavar="S"),
    Setting("RINGMASTER_FUSION_THRESHOLD", "fusion_threshold_bytes", _nonnegative_int, "--fusion-threshold-mb",
            "largest fused allreduce buffer in MiB (0 disables fusion)", metavar="MB", unit=MIB),
    Setting("RINGMASTER_CYCLE_TIME", "cycle_time_ms", _nonnegative_float, "--cycle-time-ms",
            "coordinator cycle time in milliseconds", metavar="MS"),
    Setting("RINGMASTER_STALL_WARNING_S", "stall_warning_s", _positive_float, "--stall-warning-s",
            "warn about tensors some ranks have not declared after S seconds", metavar="S"),
    Setting("RINGMASTER_STALL_SHUTDOWN_S", "stall_shutdown_s", _nonnegative_float, "--stall-shutdown-s",
            "abort the job after a stall of S seconds (0: never)", metavar="S"),
    Setting("RINGMASTER_ALLREDUCE", "allreduce_algorithm", _algorithm, "--allreduce",
            "allreduce algorithm", choices=("auto", "ring", "mpi")),
    Setting("RINGMASTER_HIERARCHICAL_ALLREDUCE", "hierarchical_allreduce", _switch, "--hierarchical-allreduce",
            "across hosts with as many ranks each, reduce big tensors within each host first and run the "
            "ring only between hosts", switch=True, default_text="off"),
    Setting("RINGMASTER_HOST_AGGREGATOR", "host_aggregator", _switch, "--host-aggregator",
            "one daemon per host merges its ranks' requests before they reach the coordinator (for jobs "
            "of hundreds of ranks)", switch=True, default_text="off"),
    Setting("RINGMASTER_HEARTBEAT_INTERVAL_S", "heartbeat_interval_s", _positive_float, "--heartbeat-interval-s",
            "how often an idle rank tells the coordinator it is alive", metavar="S"),
    Setting("RINGMASTER_HEARTBEAT_TIMEOUT_S", "heartbeat_timeout_s", _positive_float, "--heartbeat-timeout-s",
            "declare a rank dead after S seconds without a heartbeat", metavar="S"),
    Setting("RINGMASTER_BACKGROUND_NICE", "background_nice", _nice, "--background-nice",
            "nice value 0-19 of each rank's communication thread (19: it uses the cycles training "
            "leaves; 0: equal priority)", metavar="N"),
    Setting("RINGMASTER_MAX_MESSAGE_BYTES", "max_message_bytes", _message_bytes, "--max-message-mb",
            "largest message between a rank and the coordinator in MiB (longer request and response "
            "lists go as several messages)", metavar="MB", unit=MIB),
    Setting("RINGMASTER_MAX_PENDING_REQUESTS", "max_pending_requests", _positive_int, "--max-pending-requests",
            "tensors one rank may have waiting for other ranks", metavar="N"),
    Setting("RINGMASTER_CACHE_CAPACITY", "cache_capacity", _cache_capacity, "--cache-capacity",
            "negotiated collectives each rank's response cache keeps, so that calling one again skips "
            "the coordinator (0: no cache)", metavar="N"),
    Setting("RINGMASTER_GPU_TRANSPORT", "gpu_transport", _gpu_transport, "--gpu-transport",
            "how collectives of CUDA tensors move data", choices=GPU_TRANSPORTS,
            default_text="auto: nccl with a GPU per rank, ipc for ranks sharing a GPU on one host, mpi if "
                         "CUDA-aware, else staged"),
    Setting("RINGMASTER_AUTOTUNE", "autotune", _switch, "--autotune",
            "tune fusion threshold, cycle time, ring/MPI crossover and response cache during the first "
            "steps", switch=True, default_text="off"),
    Setting("RINGMASTER_AUTOTUNE_LOG", "autotune_log", _csv_path, "--autotune-log-file",
            "write every autotuning trial and the final choice to this CSV file", metavar="PATH"),
    Setting("RINGMASTER_AUTOTUNE_WARMUP_SAMPLES", "autotune_warmup_samples", _nonnegative_int,
            "--autotune-warmup-samples", "autotuning samples discarded before the search", metavar="N"),
    Setting("RINGMASTER_AUTOTUNE_STEPS_PER_SAMPLE", "autotune_steps_per_sample", _positive_int,
            "--autotune-steps-per-sample", "steps (repeats of one tensor name) per autotuning sample",
            metavar="N"),
    Setting("RINGMASTER_TIMELINE", "timeline", _timeline, "--timeline-filename",
            "record a Chrome-tracing timeline of every tensor to PATH ({rank} in PATH: one file per rank; "
            "otherwise rank 0's)", metavar="PATH"),
    Setting("RINGMASTER_NETWORK_INTERFACE", "network_interface", _text, "--network-interface",
            "interface for the coordinator and MPI's TCP traffic, e.g. eth0", group="network", metavar="IF"),
    Setting("RINGMASTER_LOG_LEVEL", "log_level", _log_level),  # ringrun --verbose sets INFO
    Setting("RINGMASTER_GRADIENT_PLAN", "gradient_plan", _switch),
    Setting("RINGMASTER_PLAN_OVERLAP", "plan_overlap", _plan_overlap),
    Setting("RINGMASTER_RESULT_POOL", "result_pool", _switch),
    Setting("RINGMASTER_CACHE_STALL_S", "cache_stall_s", _nonnegative_float),
)

#: variable -> (Config field, parser), from :data:`SETTINGS`.
ENVIRONMENT = {setting.variable: (setting.field, setting.parse) for setting in SETTINGS}


def load_config(environ: Optional[Mapping[str, str]] = None) -> Config:
    """Parse the ``RINGMASTER_*`` variables of ``environ`` (default ``os.environ``).

    Raises:
        ConfigError: naming the variable, its value and what it must be.
    """
    environ = os.environ if environ is None else environ
    values = {}
    for variable, (field, parse) in ENVIRONMENT.items():
        raw = environ.get(variable)
        if raw is None or raw == "":
            continue
        try:
            values[field] = parse(raw)
        except ValueError as error:
            shown = "<hidden>" if variable == "RINGMASTER_SECRET" else repr(raw)
            raise ConfigError(f"{variable}={shown} is invalid: {error}") from None
    return Config(**values)
