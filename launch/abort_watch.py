"""How ringrun learns that its job is over although ``mpirun`` still runs.

``mpirun`` (Open MPI's prterun) ends a job whose rank failed only once every host's daemon
has answered; a host cut off the network never answers, and ringrun used to wait for ever
(issue 46: still running 200 s after the cut). The coordinator writes each abort to its
report file (``--report-file``: one JSON line, with the reason and the failed host). ringrun
reads it between output pumps; from the first abort on, the launcher gets
:data:`ABORT_GRACE_S` to end by itself, then its whole session (``mpirun``, the ssh sessions
it opened, the local ranks) is killed. A coordinator that is stopped (``SIGSTOP``, a frozen
VM) writes nothing: once its process has been stopped for the host timeout and the grace,
the same happens. Either way ringrun's last line says why the job ended. A job that ends by
itself while the coordinator is stopped, before that limit (its ranks off the coordinator's host
count the same timeout from the last answer to their pings, which may be a second earlier),
gets the same last line, with how long the stop had been seen.
"""

from __future__ import annotations

import json
import time
from typing import Callable, Optional

from ringmaster.common import proc

#: Seconds the launcher gets to end on its own after the coordinator aborted the job. mpirun
#: ends a job whose ranks all exited within about a second when every host answers (the ranks
#: of an aborted job exit at once); the rest of the bound of 10 s is left for the teardown.
ABORT_GRACE_S = 5.0


class AbortWatch:
    """Watches the coordinator's report file (and its process) for the end of the job.

    Args:
        report_file: the coordinator's ``--report-file``.
        coordinator_pid: its pid, watched for a stop (None: not watched).
        stop_limit_s: how long the coordinator may be stopped before the job counts as over.
        grace_s: what the launcher gets to end by itself after that.
        clock: for tests.
    """

    def __init__(self, report_file: str, coordinator_pid: Optional[int] = None, stop_limit_s: float = 8.0,
                 grace_s: float = ABORT_GRACE_S, clock: Callable[[], float] = time.monotonic):
        self.report_file = report_file
        self.coordinator_pid = coordinator_pid
        self.stop_limit_s = stop_limit_s
        self.grace_s = grace_s
        self._clock = clock
        self._offset = 0
        self._stopped_since: Optional[float] = None
        self._stopped_seen_at: Optional[float] = None  # the last look that found it stopped
        self.cause: Optional[str] = None  # why the job is over, once known
        self.seen_at: Optional[float] = None
        self.killed = False

    def due(self) -> bool:
        """True once the job is over and the launcher has had its grace: kill it now (once)."""
        now = self._clock()
        if self.cause is None:
            self.cause = self._read_abort() or self._stopped_coordinator(now)
            if self.cause is not None:
                self.seen_at = now
        if self.cause is None or self.killed or now - self.seen_at < self.grace_s:
            return False
        self.killed = True
        return True

    def last_line(self) -> Optional[str]:
        """ringrun's last line when the job was aborted, or ended while the coordinator was
        stopped (None: neither)."""
        if self.cause is None and self._stopped_since is not None:
            seen_s = self._stopped_seen_at - self._stopped_since
            since = f"for {seen_s:.0f} s or more" if seen_s >= 1 else "when the job ended"
            return (f"the job ended while the coordinator (pid {self.coordinator_pid}) had stopped answering: its "
                    f"process was stopped (SIGSTOP, or a debugger holds it) {since}")
        if self.cause is None:
            return None
        tail = (f"; mpirun had not ended {self.grace_s:g} s later, so ringrun killed it, its ssh sessions and "
                f"its local processes" if self.killed else "")
        return f"the job was aborted: {self.cause}{tail}"

    def _read_abort(self) -> Optional[str]:
        try:
            with open(self.report_file, "rb") as handle:
                handle.seek(self._offset)
                data = handle.read()
        except FileNotFoundError:
            return None
        end = data.rfind(b"\n") + 1
        self._offset += end
        for line in data[:end].splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("event") == "abort":
                return str(event.get("reason", "the coordinator aborted it"))
        return None

    def _stopped_coordinator(self, now: float) -> Optional[str]:
        if self.coordinator_pid is None or self.stop_limit_s <= 0:
            return None
        if proc.state(self.coordinator_pid) not in proc.STOPPED_STATES:
            self._stopped_since = None
            return None
        if self._stopped_since is None:
            self._stopped_since = now
        self._stopped_seen_at = now
        if now - self._stopped_since < self.stop_limit_s:
            return None
        return (f"the coordinator (pid {self.coordinator_pid}) stopped answering: its process has been stopped "
                f"(SIGSTOP, or a debugger holds it) for {now - self._stopped_since:.0f} s")


__all__ = ["ABORT_GRACE_S", "AbortWatch"]
