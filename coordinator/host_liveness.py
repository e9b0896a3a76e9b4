"""Liveness by host: the coordinator's record of each host agent's heartbeats.

A rank's own heartbeats come from a Python thread, which a thread holding the GIL stops, so
their timeout (``RINGMASTER_HEARTBEAT_TIMEOUT_S``) is a minute. Each host other than the
coordinator's runs one host agent (:mod:`.host_agent`): a process of its own, which no rank
can block, that calls ``Ping`` every :data:`BEAT_INTERVAL_S` with :data:`METADATA_KEY` naming
its host and the ``/proc`` state of each of the host's ranks. Here:

- a host whose agent has been silent for ``RINGMASTER_HOST_TIMEOUT_S`` (default 8 s) while
  the job needs a rank on it, *and* whose beats the coordinator saw missing at least
  :data:`MISSED_BEATS` times in a row while it ran (one look a beat interval apart), is
  unreachable: the job ends naming the host and its ranks. The second condition is the
  evidence: a coordinator that was itself starved of the CPU and wakes to find every agent's
  last beat old has seen one gap, not several, and waits for more;
- a rank that is silent while its host's agent answers is a hang *on that host*; the state
  the agent read (stopped, exited, running) says which, as ``/proc`` does for ranks on the
  coordinator's own host (:func:`.health._silent_rank`).

The coordinator's host has no agent: a host cannot lose its link to itself, and there a
silent process is read from ``/proc`` directly. A beat carries nothing the job's token does
not already allow; a malformed one is ignored (counted, never trusted).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Tuple

from ringmaster.coordinator.verdict import Verdict
from ringmaster.proto import ringmaster_pb2 as pb

log = logging.getLogger("ringmaster.coordinator")

#: gRPC metadata key of a host agent's ``Ping``: ``"HOST AGENT_PID RANK:PID:STATE,..."``.
METADATA_KEY = "ringmaster-host-agent"
#: Trailing metadata key of the coordinator's answer: ``"PID,..."``, ranks of the agent's host
#: that are to print their Python stacks (the agent sends them SIGUSR1): the late ranks of a
#: stall warning, while the user can still act on it.
STACKS_KEY = "ringmaster-print-stacks"
#: How often an agent beats. One second: a beat is one small unary call per host.
BEAT_INTERVAL_S = 1.0
#: Looks a beat interval apart, in a row, that must find a host's beat missing before the host
#: can be declared unreachable (and only once the host timeout has passed as well).
MISSED_BEATS = 3
#: A beat is missing once this many beat intervals have passed without one (a beat may come late).
OVERDUE_BEATS = 1.5
#: Hosts remembered at most (a job has at most one agent per host; a client with the token
#: inventing host names must not grow the table without bound).
MAX_HOSTS = 65536


@dataclass
class HostBeat:
    """The latest heartbeat of one host's agent."""

    agent_pid: int
    last_seen: float
    #: pid -> process state letter of the host's ranks, as the agent read them
    states: Dict[int, str] = field(default_factory=dict)
    #: pids whose stacks the coordinator asks for in its next answer
    stacks_wanted: set = field(default_factory=set)


def parse_beat(value: str) -> Optional[Tuple[str, int, Dict[int, str]]]:
    """``(host, agent_pid, {pid: state})`` from a beat's metadata value; None if malformed."""
    words = value.split()
    if len(words) not in (2, 3) or not words[1].isdigit() or len(value) > 65536:
        return None
    states: Dict[int, str] = {}
    for item in (words[2].split(",") if len(words) == 3 else ()):
        parts = item.split(":")
        if len(parts) != 3 or not parts[1].isdigit() or len(parts[2]) > 4:
            return None
        states[int(parts[1])] = parts[2]
    return words[0], int(words[1]), states


def format_beat(host: str, agent_pid: int, states: Mapping[int, Tuple[int, str]]) -> str:
    """The metadata value of a beat: ``states`` maps rank -> (pid, state letter)."""
    ranks = ",".join(f"{rank}:{pid}:{state}" for rank, (pid, state) in sorted(states.items()))
    return f"{host} {agent_pid} {ranks}".rstrip()


class HostLiveness:
    """The hosts' agents as the coordinator last heard them."""

    def __init__(self, clock=time.monotonic):
        self._clock = clock
        self.hosts: Dict[str, HostBeat] = {}
        self.malformed = 0
        #: when every rank last registered: a host with ranks whose agent was never heard is
        #: silent since then (a link cut before its agent's first beat)
        self.welcomed_at: Optional[float] = None
        #: host -> (beats seen missing in a row, when that was last counted)
        self.missed: Dict[str, Tuple[int, float]] = {}
        #: the longest silence of any agent between two beats so far (for the docs' figure)
        self.longest_gap_s = 0.0
        self._gap_logged = BEAT_INTERVAL_S

    def beat(self, value: str) -> str:
        """A ``Ping`` carried :data:`METADATA_KEY` with ``value``; returns the :data:`STACKS_KEY`
        value of the answer ("" when no stack is wanted)."""
        parsed = parse_beat(value)
        if parsed is None:
            self.malformed += 1
            if self.malformed == 1:
                log.warning("a host agent's heartbeat was malformed (%r...); it is ignored", value[:80])
            return ""
        host, agent_pid, states = parsed
        previous = self.hosts.get(host)
        if previous is None and len(self.hosts) >= MAX_HOSTS:
            return ""
        if previous is None:
            log.info("the host agent of %s (pid %d) is heard; ranks there: %s", host, agent_pid, states)
        now = self._clock()
        if previous is not None and now - previous.last_seen > self.longest_gap_s:
            self.longest_gap_s = now - previous.last_seen
            if self.longest_gap_s > 1.1 * self._gap_logged:  # a new record, logged when it grew by a tenth
                self._gap_logged = self.longest_gap_s
                log.info("the longest silence of a host agent so far: %s, %.2f s between two beats", host,
                         self.longest_gap_s)
        self.hosts[host] = HostBeat(agent_pid, now, states)
        self.missed.pop(host, None)
        wanted = previous.stacks_wanted if previous is not None else set()
        return ",".join(str(pid) for pid in sorted(wanted))

    def want_stacks(self, host: str, pid: int) -> bool:
        """Ask the agent of ``host``, in its next answer, to have ``pid`` print its stacks (False: no agent)."""
        beat = self.hosts.get(host)
        if beat is None:
            return False
        beat.stacks_wanted.add(pid)
        return True

    def excuse(self, late_s: float) -> None:
        """The coordinator did not run for ``late_s``: the agents' beats of that time may wait unread."""
        for beat in self.hosts.values():
            beat.last_seen += late_s
        if self.welcomed_at is not None:
            self.welcomed_at += late_s

    def state_of(self, host: str, pid: int, within_s: float) -> Optional[str]:
        """The state the agent of ``host`` last read for ``pid`` ("gone" if it no longer
        lists it), when the agent was heard within ``within_s``; else None."""
        beat = self.hosts.get(host)
        if beat is None or self._clock() - beat.last_seen > within_s:
            return None
        return beat.states.get(pid, "gone")

    def forget(self, host: str) -> None:
        """Stop watching ``host`` (the job no longer has a rank there)."""
        self.hosts.pop(host, None)
        self.missed.pop(host, None)

    def _count_missed(self, host: str, silent_s: float, now: float) -> int:
        """Count one more missed beat of ``host`` if its beat is overdue and the last count is a
        beat interval old; returns the count in a row."""
        count, counted_at = self.missed.get(host, (0, -1e18))
        if silent_s > OVERDUE_BEATS * BEAT_INTERVAL_S and now - counted_at >= BEAT_INTERVAL_S:
            count, counted_at = count + 1, now
            self.missed[host] = (count, counted_at)
        return count

    def check(self, timeout_s: float, sessions: Mapping[int, Any], now: float,
              own_host: str) -> Optional[Verdict]:
        """The verdict on the first host the job needs (other than ``own_host``, the
        coordinator's) whose agent is silent past ``timeout_s``, or was never heard although
        every rank registered ``timeout_s`` ago, and whose beats this coordinator saw missing
        :data:`MISSED_BEATS` times in a row. ``sessions``: rank -> its ``RankSession``.
        Called once a tick (at most a beat interval apart)."""
        if timeout_s <= 0:
            return None
        needed: Dict[str, list] = {}
        for session in sessions.values():
            if session.hostname != own_host and not session.said_goodbye and session.rank is not None:
                needed.setdefault(session.hostname, []).append((session.rank, session.pid))
        for host, ranks in sorted(needed.items()):
            beat = self.hosts.get(host)
            since = beat.last_seen if beat is not None else self.welcomed_at
            if since is None:
                continue
            silent_s = now - since
            missed = self._count_missed(host, silent_s, now)
            if silent_s <= timeout_s or missed < MISSED_BEATS:
                continue
            agent = (f"its ringmaster host agent (pid {beat.agent_pid}) sent no heartbeat for {silent_s:.0f} s "
                     f"({missed} beats seen missing in a row)" if beat is not None else
                     f"its ringmaster host agent was never heard from, {silent_s:.0f} s after every rank registered")
            listed = ", ".join(f"rank {rank} (pid {pid})" for rank, pid in sorted(ranks))
            return Verdict(pb.RANK_FAILED,
                           f"host {host} is unreachable: {agent} (RINGMASTER_HOST_TIMEOUT_S={timeout_s:g}); the job "
                           f"had {listed} there. Its network link or the host itself failed",
                           min(ranks)[0], host, host_unreachable=True)
        return None


__all__ = ["BEAT_INTERVAL_S", "HostBeat", "HostLiveness", "METADATA_KEY", "MISSED_BEATS", "STACKS_KEY", "format_beat",
           "parse_beat"]
