"""The coordinator's watch over a running job: silent ranks, stalls, and what ``/proc`` says.

Every housekeeping tick the server (:mod:`.server`) asks :func:`check` about the job; the
answer is ``None`` (the job goes on, perhaps after warnings in the log) or the
:class:`Verdict` that ends it. Five checks, in this order:

- a rank silent past ``RINGMASTER_HEARTBEAT_TIMEOUT_S`` has failed, unless its process is on
  this host and runs (its threads are starved of the CPU): that one is waited for up to
  :data:`LIVE_SILENCE_FACTOR` heartbeat timeouts;
- a response-cache cycle that some ranks never entered (``RINGMASTER_CACHE_STALL_S``);
- tensors some ranks declared and others did not (a warning per stall, after
  ``RINGMASTER_STALL_WARNING_S``);
- gradient plans some ranks wait in (a warning likewise);
- either kind of stall past ``RINGMASTER_STALL_SHUTDOWN_S`` ends the job.

What a rank's process is doing is read from ``/proc`` when it runs on this host
(:func:`process_state`, :func:`process_runs`); the host aggregators ask the same of theirs.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import socket
import time
from typing import TYPE_CHECKING, Mapping, Optional, Sequence

from ringmaster.common import proc
from ringmaster.common.config import Config
from ringmaster.coordinator.cache_stalls import describe as describe_cache_stall
from ringmaster.coordinator.cache_stalls import describe_slow as describe_slow_cache_cycle
from ringmaster.coordinator.host_liveness import BEAT_INTERVAL_S
from ringmaster.coordinator.negotiation import Stall
from ringmaster.coordinator.stall_report import in_set, shutdown_reason, stall_key, warning_lines
from ringmaster.coordinator.validation import shown
from ringmaster.coordinator.verdict import Verdict
from ringmaster.proto import ringmaster_pb2 as pb

if TYPE_CHECKING:
    from ringmaster.coordinator.generation import Generation
    from ringmaster.coordinator.host_liveness import HostLiveness
    from ringmaster.coordinator.sessions import RankSession

log = logging.getLogger("ringmaster.coordinator")

#: A rank on the coordinator's host whose process runs but that sends nothing is waited for this
#: many heartbeat timeouts (a host can starve threads for minutes, docs/architecture.md), then
#: the job ends: its threads are not merely slow.
LIVE_SILENCE_FACTOR = 5

#: A silent rank of another host is read through its host agent only if the agent's last beat
#: is at most this many beat intervals old.
FRESH_BEATS = 3

#: Process states (``/proc/PID/stat``) of a process that runs, or waits to: not stopped, not exited.
_LIVE_STATES = ("R", "S", "D", "I")

_STOPPED = "it is stopped (SIGSTOP, or a debugger holds it)"
_EXITED = "its process has exited"
#: What a silent rank's process state says about it.
_WHY_SILENT = {"T": _STOPPED, "t": _STOPPED, "Z": _EXITED, "X": _EXITED, "gone": _EXITED}


def check(config: Config, size: int, sessions: Mapping[int, "RankSession"], generation: "Generation",
          now: float, hosts: Optional["HostLiveness"] = None) -> Optional[Verdict]:
    """One look at a job whose ranks all registered (``sessions``: rank -> its stream; ``hosts``:
    the host agents' heartbeats, :mod:`.host_liveness`)."""
    host_of = lambda rank: describe_rank(sessions, rank)  # noqa: E731
    verdict = hosts.check(config.host_timeout_s, sessions, now, socket.gethostname()) if hosts is not None else None
    if verdict is None:
        verdict = _silent_rank(config, sessions, now, hosts)
    if verdict is None and config.cache_stall_s > 0:
        verdict = _stalled_cache(config, size, generation, host_of)
    if verdict is None:
        verdict = _stalls(config, generation, host_of, now, lambda ranks: ask_for_stacks(sessions, ranks, hosts))
    return verdict


#: Late ranks asked for their stacks at most per stall warning (each prints every thread's stack).
MAX_STACKS = 4


def ask_for_stacks(sessions: Mapping[int, "RankSession"], ranks: Sequence[int],
                   hosts: Optional["HostLiveness"]) -> None:
    """Have the late ``ranks`` of a stall warning print their Python stacks (SIGUSR1: the runtime's
    stack dump) while the job still runs: directly on this host, through the host agent elsewhere.

    SIGUSR1's default action ends a process, so only a rank that said it installed the stack dump
    is asked, and here only while its pid is still the process that registered (its start time):
    never a reused pid, a process of another pid namespace under the same host name, or a
    program that owns SIGUSR1 (a SLURM ``--signal=USR1`` preemption handler)."""
    for rank in list(ranks)[:MAX_STACKS]:
        session = sessions.get(rank)
        if session is None or session.pid <= 0 or not session.stack_dump_handler:
            continue
        if session.hostname == socket.gethostname():
            if not proc.send_signal(proc.ProcessIdentity(session.pid, session.start_time or None), signal.SIGUSR1):
                continue
        elif hosts is None or not hosts.want_stacks(session.hostname, session.pid):
            continue
        log.warning("stall: %s was asked for its Python stacks: they follow in its output (its stderr)",
                    session.describe())


def excuse_silence(sessions: Mapping[int, "RankSession"], late_s: float) -> None:
    """The coordinator's loop did not run for ``late_s`` (an overloaded host, the process
    stopped): the ranks' messages of that time may still wait unread, so their silence does
    not count.

    Without this, the first tick after such a pause found every rank silent and aborted
    the job blaming a rank that was alive (seen with 8 ranks on 2 busy cores: "rank 5 sent
    no heartbeat for 53 s" with a 15 s limit, i.e. the check itself ran 38 s late).
    """
    log.warning("the coordinator did not run for %.1f s (its host is overloaded?); the ranks' silence in "
                "that time is not counted against their heartbeats", late_s)
    for session in sessions.values():
        session.last_seen += late_s


def describe_rank(sessions: Mapping[int, "RankSession"], rank: int) -> str:
    """``rank`` and its host, as stall messages name it."""
    session = sessions.get(rank)
    return f"rank {rank} on {shown(session.hostname)}" if session else f"rank {rank}"


# ------------------------------------------------------------------ the checks
def _silent_rank(config: Config, sessions: Mapping[int, "RankSession"], now: float,
                 hosts: Optional["HostLiveness"] = None) -> Optional[Verdict]:
    timeout_s = config.heartbeat_timeout_s
    for session in list(sessions.values()):
        if now - session.last_seen <= timeout_s:
            continue
        silent_s = now - session.last_seen
        if session.silent_since is not None:
            silent_s = now - session.silent_since
        state = process_state(session) if session.pid > 0 else None
        if state is None and hosts is not None and config.host_timeout_s > 0:
            # on another host: what its host agent read, if the agent was heard just now (an
            # older beat may come from a host that has been cut off since)
            state = hosts.state_of(session.hostname, session.pid, FRESH_BEATS * BEAT_INTERVAL_S)
        limit_s = LIVE_SILENCE_FACTOR * timeout_s
        if state in _LIVE_STATES and silent_s > limit_s:
            return Verdict(pb.RANK_FAILED, f"{session.describe()} sent no heartbeat for {silent_s:.0f} s although "
                           f"its process runs (state {state}): none of its Python threads has run for that long, "
                           f"so one holds the GIL in a call that does not return (or the host never schedules "
                           f"them); the limit is {LIVE_SILENCE_FACTOR} x RINGMASTER_HEARTBEAT_TIMEOUT_S",
                           session.rank, session.hostname)
        if state in _LIVE_STATES:
            # Its process runs: its threads do not get the CPU. The job goes on (one
            # warning per silence) until the limit above.
            if session.silent_since is None:
                session.silent_since = session.last_seen
                log.warning("%s sent no heartbeat for %.0f s, but its process is running (state %s): its "
                            "threads do not get the CPU (far more busy threads than cores?); the job goes on "
                            "for up to %.0f s", session.describe(), silent_s, state, limit_s)
            session.last_seen = now
            continue
        why = _WHY_SILENT.get(state, "it hangs or its host is unreachable")
        if state is not None and state != "gone" and session.hostname != socket.gethostname():
            why += f" (on host {shown(session.hostname)}, whose host agent answers: the rank hangs there)"
        return Verdict(pb.RANK_FAILED, f"{session.describe()} sent no heartbeat for {silent_s:.0f} s "
                       f"(RINGMASTER_HEARTBEAT_TIMEOUT_S={timeout_s:g}): {why}", session.rank, session.hostname)
    return None


def _stalled_cache(config: Config, size: int, generation: "Generation", host_of) -> Optional[Verdict]:
    cache_stall = generation.cache_stalls.stall(size, config.cache_stall_s)
    if cache_stall is not None and cache_stall.never_entered:
        return Verdict(pb.STALLED, f"{describe_cache_stall(cache_stall, host_of)} "
                       f"(RINGMASTER_CACHE_STALL_S={config.cache_stall_s:g})", -1,
                       stalled_ranks=cache_stall.missing_ranks)
    if cache_stall is not None and cache_stall.cycle != generation.slow_cycle_warned:
        generation.slow_cycle_warned = cache_stall.cycle
        log.warning("%s", describe_slow_cache_cycle(cache_stall, host_of))
    return None


def _stalls(config: Config, generation: "Generation", host_of, now: float,
            on_late=None) -> Optional[Verdict]:
    newly = _newly_stalled(config, generation, now)
    for line in warning_lines(newly, host_of):
        log.warning("%s", line)
    if newly and on_late is not None:
        on_late(sorted({rank for stall in newly for rank in stall.missing_ranks}))
    plan_stalls, set_ranks = generation.plan_stalls, generation.negotiator.set_ranks
    for stall in plan_stalls.stalls(config.stall_warning_s, set_ranks):
        log.warning("stall: %s", _describe_plan_stall(stall, host_of))
    shutdown_s = config.stall_shutdown_s
    if shutdown_s <= 0:
        return None
    stalls = _tensor_stalls(generation, shutdown_s, only_new=False)
    if stalls:
        stalls.sort(key=lambda stall: -stall.seconds)
        return Verdict(pb.STALLED, shutdown_reason(stalls, shutdown_s), -1, stalled_ranks=stalls[0].missing_ranks)
    for stall in plan_stalls.stalls(shutdown_s, set_ranks, only_new=False):
        return Verdict(pb.STALLED, f"{_describe_plan_stall(stall, host_of)} "
                       f"(RINGMASTER_STALL_SHUTDOWN_S={shutdown_s:g})", -1, stalled_ranks=stall.missing_ranks)
    return None


def _newly_stalled(config: Config, generation: "Generation", now: float):
    """The stalls to warn about now: those past the warning time for the first time, less
    those waiting for the same ranks as a stall warned about within the warning time (one
    late rank is one stall, though its tensors cross the warning time over several checks:
    at 1,024 ranks one late rank made 3 lines, each listing every waiting rank)."""
    recent, warning_s = generation.stall_warned, config.stall_warning_s
    stalls = [stall for stall in _tensor_stalls(generation, warning_s)
              if now - recent.get(stall_key(stall), -math.inf) >= warning_s]
    for stall in stalls:
        recent[stall_key(stall)] = now
    return stalls


def _tensor_stalls(generation: "Generation", older_than_s: float, only_new: bool = True):
    """The negotiator's stalls, but not join()'s while a joined rank serves a gradient plan."""
    stalls = generation.negotiator.stalls(older_than_s, only_new)
    if any(stall.kind == "join" for stall in stalls):
        serving = generation.plan_stalls.serving_ranks()
        stalls = [s for s in stalls if not (s.kind == "join" and serving.intersection(s.waiting_ranks))]
    return stalls


def _describe_plan_stall(stall: Stall, host_of) -> str:
    where = f"gradient plan '{stall.name}'{in_set(stall)}: ranks {stall.waiting_ranks} have waited " \
            f"{stall.seconds:.0f} s in its allreduce"
    if not stall.missing_ranks:
        return (f"{where}, and every member is in it: the network between them hangs or an "
                f"allreduce is far slower than expected")
    return (f"{where}; ranks {stall.missing_ranks} ({', '.join(host_of(r) for r in stall.missing_ranks)}) "
            f"never reached that training step. One rank may be running a different code path "
            f"(fewer steps, no optimizer.step()), or be stuck or slow; a rank out of data calls rm.join()")


# ------------------------------------------------------------------ /proc
def why_a_stream_ended(session: "RankSession") -> str:
    """What a rank's stream ending without a goodbye says about the rank: its process is looked
    up when it runs on this host, so that a live rank is never reported as dead."""
    if session.hostname == socket.gethostname() and session.pid > 0:
        alive = process_runs(session.pid)
        if alive is False:
            return "its process has exited (it crashed or was killed)"
        if alive:
            return ("its process is still running, so the connection itself broke: gRPC keepalive pings went "
                    "unanswered (a host too busy to answer for minutes, e.g. far more ranks than cores) or the "
                    "network failed")
    return "the process crashed, was killed or its host is gone"


def process_state(session: "RankSession") -> Optional[str]:
    """The state letter of a rank's process on this host, "gone" if there is none, None when
    the rank runs on another host (or this one cannot tell)."""
    if session.hostname != socket.gethostname():
        return None
    found = proc.stat(session.pid)
    if found is None:  # ESRCH or ENOENT: torn down as it was read, or gone
        return "gone" if os.path.isdir("/proc") else None
    return found.state


def process_runs(pid: int, settle_s: float = 0.5) -> Optional[bool]:
    """Whether process ``pid`` of this host runs (None: cannot tell). A dying process closes its
    sockets before it is gone, so a process still there is watched for ``settle_s``."""
    deadline = time.monotonic() + settle_s
    while True:
        found = proc.stat(pid)
        if found is None:
            # ESRCH or an empty read: the process was being torn down as it was read (seen once
            # in a full run: the rank was reported as "crashed or its host is gone", not "exited")
            return False if os.path.isdir("/proc") else None
        if found.exited:
            return False  # exited, not yet reaped by its parent
        if time.monotonic() >= deadline:
            return True
        time.sleep(0.05)


__all__ = ["LIVE_SILENCE_FACTOR", "Verdict", "check", "describe_rank", "excuse_silence", "process_runs",
           "process_state", "why_a_stream_ended"]
