"""Start, watch and stop the job's coordinator daemon (``python -m ringmaster.coordinator``).

Contract with the coordinator: it takes ``--size N --bind ADDR --port 0 --address-file PATH
--exit-on-stdin-eof``, reads ``RINGMASTER_SECRET`` (and the other ``RINGMASTER_*``
variables) from its environment, writes ``host:port\\n`` to the address file atomically (by
rename) once it listens, and exits when its stdin reaches end of file — so it also goes
away when ringrun dies, because ringrun holds the other end of that pipe.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from typing import List, Mapping, Optional

from ringmaster.common import proc

from .errors import FAILURE_EXIT, LaunchError
from .processes import die_with_parent

#: The module run as the coordinator daemon.
COORDINATOR_MODULE = "ringmaster.coordinator"
_WILDCARDS = ("0.0.0.0", "::", "[::]", "")


class CoordinatorProcess:
    """The coordinator daemon of one job.

    Args:
        size: number of ranks.
        bind: address to listen on.
        advertise: address ranks dial when the coordinator reports a wildcard address.
        env: its environment (must hold ``RINGMASTER_SECRET``; nothing secret goes on its
            command line).
        address_file: where the coordinator writes ``host:port``.
        start_timeout: seconds to wait for that file.
        stderr: where its messages go (default: ringrun's own stderr; a file for benchmarks
            that read them).
        report_file: where it appends one JSON line per abort (``--report-file``), which
            ringrun watches (:mod:`.abort_watch`); None: no report.
    """

    def __init__(self, size: int, bind: str, advertise: str, env: Mapping[str, str],
                 address_file: str, start_timeout: float, stderr=None, report_file: Optional[str] = None):
        self.size = size
        self.bind = bind
        self.advertise = advertise
        self.env = dict(env)
        self.address_file = address_file
        self.start_timeout = start_timeout
        self.stderr = stderr
        self.report_file = report_file
        self.process: Optional[subprocess.Popen] = None
        self.address: Optional[str] = None

    def command(self) -> List[str]:
        """The coordinator's command line (no secret in it)."""
        command = [sys.executable, "-m", COORDINATOR_MODULE, "--size", str(self.size),
                   "--bind", self.bind, "--port", "0", "--address-file", self.address_file,
                   # --persistent: ranks may init() again after shutdown() in the same job
                   "--exit-on-stdin-eof", "--persistent"]
        if self.advertise != self.bind:
            command += ["--advertise", self.advertise]
        if self.report_file is not None:
            command += ["--report-file", self.report_file]
        return command

    def start(self) -> str:
        """Start the daemon and wait until it listens.

        Returns:
            The ``host:port`` ranks should dial.

        Raises:
            LaunchError: it could not be started, exited, or did not report its address
                within ``start_timeout`` seconds.
        """
        try:
            self.process = subprocess.Popen(
                self.command(), stdin=subprocess.PIPE, stderr=self.stderr, env=self.env, start_new_session=True,
                # it also leaves on stdin EOF; if ringrun is killed, nothing is left to save
                preexec_fn=die_with_parent(signal.SIGKILL),
            )
        except OSError as error:
            raise LaunchError(f"cannot start the coordinator: {error}", FAILURE_EXIT) from None
        self.address = self._wait_for_address()
        return self.address

    def _wait_for_address(self) -> str:
        deadline = time.monotonic() + self.start_timeout
        while True:
            text = self._read_address_file()
            if text is not None:
                return self._advertised(text)
            code = self.process.poll()
            if code is not None:
                raise LaunchError(
                    f"the coordinator exited with status {_describe_status(code)} before it "
                    f"started listening (its messages, if any, are above)", FAILURE_EXIT)
            if time.monotonic() >= deadline:
                raise LaunchError(
                    f"the coordinator did not start listening within {self.start_timeout:g} s "
                    f"(--start-timeout)", FAILURE_EXIT)
            time.sleep(0.02)

    def _read_address_file(self) -> Optional[str]:
        try:
            with open(self.address_file, encoding="utf-8") as handle:
                text = handle.read()
        except FileNotFoundError:
            return None
        return text if text.endswith("\n") else None

    def _advertised(self, text: str) -> str:
        host, sep, port = text.strip().rpartition(":")
        if not sep or not port.isdigit():
            raise LaunchError(
                f"the coordinator wrote an unusable address {text.strip()!r} to {self.address_file}",
                FAILURE_EXIT)
        if host in _WILDCARDS:
            host = self.advertise
        return f"{host}:{port}"

    def send_signal(self, signum: int) -> None:
        """Forward ``signum`` to the daemon (if it runs)."""
        if self.process is not None and self.process.poll() is None:
            try:
                self.process.send_signal(signum)
            except ProcessLookupError:
                pass

    def stop(self, eof_grace: float = 2.0, term_grace: float = 5.0) -> None:
        """Close its stdin (it exits on EOF); SIGTERM it if it is still there after
        ``eof_grace`` seconds, SIGKILL after ``term_grace`` more. Safe to call twice."""
        process = self.process
        if process is None:
            return
        if process.stdin is not None:
            try:
                process.stdin.close()
            except OSError:
                pass
        if _stopped(process.pid):  # SIGSTOPped: it reads neither EOF nor SIGTERM; nothing to save
            process.kill()
        for grace, action in ((eof_grace, process.terminate), (term_grace, process.kill)):
            try:
                process.wait(grace)
                return
            except subprocess.TimeoutExpired:
                try:
                    action()
                except ProcessLookupError:
                    pass
        process.wait()


def _stopped(pid: int) -> bool:
    return proc.state(pid) in proc.STOPPED_STATES


def _describe_status(code: int) -> str:
    if code < 0:
        try:
            return f"{code} (killed by {signal.Signals(-code).name})"
        except ValueError:
            return str(code)
    return str(code)
