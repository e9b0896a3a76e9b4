"""The environment of the coordinator and the ranks: ``ringrun`` flags become ``RINGMASTER_*``.

Values travel only in the environment; command lines carry variable *names* (``-x NAME``),
so the job secret never shows in ``ps`` or in logs.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping

from ringmaster.common.config import Config, ConfigError, load_config
from ringmaster.common.huge_pages import TORCH_HUGE_PAGES, request_for_torch

from .errors import LaunchError
from .setting_flags import setting_environment

PREFIX = "RINGMASTER_"
COORDINATOR_ADDR = "RINGMASTER_COORDINATOR_ADDR"
SECRET = "RINGMASTER_SECRET"
#: The coordinator's pid, for the ranks on its host: a stopped coordinator is told from a busy
#: one by its state in ``/proc`` (worker/runtime/host_watch.py).
COORDINATOR_PID = "RINGMASTER_COORDINATOR_PID"
#: Non-ringmaster variables forwarded to every rank (when set here).
PASSTHROUGH = ("PATH", "PYTHONPATH", "LD_LIBRARY_PATH", TORCH_HUGE_PAGES)


def tuning_environment(given: Mapping[str, Any], verbose: bool = False) -> Dict[str, str]:
    """The ``RINGMASTER_*`` variables of ringrun's setting flags that were given (``given``:
    flag attribute name -> value in the flag's units, ``None`` when not given; see
    ``common.config.SETTINGS``), and ``RINGMASTER_LOG_LEVEL=INFO`` for ``--verbose``.

    ``--fusion-threshold-mb`` and ``--max-message-mb`` are in MiB on the command line and in
    bytes in ``RINGMASTER_FUSION_THRESHOLD`` and ``RINGMASTER_MAX_MESSAGE_BYTES``.
    """
    env = setting_environment(given)
    if verbose:
        env["RINGMASTER_LOG_LEVEL"] = "INFO"
    return env


def base_environment(environ: Mapping[str, str], tuning: Mapping[str, str]) -> Dict[str, str]:
    """``environ`` with ``tuning`` applied and any coordinator address or secret of an outer
    job removed (each ringrun job gets its own), and torch's huge pages requested unless
    ``environ`` says otherwise (:mod:`ringmaster.common.huge_pages`)."""
    env = {k: v for k, v in environ.items() if k not in (COORDINATOR_ADDR, SECRET, COORDINATOR_PID)}
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


def job_environment(base: Mapping[str, str], coordinator_addr: str, secret: str,
                    coordinator_pid: str = "") -> Dict[str, str]:
    """The environment of ``mpirun`` (and through it of the ranks)."""
    env = dict(base)
    env[COORDINATOR_ADDR] = coordinator_addr
    env[SECRET] = secret
    if coordinator_pid:
        env[COORDINATOR_PID] = coordinator_pid
    return env


def exported_names(env: Mapping[str, str]) -> List[str]:
    """Names of the variables to forward to every rank: the coordinator address and secret,
    every other ``RINGMASTER_*`` variable, then those of :data:`PASSTHROUGH` that are set."""
    first = [name for name in (COORDINATOR_ADDR, SECRET) if name in env]
    ringmaster = sorted(name for name in env if name.startswith(PREFIX) and name not in first)
    passthrough = [name for name in PASSTHROUGH if name in env]
    return first + ringmaster + passthrough
