"""Job configuration: every ``RINGMASTER_*`` environment variable, parsed in one place.

``ringrun`` turns its flags into these variables; ranks started by plain ``mpirun`` read
the same variables. :func:`load_config` returns one frozen :class:`Config`.
"""

from __future__ import annotations

import dataclasses
import os
import textwrap
from typing import Any, Callable, Mapping, Optional, Tuple

from ringmaster.common.transports import gpu_transport_choices

MIB = 1024 * 1024


class ConfigError(ValueError):
    """A ``RINGMASTER_*`` variable holds a value that cannot be used."""


@dataclasses.dataclass(frozen=True)
class Config:
    """The settings of one ringmaster job (all ranks read the same environment).

    Replaced, once :data:`SETTINGS` is defined, by the same text followed by each field's
    description: the help of its :class:`Setting`, which is the only one.
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
    # A host other than the coordinator's whose agent (coordinator/host_agent.py, a process of
    # its own, so no rank's GIL can block it) sends nothing for this long is unreachable; the
    # figures that chose 8 s are in docs/configuration.md. 0: no host agents.
    host_timeout_s: float = 8.0
    straggler_report_min: float = 0.0
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


# ------------------------------------------------------------------ parsers
# Each takes the variable's text and returns the value, or raises ValueError saying what the
# value must be (load_config and ringrun's flags add the variable's name and the value).
def _text(value: str) -> str:
    return value


def _number(lo: float, hi: Optional[float] = None, *, whole: bool = False, above: bool = False,
            must: str = "") -> Callable[[str], Any]:
    """A parser of numbers from ``lo`` (above ``lo`` with ``above``) to ``hi`` (no bound: None);
    whole numbers with ``whole``. ``must``: what the value must be, where the bounds alone do
    not say it well."""
    convert = int if whole else float
    if not must:
        kind = "a whole number " if whole else ""
        must = f"{kind}from {lo} to {hi}" if hi is not None else f"{kind}{'>' if above else '>='} {lo}"

    def parse(value: str):
        number = convert(value)
        if number < lo or (above and number == lo) or (hi is not None and number > hi):
            raise ValueError(f"must be {must}")
        return number
    return parse


def _choice(*values: str) -> Callable[[str], str]:
    """A parser of one of ``values``, in any case and with spaces around; returns it as written
    here. Its ``choices`` are ringrun's for the flag."""
    by_key = {value.lower(): value for value in values}

    def parse(value: str) -> str:
        chosen = by_key.get(value.strip().lower())
        if chosen is None:
            raise ValueError(f"must be one of {', '.join(values)}")
        return chosen
    parse.choices = values
    return parse


def _path(rank_template: bool = False) -> Callable[[str], str]:
    """A parser of a file path whose directory exists (``{rank}`` in it stands for a rank)."""
    def parse(value: str) -> str:
        directory = os.path.dirname(os.path.abspath(value.replace("{rank}", "0") if rank_template else value))
        if not os.path.isdir(directory):
            raise ValueError(f"its directory {directory} does not exist; create it first")
        return value
    return parse


def _switch(value: str) -> bool:
    value = value.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError("must be 1 or 0 (also true/false, yes/no, on/off)")


#: The smallest message limit: the largest single request the coordinator accepts (a 4 KiB
#: name, 64 dimensions, a group name) and its responses fit many times over.
MIN_MESSAGE_BYTES = 64 * 1024
#: The largest: gRPC accepts twice the limit (common/message_size.py), and lengths are int32.
MAX_MESSAGE_BYTES = 1 << 30
#: The most slots a response cache may have: each costs one integer in every cycle's allreduce.
MAX_CACHE_CAPACITY = 1 << 16


def _gpu_transport(value: str) -> str:
    """A parser of RINGMASTER_GPU_TRANSPORT: ``auto`` or a transport registered for CUDA
    (``common/transports.py``), asked when the value is read, so that a transport the training
    script registered before ``rm.init()`` is one. Its ``choices`` (ringrun's flag) are ringmaster's own."""
    return _choice(*gpu_transport_choices())(value)


_gpu_transport.choices = gpu_transport_choices()

_SECONDS = _number(0, above=True)
_SECONDS_OR_NEVER = _number(0)
_COUNT = _number(1, whole=True)


@dataclasses.dataclass(frozen=True)
class Setting:
    """One setting of a job, described once: its variable, its :class:`Config` field, its
    parser, its help, and (for those ``ringrun`` offers) its flag. ``ringrun``'s flags, their
    help text with the default, their checks and the variables they set are all derived from
    these (``ringmaster.launch.setting_flags``), and so is the description of each
    :class:`Config` field; ranks read the variables through :func:`load_config`.

    Attributes:
        variable: the ``RINGMASTER_*`` environment variable.
        field: the :class:`Config` field it sets (whose default is the setting's default).
        parse: text of the variable -> value; raises ``ValueError`` saying what it must be.
        flag: ``ringrun``'s flag, or ``None`` where only the variable exists.
        help: what the setting does, without the default: the :class:`Config` field's
            description, and the flag's help (where ringrun adds the default).
        group: which of ringrun's option groups lists the flag ("job", "tuning", "network").
        metavar: the flag's value in the help text.
        unit: how many of the variable's units one of the flag's is (MiB flags: bytes).
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
    switch: bool = False
    default_text: Optional[str] = None

    @property
    def choices(self) -> Tuple[str, ...]:
        """The allowed values, for a setting whose parser is a choice (``_choice``)."""
        return getattr(self.parse, "choices", ())

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
    Setting("RINGMASTER_COORDINATOR_ADDR", "coordinator_addr", _text,
            help="host:port of the coordinator daemon (set by ringrun); unset: rank 0 starts one itself "
                 "(plain mpirun)"),
    Setting("RINGMASTER_SECRET", "secret", _text,
            help="the job token every coordinator call carries (set by ringrun); never logged"),
    Setting("RINGMASTER_START_TIMEOUT", "start_timeout_s", _SECONDS, "--start-timeout",
            "seconds to wait for the coordinator and the ranks to start", group="job", metavar="S"),
    Setting("RINGMASTER_FUSION_THRESHOLD", "fusion_threshold_bytes", _number(0, whole=True), "--fusion-threshold-mb",
            "largest fused allreduce buffer (0 disables fusion)", metavar="MB", unit=MIB),
    Setting("RINGMASTER_CYCLE_TIME", "cycle_time_ms", _number(0), "--cycle-time-ms",
            "coordinator cycle time in milliseconds: how long it waits for more ready tensors to fuse with, "
            "once tensors are ready while others are still being declared", metavar="MS"),
    Setting("RINGMASTER_STALL_WARNING_S", "stall_warning_s", _SECONDS, "--stall-warning-s",
            "warn about tensors some ranks have not declared after S seconds", metavar="S"),
    Setting("RINGMASTER_STALL_SHUTDOWN_S", "stall_shutdown_s", _SECONDS_OR_NEVER, "--stall-shutdown-s",
            "abort the job after a stall of S seconds (0: never)", metavar="S"),
    Setting("RINGMASTER_ALLREDUCE", "allreduce_algorithm", _choice("auto", "ring", "mpi"), "--allreduce",
            "allreduce algorithm: ringmaster's ring, MPI_Allreduce, or auto (by size)"),
    Setting("RINGMASTER_HIERARCHICAL_ALLREDUCE", "hierarchical_allreduce", _switch, "--hierarchical-allreduce",
            "across hosts with as many ranks each, reduce big tensors within each host first and run the "
            "ring only between hosts (Horovod's HOROVOD_HIERARCHICAL_ALLREDUCE)", switch=True, default_text="off"),
    Setting("RINGMASTER_HOST_AGGREGATOR", "host_aggregator", _switch, "--host-aggregator",
            "one daemon per host merges its ranks' requests before they reach the coordinator (for jobs "
            "of hundreds of ranks; ringmaster.coordinator.aggregator)", switch=True, default_text="off"),
    Setting("RINGMASTER_HEARTBEAT_INTERVAL_S", "heartbeat_interval_s", _SECONDS, "--heartbeat-interval-s",
            "how often an idle rank tells the coordinator it is alive", metavar="S"),
    Setting("RINGMASTER_HEARTBEAT_TIMEOUT_S", "heartbeat_timeout_s", _SECONDS, "--heartbeat-timeout-s",
            "declare a rank dead after S seconds without a heartbeat", metavar="S"),
    Setting("RINGMASTER_HOST_TIMEOUT_S", "host_timeout_s", _SECONDS_OR_NEVER, "--host-timeout-s",
            "declare a host unreachable after S seconds without its host agent's heartbeat (sent every "
            "second); ranks and agents that hear nothing from the coordinator for as long end "
            "themselves (0: no host agents)", metavar="S"),
    Setting("RINGMASTER_STRAGGLER_REPORT_MIN", "straggler_report_min", _SECONDS_OR_NEVER, "--straggler-report",
            "log the straggler report (each rank's mean lateness per negotiated collective) every N minutes "
            "as well as at the end of the job (0: only at the end, and only when a rank stands out)",
            metavar="N"),
    Setting("RINGMASTER_BACKGROUND_NICE", "background_nice", _number(0, 19, whole=True), "--background-nice",
            "nice value 0-19 of each rank's communication thread (19: it uses the cycles training "
            "leaves; 0: equal priority)", metavar="N"),
    Setting("RINGMASTER_MAX_MESSAGE_BYTES", "max_message_bytes",
            _number(MIN_MESSAGE_BYTES, MAX_MESSAGE_BYTES, whole=True,
                    must=f"a number of bytes from {MIN_MESSAGE_BYTES} (64 KiB) to {MAX_MESSAGE_BYTES} (1 GiB)"),
            "--max-message-mb",
            "largest message between a rank and the coordinator (longer request and response lists go "
            "as several messages)", metavar="MB", unit=MIB),
    Setting("RINGMASTER_MAX_PENDING_REQUESTS", "max_pending_requests", _COUNT, "--max-pending-requests",
            "tensors one rank may have waiting for other ranks (one more fails, naming this cap)", metavar="N"),
    Setting("RINGMASTER_CACHE_CAPACITY", "cache_capacity",
            _number(0, MAX_CACHE_CAPACITY, whole=True,
                    must=f"a whole number from 0 (no cache) to {MAX_CACHE_CAPACITY}"), "--cache-capacity",
            "negotiated collectives each rank's response cache keeps, so that calling one again skips "
            "the coordinator (0: no cache)", metavar="N"),
    Setting("RINGMASTER_GPU_TRANSPORT", "gpu_transport", _gpu_transport, "--gpu-transport",
            "how collectives of CUDA tensors move data (ringmaster.ops.gpu)",
            default_text="auto: nccl with a GPU per rank, ipc for ranks sharing a GPU on one host, mpi if "
                         "CUDA-aware, else staged"),
    Setting("RINGMASTER_AUTOTUNE", "autotune", _switch, "--autotune",
            "tune fusion threshold, cycle time, ring/MPI crossover and response cache during the first "
            "steps (rank 0 tunes, every rank uses its choice)", switch=True, default_text="off"),
    Setting("RINGMASTER_AUTOTUNE_LOG", "autotune_log", _path(), "--autotune-log-file",
            "write every autotuning trial and the final choice to this CSV file (rank 0)", metavar="PATH"),
    Setting("RINGMASTER_AUTOTUNE_WARMUP_SAMPLES", "autotune_warmup_samples", _number(0, whole=True),
            "--autotune-warmup-samples", "autotuning samples discarded before the search", metavar="N"),
    Setting("RINGMASTER_AUTOTUNE_STEPS_PER_SAMPLE", "autotune_steps_per_sample", _COUNT,
            "--autotune-steps-per-sample", "steps (repeats of one tensor name) per autotuning sample",
            metavar="N"),
    Setting("RINGMASTER_TIMELINE", "timeline", _path(rank_template=True), "--timeline-filename",
            "record a Chrome-tracing timeline of every tensor to PATH ({rank} in PATH: one file per rank; "
            "otherwise rank 0's)", metavar="PATH"),
    Setting("RINGMASTER_NETWORK_INTERFACE", "network_interface", _text, "--network-interface",
            "interface for the coordinator and MPI's TCP traffic, e.g. eth0", group="network", metavar="IF"),
    Setting("RINGMASTER_LOG_LEVEL", "log_level", _choice("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
            help="Python logging level of the ringmaster loggers (ringrun --verbose sets INFO)"),
    Setting("RINGMASTER_GRADIENT_PLAN", "gradient_plan", _switch,
            help="after its first step, DistributedOptimizer reduces gradients in fixed buckets negotiated "
                 "once per step (ringmaster.worker.runtime.gradient_plan); off: every gradient is negotiated "
                 "on its own, every step"),
    Setting("RINGMASTER_PLAN_OVERLAP", "plan_overlap", _choice("auto", "all", "small"),
            help="which of the gradient plan's buckets start during the backward pass: all; small (only "
                 "those that are one small MPI call, the others wait for step()); or auto: all when each "
                 "rank has a core to spare beyond its torch threads, else small"),
    Setting("RINGMASTER_RESULT_POOL", "result_pool", _switch,
            help="out-of-place allreduces of large tensors write into memory released by the caller's "
                 "earlier results instead of fresh pages (ringmaster.worker.runtime.result_memory)"),
    Setting("RINGMASTER_CACHE_STALL_S", "cache_stall_s", _SECONDS_OR_NEVER,
            help="a response-cache cycle that some ranks have waited in this long while others never "
                 "entered it ends the job with an error naming those others (0: never; "
                 "ringmaster.coordinator.cache_stalls)"),
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


def _config_doc() -> str:
    """:class:`Config`'s docstring: its own first paragraph, then each field's setting."""
    lines = [Config.__doc__.split("\n\n")[0], "",
             "    Attributes (each described by its :class:`Setting` in :data:`SETTINGS`):"]
    for setting in SETTINGS:
        where = f"``{setting.variable}``, default {setting.default!r}"
        help_text = setting.help
        text = (f"{setting.field}: {help_text[:-1]}; {where})" if help_text.endswith(")")
                else f"{setting.field}: {help_text} ({where})")
        lines += textwrap.wrap(text, 100, initial_indent="        ", subsequent_indent="            ")
    return "\n".join(lines) + "\n    "


Config.__doc__ = _config_doc()
