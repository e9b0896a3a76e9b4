"""The host agent: one small process per host (other than the coordinator's) that tells the
coordinator every second that the host is reachable, and what its ranks' processes are doing.

``python -m ringmaster.coordinator.host_agent --coordinator ADDR --host NAME --ranks R:PID,...``
(started by the host's first rank at ``init()``, :mod:`ringmaster.worker.runtime.host_watch`;
the job's token comes in ``RINGMASTER_SECRET``).

Every :data:`~.host_liveness.BEAT_INTERVAL_S` it reads each rank's state from
``/proc/PID/stat`` and calls the coordinator's ``Ping`` with the host, its own pid and those
states in the call's metadata (:mod:`.host_liveness`). Being a process of its own, it beats
whatever the ranks' Python threads do: a rank holding the GIL in a long MPI wait stops its
own heartbeats, not its host's.

Orphans end themselves. When no beat has been answered for :data:`ORPHAN_FACTOR` x
``RINGMASTER_HOST_TIMEOUT_S`` (the coordinator was stopped, or this host was cut off the
network), the job is over for this host: the ranks' own watch (which gives up after one
host timeout, saying why) has had its chance, and the agent ends what is left of the job
here: the ranks (SIGTERM, then SIGKILL after :data:`KILL_GRACE_S`) and the MPI daemon that
started them (Open MPI's ``prted``/``orted``, MPICH's ``hydra_pmi_proxy``), which would
otherwise wait for a launcher it can no longer reach. It exits once none of its ranks runs.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import time
from typing import Dict, List, Optional, Tuple

import grpc

from ringmaster.common import proc
from ringmaster.common.daemon import refuse, run_daemon
from ringmaster.coordinator.auth import call_metadata
from ringmaster.coordinator.host_liveness import BEAT_INTERVAL_S, METADATA_KEY, STACKS_KEY, format_beat
from ringmaster.proto import ringmaster_pb2 as pb
from ringmaster.proto import ringmaster_pb2_grpc as pb_grpc

log = logging.getLogger("ringmaster.host_agent")

#: The agent gives up on the coordinator after this many host timeouts without an answer: one
#: host timeout is the ranks' own limit (they end first, saying why), the second is its own.
ORPHAN_FACTOR = 2
#: Seconds between SIGTERM and SIGKILL when the agent ends an orphaned host's processes.
KILL_GRACE_S = 2.0
#: The MPI daemons that start ranks on a host, by their ``/proc/PID/comm`` name.
MPI_DAEMONS = ("prted", "orted", "hydra_pmi_proxy", "pmi_proxy")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m ringmaster.coordinator.host_agent",
                                     description="ringmaster's host agent: liveness by host")
    parser.add_argument("--coordinator", required=True, help="host:port of the job's coordinator")
    parser.add_argument("--host", default=socket.gethostname(), help="this host's name, as the ranks report it")
    parser.add_argument("--ranks", required=True, help="RANK:PID,... of this host's ranks")
    return parser.parse_args(argv)


def parse_ranks(text: str) -> Dict[int, int]:
    """``{rank: pid}`` from ``RANK:PID,...``."""
    ranks = {}
    for item in text.split(","):
        rank, _, pid = item.partition(":")
        ranks[int(rank)] = int(pid)
    return ranks


def process_state(pid: int) -> str:
    """The state letter of ``pid`` (``/proc/PID/stat``), "gone" if it has exited."""
    return proc.live_state(pid)


def _parent(pid: int) -> Optional[Tuple[int, str]]:
    found = proc.stat(pid)
    name = proc.comm(found.ppid) if found is not None else None
    return (found.ppid, name) if name is not None else None


def _signal(pids: List[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except (ProcessLookupError, PermissionError):
            pass


def mpi_daemons(ranks: Dict[int, int]) -> List[int]:
    """The pids of the MPI daemons that started ``ranks`` (their parents, by name)."""
    return sorted({parent[0] for pid in ranks.values()
                   if (parent := _parent(pid)) is not None and parent[1] in MPI_DAEMONS})


def end_orphans(ranks: Dict[int, int], daemons: List[int], why: str) -> None:
    """End this host's ranks and the MPI daemons that started them (see the module's docstring)."""
    daemons = [pid for pid in daemons if process_state(pid) != "gone"]
    print(f"ringmaster host agent on {socket.gethostname()}: {why}; ending this host's ranks "
          f"{sorted(ranks)} (pids {sorted(ranks.values())})"
          + (f" and the MPI daemon (pids {daemons}) that waits for an unreachable launcher" if daemons else ""),
          file=sys.stderr, flush=True)
    live = [pid for pid in ranks.values() if process_state(pid) != "gone"]
    _signal(live, signal.SIGTERM)
    deadline = time.monotonic() + KILL_GRACE_S
    while time.monotonic() < deadline and any(process_state(pid) != "gone" for pid in live):
        time.sleep(0.1)
    _signal(live, signal.SIGKILL)
    _signal(daemons, signal.SIGTERM)
    deadline = time.monotonic() + KILL_GRACE_S
    while time.monotonic() < deadline and any(process_state(pid) != "gone" for pid in daemons):
        time.sleep(0.1)
    _signal(daemons, signal.SIGKILL)


def print_stacks_of(trailing, ranks: Dict[int, int]) -> None:
    """Send SIGUSR1 (each rank prints its threads' stacks) to the ranks of this host the
    coordinator's answer names (:data:`~.host_liveness.STACKS_KEY`); other pids are ignored."""
    for key, value in trailing or ():
        if key != STACKS_KEY:
            continue
        wanted = {int(pid) for pid in value.split(",") if pid.isdigit()}
        _signal(sorted(wanted & set(ranks.values())), signal.SIGUSR1)


def serve(args: argparse.Namespace, config) -> int:
    """Beat until this host's ranks are gone (0), or end them once the coordinator is lost (1)."""
    try:
        ranks = parse_ranks(args.ranks)
    except ValueError:
        return refuse("host agent", f"--ranks must be RANK:PID,..., got {args.ranks!r}")
    limit_s = ORPHAN_FACTOR * config.host_timeout_s
    metadata = call_metadata(config.secret)
    with grpc.insecure_channel(args.coordinator) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        last_answer = time.monotonic()
        daemons = mpi_daemons(ranks)  # now, while the ranks run: their parents
        while True:
            started = time.monotonic()
            states = {rank: (pid, process_state(pid)) for rank, pid in ranks.items()}
            if all(state == "gone" for _, state in states.values()):
                silent_s = time.monotonic() - last_answer
                if limit_s > 0 and silent_s > config.host_timeout_s:  # they ended themselves, cut off
                    end_orphans(ranks, daemons, f"the coordinator at {args.coordinator} has not answered for "
                                f"{silent_s:.0f} s and this host's ranks have ended")
                    return 1
                return 0
            beat = format_beat(args.host, os.getpid(), states)
            try:
                _, call = stub.Ping.with_call(pb.Empty(), metadata=metadata + ((METADATA_KEY, beat),),
                                              timeout=2 * BEAT_INTERVAL_S)
                last_answer = time.monotonic()
                print_stacks_of(call.trailing_metadata(), ranks)
            except grpc.RpcError as error:
                if time.monotonic() - last_answer < BEAT_INTERVAL_S * 3:
                    log.info("the coordinator at %s did not answer a heartbeat: %s %s", args.coordinator,
                             error.code().name, error.details())
            silent_s = time.monotonic() - last_answer
            if limit_s > 0 and silent_s > limit_s:
                end_orphans(ranks, daemons, f"the coordinator at {args.coordinator} has not answered for "
                                            f"{silent_s:.0f} s ({ORPHAN_FACTOR} x RINGMASTER_HOST_TIMEOUT_S="
                                            f"{config.host_timeout_s:g}): it is stopped or this host is cut off")
                return 1
            time.sleep(max(0.0, BEAT_INTERVAL_S - (time.monotonic() - started)))


def main(argv=None) -> int:
    args = parse_args(argv)
    return run_daemon("host agent", "host agent", lambda config: serve(args, config))


if __name__ == "__main__":
    sys.exit(main())
