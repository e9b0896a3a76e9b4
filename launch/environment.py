"""The environment of the coordinator and the ranks: ``ringrun`` flags become ``RINGMASTER_*``.

Values travel only in the environment; command lines carry variable *names* (``-x NAME``),
so the job secret never shows in ``ps`` or in logs.
"""

from __future__ import annotations

from typing import Dict, List, Mapping, Optional

from ringmaster.common.config import MIB, Config, ConfigError, load_config
from ringmaster.common.huge_pages import TORCH_HUGE_PAGES, request_for_torch

from .errors import LaunchError

PREFIX = "RINGMASTER_"
COORDINATOR_ADDR = "RINGMASTER_COORDINATOR_ADDR"
SECRET = "RINGMASTER_SECRET"
#: Non-ringmaster variables forwarded to every rank (when set here).
PASSTHROUGH = ("PATH", "PYTHONPATH", "LD_LIBRARY_PATH", TORCH_HUGE_PAGES)


def _number(value: float) -> str:
    return repr(float(value)) if float(value) != int(value) else str(int(value))


def tuning_environment(
    *,
    fusion_threshold_mb: Optional[float] = None,
    cycle_time_ms: Optional[float] = None,
    stall_warning_s: Optional[float] = None,
    stall_shutdown_s: Optional[float] = None,
    allreduce: Optional[str] = None,
    start_timeout_s: Optional[float] = None,
    network_interface: Optional[str] = None,
    verbose: bool = False,
    heartbeat_interval_s: Optional[float] = None,
    heartbeat_timeout_s: Optional[float] = None,
    timeline_filename: Optional[str] = None,
    background_nice: Optional[int] = None,
    max_message_mb: Optional[float] = None,
    max_pending_requests: Optional[int] = None,
    cache_capacity: Optional[int] = None,
    gpu_transport: Optional[str] = None,
    autotune: bool = False,
    autotune_log_file: Optional[str] = None,
    autotune_warmup_samples: Optional[int] = None,
    autotune_steps_per_sample: Optional[int] = None,
) -> Dict[str, str]:
    """The ``RINGMASTER_*`` variables for the tuning flags that were given (``None``: not given).

    ``fusion_threshold_mb`` and ``max_message_mb`` are in MiB on the command line and in
    bytes in ``RINGMASTER_FUSION_THRESHOLD`` and ``RINGMASTER_MAX_MESSAGE_BYTES``.
    """
    env: Dict[str, str] = {}
    if fusion_threshold_mb is not None:
        env["RINGMASTER_FUSION_THRESHOLD"] = str(int(round(fusion_threshold_mb * MIB)))
    if cycle_time_ms is not None:
        env["RINGMASTER_CYCLE_TIME"] = _number(cycle_time_ms)
    if stall_warning_s is not None:
        env["RINGMASTER_STALL_WARNING_S"] = _number(stall_warning_s)
    if stall_shutdown_s is not None:
        env["RINGMASTER_STALL_SHUTDOWN_S"] = _number(stall_shutdown_s)
    if allreduce is not None:
        env["RINGMASTER_ALLREDUCE"] = allreduce
    if start_timeout_s is not None:
        env["RINGMASTER_START_TIMEOUT"] = _number(start_timeout_s)
    if network_interface is not None:
        env["RINGMASTER_NETWORK_INTERFACE"] = network_interface
    if verbose:
        env["RINGMASTER_LOG_LEVEL"] = "INFO"
    if heartbeat_interval_s is not None:
        env["RINGMASTER_HEARTBEAT_INTERVAL_S"] = _number(heartbeat_interval_s)
    if heartbeat_timeout_s is not None:
        env["RINGMASTER_HEARTBEAT_TIMEOUT_S"] = _number(heartbeat_timeout_s)
    if timeline_filename is not None:
        env["RINGMASTER_TIMELINE"] = timeline_filename
    if background_nice is not None:
        env["RINGMASTER_BACKGROUND_NICE"] = str(background_nice)
    if max_message_mb is not None:
        env["RINGMASTER_MAX_MESSAGE_BYTES"] = str(int(round(max_message_mb * MIB)))
    if max_pending_requests is not None:
        env["RINGMASTER_MAX_PENDING_REQUESTS"] = str(max_pending_requests)
    if cache_capacity is not None:
        env["RINGMASTER_CACHE_CAPACITY"] = str(cache_capacity)
    if gpu_transport is not None:
        env["RINGMASTER_GPU_TRANSPORT"] = gpu_transport
    if autotune:
        env["RINGMASTER_AUTOTUNE"] = "1"
    if autotune_log_file is not None:
        env["RINGMASTER_AUTOTUNE_LOG"] = autotune_log_file
    if autotune_warmup_samples is not None:
        env["RINGMASTER_AUTOTUNE_WARMUP_SAMPLES"] = str(autotune_warmup_samples)
    if autotune_steps_per_sample is not None:
        env["RINGMASTER_AUTOTUNE_STEPS_PER_SAMPLE"] = str(autotune_steps_per_sample)
    return env


def base_environment(environ: Mapping[str, str], tuning: Mapping[str, str]) -> Dict[str, str]:
    """``environ`` with ``tuning`` applied and any coordinator address or secret of an outer
    job removed (each ringrun job gets its own), and torch's huge pages requested unless
    ``environ`` says otherwise (:mod:`ringmaster.common.huge_pages`)."""
    env = {k: v for k, v in environ.items() if k not in (COORDINATOR_ADDR, SECRET)}
    env.update(tuning)
    request_for_torch(env)
    return env


def validated_config(env: Mapping[str, str]) -> Config:
    """Parse ``env`` as the ranks will, so a bad ``RINGMASTER_*`` value fails here, at once.

    Raises:
        LaunchError: naming the variable and what it must be.
    """
    try:
        return load_config(env)
    except ConfigError as error:
        raise LaunchError(str(error)) from None


def coordinator_environment(base: Mapping[str, str], secret: str) -> Dict[str, str]:
    """The environment of the coordinator daemon: ``base`` plus the job secret."""
    env = dict(base)
    env[SECRET] = secret
    return env


def job_environment(base: Mapping[str, str], coordinator_addr: str, secret: str) -> Dict[str, str]:
    """The environment of ``mpirun`` (and through it of the ranks)."""
    env = dict(base)
    env[COORDINATOR_ADDR] = coordinator_addr
    env[SECRET] = secret
    return env


def exported_names(env: Mapping[str, str]) -> List[str]:
    """Names of the variables to forward to every rank: the coordinator address and secret,
    every other ``RINGMASTER_*`` variable, then those of :data:`PASSTHROUGH` that are set."""
    first = [name for name in (COORDINATOR_ADDR, SECRET) if name in env]
    ringmaster = sorted(name for name in env if name.startswith(PREFIX) and name not in first)
    passthrough = [name for name in PASSTHROUGH if name in env]
    return first + ringmaster + passthrough
