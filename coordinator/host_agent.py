"""The host agent: one small process per host (other than the coordinator's) that tells the
coordinator every second that the host is reachable, and what its ranks' processes are doing.

``python -m ringmaster.coordinator.host_agent --coordinator ADDR --host NAME --ranks R:PID:START,...``
(started by the host's first rank at ``init()``, :mod:`ringmaster.worker.runtime.host_watch`;
the job's token comes in ``RINGMASTER_SECRET``).

Every :data:`~.host_liveness.BEAT_INTERVAL_S` it reads each rank's state from
``/proc/PID/stat`` and calls the coordinator's ``Ping`` with the host, its own pid and those
states in the call's metadata (:mod:`.host_liveness`). Being a process of its own, it beats
whatever the ranks' Python threads do: a rank holding the GIL in a long MPI wait stops its
own heartbeats, not its host's.

A status that will not go away (a wrong token: ``UNAUTHENTICATED``; another ringmaster version:
``UNIMPLEMENTED``; :data:`ringmaster.common.rpc_status.PERMANENT`) ends the agent at once, with an
exit status that names it to the rank that started it, which ends saying so. Other failures are
silence: they count toward the timeouts below, and the last status is in the final message.

Orphans end themselves. When no beat has been answered for :data:`ORPHAN_FACTOR` x
``RINGMASTER_HOST_TIMEOUT_S`` (the coordinator was stopped, or this host was cut off the
network), the job is over for this host: the ranks' own watch (which gives up after one
host timeout, saying why) has had its chance, and the agent ends what is left of the job
here: the ranks (SIGTERM, then SIGKILL after :data:`KILL_GRACE_S`) and the MPI daemon that
started them (Open MPI's ``prted``/``orted``, MPICH's ``hydra_pmi_proxy``), which would
otherwise wait for a launcher it can no longer reach, unless that daemon also runs other jobs'
processes (a persistent PRRTE DVM). Every signal goes only to a process whose start time is
the one recorded when its pid was learned (:mod:`ringmaster.common.proc`): never to a reused
pid. It exits once none of its ranks runs.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import time
from typing import Dict, List

import grpc

from ringmaster.common import proc, rpc_status
from ringmaster.common.daemon import refuse, run_daemon
from ringmaster.proto.auth import call_metadata
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
    parser.add_argument("--ranks", required=True,
                        help="RANK:PID:START,... of this host's ranks (START: /proc/PID/stat field 22)")
    return parser.parse_args(argv)


def parse_ranks(text: str) -> Dict[int, proc.ProcessIdentity]:
    """``{rank: process}`` from ``RANK:PID:START,...`` (START: the rank's start time, which
    :func:`ringmaster.common.proc.start_time` reads; a ``RANK:PID`` without it is read now)."""
    ranks = {}
    for item in text.split(","):
        parts = item.split(":")
        if len(parts) not in (2, 3):
            raise ValueError(item)
        pid = int(parts[1])
        ranks[int(parts[0])] = (proc.ProcessIdentity(pid, int(parts[2]) or None) if len(parts) == 3
                                else proc.ProcessIdentity.of(pid))
    return ranks


def process_state(identity: proc.ProcessIdentity) -> str:
    """The state letter of a rank's process, "gone" if it has exited or its pid is another process's."""
    return proc.live_state(identity.pid) if identity.current() else "gone"


def mpi_daemons(ranks: Dict[int, proc.ProcessIdentity]) -> List[proc.ProcessIdentity]:
    """The MPI daemons that started ``ranks`` (their parents, by name), as they are now."""
    daemons = set()
    for identity in ranks.values():
        found = proc.stat(identity.pid) if identity.current() else None
        if found is not None and proc.comm(found.ppid) in MPI_DAEMONS:
            daemons.add(proc.ProcessIdentity.of(found.ppid))
    return sorted(daemons, key=lambda daemon: daemon.pid)


def other_jobs_of(daemon: proc.ProcessIdentity, ranks: Dict[int, proc.ProcessIdentity]) -> List[int]:
    """The live children of ``daemon`` that are not this job's on this host: a persistent
    PRRTE daemon (``prte``'s DVM) starts the ranks of many jobs, and must outlive this one.

    Open MPI puts each rank in a process group of its own, so what a rank started (a data
    loader's workers, reparented to the daemon when the rank died) shares its group or session.
    """
    ours = {identity.pid for identity in ranks.values()} | {os.getpid()}
    others = []
    for pid in proc.iter_pids():
        found = proc.stat(pid)
        if (found is not None and found.ppid == daemon.pid and not found.exited and pid not in ours
                and found.pgrp not in ours and found.session not in ours):
            others.append(pid)
    return sorted(others)


def _signal(processes: List[proc.ProcessIdentity], signum: int) -> None:
    for identity in processes:
        proc.send_signal(identity, signum)


def _end(processes: List[proc.ProcessIdentity]) -> None:
    """SIGTERM, then SIGKILL after :data:`KILL_GRACE_S`, to those of ``processes`` still themselves."""
    _signal(processes, signal.SIGTERM)
    deadline = time.monotonic() + KILL_GRACE_S
    while time.monotonic() < deadline and any(identity.current() for identity in processes):
        time.sleep(0.1)
    _signal(processes, signal.SIGKILL)


def end_orphans(ranks: Dict[int, proc.ProcessIdentity], daemons: List[proc.ProcessIdentity], why: str) -> None:
    """End this host's ranks and the MPI daemons that started them (see the module's docstring).

    Only processes whose start time is still the recorded one are signalled, and a daemon that
    serves other jobs (:func:`other_jobs_of`) is left running."""
    live = [identity for identity in ranks.values() if identity.current()]
    daemons = [daemon for daemon in daemons if daemon.current()]
    print(f"ringmaster host agent on {socket.gethostname()}: {why}; ending this host's ranks "
          f"{sorted(ranks)} (pids {sorted(identity.pid for identity in live)})"
          + (f" and the MPI daemon (pids {[daemon.pid for daemon in daemons]}) that waits for an unreachable "
             f"launcher" if daemons else ""), file=sys.stderr, flush=True)
    _end(live)
    alone = []
    for daemon in daemons:
        others = other_jobs_of(daemon, ranks)
        if others:
            print(f"ringmaster host agent on {socket.gethostname()}: the MPI daemon (pid {daemon.pid}) also runs "
                  f"processes {others} of other jobs; it is left running", file=sys.stderr, flush=True)
        else:
            alone.append(daemon)
    _end(alone)


def print_stacks_of(trailing, ranks: Dict[int, proc.ProcessIdentity]) -> None:
    """Send SIGUSR1 (each rank prints its threads' stacks) to the ranks of this host the
    coordinator's answer names (:data:`~.host_liveness.STACKS_KEY`), while their pids are
    still the ranks' processes; other pids are ignored. The coordinator names only ranks that
    installed the stack dump."""
    by_pid = {identity.pid: identity for identity in ranks.values()}
    for key, value in trailing or ():
        if key != STACKS_KEY:
            continue
        wanted = {int(pid) for pid in value.split(",") if pid.isdigit()}
        _signal([by_pid[pid] for pid in sorted(wanted & set(by_pid))], signal.SIGUSR1)


def serve(args: argparse.Namespace, config) -> int:
    """Beat until this host's ranks are gone (0), or end them once the coordinator is lost (1)."""
    try:
        ranks = parse_ranks(args.ranks)
    except ValueError:
        return refuse("host agent", f"--ranks must be RANK:PID:START,..., got {args.ranks!r}")
    limit_s = ORPHAN_FACTOR * config.host_timeout_s
    metadata = call_metadata(config.secret)
    calls = rpc_status.CallRecord()
    with grpc.insecure_channel(args.coordinator) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        daemons = mpi_daemons(ranks)  # now, while the ranks run: their parents
        while True:
            started = time.monotonic()
            states = {rank: (identity.pid, process_state(identity)) for rank, identity in ranks.items()}
            if all(state == "gone" for _, state in states.values()):
                silent_s = calls.silent_s()
                if limit_s > 0 and silent_s > config.host_timeout_s:  # they ended themselves, cut off
                    end_orphans(ranks, daemons, f"the coordinator at {args.coordinator} has not answered for "
                                f"{silent_s:.0f} s ({calls.last()}) and this host's ranks have ended")
                    return 1
                return 0
            beat = format_beat(args.host, os.getpid(), states)
            try:
                _, call = stub.Ping.with_call(pb.Empty(), metadata=metadata + ((METADATA_KEY, beat),),
                                              timeout=2 * BEAT_INTERVAL_S)
                calls.answered()
                print_stacks_of(call.trailing_metadata(), ranks)
            except grpc.RpcError as error:
                permanent = calls.failed(error)
                if permanent is not None:
                    print(f"ringmaster host agent on {socket.gethostname()}: the coordinator at {args.coordinator} "
                          f"answered {calls.last_status}, a status that will not go away: "
                          f"{rpc_status.FIXES[permanent]}; the agent ends, and the rank that started it ends "
                          f"naming it", file=sys.stderr, flush=True)
                    return rpc_status.exit_status(permanent)
                if calls.failures <= 3:
                    log.info("the coordinator at %s did not answer a heartbeat: %s", args.coordinator,
                             calls.last_status)
            silent_s = calls.silent_s()
            if limit_s > 0 and silent_s > limit_s:
                end_orphans(ranks, daemons, f"the coordinator at {args.coordinator} has not answered for "
                                            f"{silent_s:.0f} s ({ORPHAN_FACTOR} x RINGMASTER_HOST_TIMEOUT_S="
                                            f"{config.host_timeout_s:g}; {calls.last()}): it is stopped or this "
                                            f"host is cut off")
                return 1
            time.sleep(max(0.0, BEAT_INTERVAL_S - (time.monotonic() - started)))


def main(argv=None) -> int:
    args = parse_args(argv)
    return run_daemon("host agent", "host agent", lambda config: serve(args, config))


if __name__ == "__main__":
    sys.exit(main())
