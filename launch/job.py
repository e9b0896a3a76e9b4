"""Run the MPI launcher: its own session, signal forwarding, output relay, exit status.

ringrun runs single-threaded (see :class:`~.output.OutputRelay`), so that mpirun receives
its parent-death SIGTERM exactly once if ringrun is killed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import BinaryIO, Callable, Mapping, Optional, Sequence

from .abort_watch import AbortWatch
from .errors import LaunchError
from .output import OutputRelay
from .processes import die_with_parent, reap_session, signal_session

#: Signals ringrun forwards to the job (and then, if it lingers, escalates to SIGKILL).
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
#: Passed on to mpirun, which passes it to every rank: each prints its threads' stacks
#: (ringmaster.worker.runtime.stack_dumps) and the job goes on.
STACKS_SIGNAL = signal.SIGUSR1


def exit_status(returncode: int, received_signal: Optional[int]) -> int:
    """ringrun's exit status: ``128 + signum`` if ringrun was stopped by a signal or the
    launcher was killed by one, else the launcher's own status (the first failing rank's)."""
    if received_signal is not None:
        return 128 + received_signal
    if returncode < 0:
        return 128 - returncode
    return returncode


class MpiJob:
    """One run of the MPI launcher command.

    Args:
        command: the launcher command line.
        env: its environment (holds the values of the ``-x`` names).
        relay: where its output goes.
        on_signal: called with each signal ringrun receives while the job runs, after it has
            been forwarded to the launcher (ringrun forwards it to the coordinator there).
        kill_grace: seconds the launcher gets to end after a forwarded signal before its whole
            session (mpirun and the local ranks) is SIGKILLed.
        abort_watch: tells when the coordinator aborted the job (:mod:`.abort_watch`): the
            launcher's session is then SIGKILLed after its grace, whatever mpirun waits for.
    """

    def __init__(self, command: Sequence[str], env: Mapping[str, str], relay: OutputRelay,
                 on_signal: Optional[Callable[[int], None]] = None, kill_grace: float = 5.0,
                 abort_watch: Optional[AbortWatch] = None):
        self.command = list(command)
        self.env = dict(env)
        self.relay = relay
        self.on_signal = on_signal
        self.kill_grace = kill_grace
        self.abort_watch = abort_watch
        self.received_signal: Optional[int] = None
        self._kill_at: Optional[float] = None
        self._forwarded = False
        self._process: Optional[subprocess.Popen] = None

    def run(self, sink_out: Optional[BinaryIO] = None, sink_err: Optional[BinaryIO] = None) -> int:
        """Run the launcher to its end, relaying its output, and return ringrun's exit status."""
        sink_out = sink_out if sink_out is not None else getattr(sys.stdout, "buffer", None)
        sink_err = sink_err if sink_err is not None else getattr(sys.stderr, "buffer", None)
        previous = {signum: signal.signal(signum, self._forward) for signum in FORWARDED_SIGNALS}
        previous[STACKS_SIGNAL] = signal.signal(STACKS_SIGNAL, self._ask_for_stacks)
        try:
            try:
                self._process = subprocess.Popen(
                    self.command, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                    start_new_session=True, preexec_fn=die_with_parent(),
                )
            except OSError as error:
                raise LaunchError(f"cannot run {self.command[0]}: {error}", 1) from None
            if self.received_signal is not None:  # it came while mpirun was being started
                self._signal_launcher(self.received_signal)
            self.relay.attach(self._process.stdout, self._process.stderr, sink_out, sink_err)
            returncode = self._wait()
        finally:
            process = self._process
            if process is not None:
                if process.poll() is None:  # an exception got us here: take the job down
                    signal_session(process.pid, signal.SIGKILL)
                    process.wait()
                reap_session(process.pid, grace=2.0)
                self.relay.drain(timeout=5.0)
            self.relay.close()
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        return exit_status(returncode, self.received_signal)

    def _wait(self) -> int:
        process = self._process
        while True:
            self.relay.pump(0.1)
            returncode = process.poll()
            if returncode is not None:
                return returncode
            if self._kill_at is not None and time.monotonic() >= self._kill_at:
                signal_session(process.pid, signal.SIGKILL)
                self._kill_at = None
            if self._should_stop() or (self.abort_watch is not None and self.abort_watch.due()):
                signal_session(process.pid, signal.SIGKILL)

    def _should_stop(self) -> bool:
        """Asked between output pumps while the job runs: True kills it (the elastic driver's hook)."""
        return False

    def _forward(self, signum: int, frame) -> None:
        if self.received_signal is None:
            self.received_signal = signum
        self._signal_launcher(signum)
        if self.on_signal is not None:
            self.on_signal(signum)

    def _ask_for_stacks(self, signum: int, frame) -> None:
        process = self._process
        if process is not None and process.returncode is None:
            try:
                os.kill(process.pid, signum)
            except ProcessLookupError:
                pass

    def _signal_launcher(self, signum: int) -> None:
        """Pass the first signal on to mpirun (which forwards it to every rank) and give it
        ``kill_grace`` seconds; on a second signal, kill at once. mpirun itself must see only
        one: Open MPI's mpirun abandons its ranks when a second SIGTERM or SIGINT arrives."""
        process = self._process
        if process is None or process.returncode is not None:
            return
        if self._forwarded:
            self._kill_at = time.monotonic()
            return
        self._forwarded = True
        try:
            os.kill(process.pid, signum)
        except ProcessLookupError:
            pass
        self._kill_at = time.monotonic() + self.kill_grace
