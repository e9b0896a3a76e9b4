"""The start of each of ringmaster's daemons, written once.

The coordinator (``python -m ringmaster.coordinator``) and the host aggregator
(``python -m ringmaster.coordinator.aggregator``) start alike: they read the job's
``RINGMASTER_*`` variables, log to standard error under a tag, refuse to run without the
job token, tell their starter where they listen through an address file, and may end when
their standard input closes (their starter died). The elastic state service
(``launch/elastic_service.py``) shares the last two.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
from typing import Callable

from ringmaster.common.config import Config, ConfigError, load_config


def run_daemon(name: str, log_tag: str, serve: Callable[[Config], int]) -> int:
    """Read the configuration, set up logging and check the token, then ``serve(config)``.

    Returns ``serve``'s exit status, or 2 (after a line on standard error naming the daemon)
    for an invalid variable or a missing ``RINGMASTER_SECRET``.
    """
    try:
        config = load_config()
    except ConfigError as error:
        return refuse(name, str(error))
    logging.basicConfig(level=config.log_level, stream=sys.stderr,
                        format=f"[{log_tag}] ringmaster %(levelname)s: %(message)s")
    logging.getLogger("grpc._cython.cygrpc").addFilter(_drop_cancelled_streams)
    if not config.secret:
        return refuse(name, f"RINGMASTER_SECRET is not set; the {name} refuses to run without a job token")
    return serve(config)


def refuse(name: str, message: str, status: int = 2) -> int:
    """Say on standard error why daemon ``name`` does not run; returns ``status``."""
    print(f"ringmaster {name}: error: {message}", file=sys.stderr)
    return status


def write_address(path: str, address: str) -> None:
    """Write ``address`` and a newline to ``path`` atomically, so a reader never sees half an address."""
    temporary = f"{path}.tmp{os.getpid()}"
    with open(temporary, "w", encoding="utf-8") as handle:
        handle.write(address + "\n")
    os.replace(temporary, path)


def read_until_eof() -> None:
    """Block until standard input reaches end of file (or cannot be read)."""
    try:  # raw reads: a buffered reader's lock would trip interpreter shutdown
        while os.read(sys.stdin.fileno(), 4096):
            pass
    except (OSError, ValueError):
        pass


def on_stdin_eof(callback: Callable[[], None]) -> None:
    """Call ``callback`` on a daemon thread once standard input closes."""
    def watch():
        read_until_eof()
        callback()

    threading.Thread(target=watch, name="ringmaster-stdin-watch", daemon=True).start()


def _drop_cancelled_streams(record: logging.LogRecord) -> bool:
    """gRPC logs a traceback for every stream still open when the server stops (its handler is
    cancelled): that is how a daemon ends, after an abort too, not an error."""
    return not (record.exc_info and isinstance(record.exc_info[1], asyncio.CancelledError))


__all__ = ["on_stdin_eof", "read_until_eof", "refuse", "run_daemon", "write_address"]
