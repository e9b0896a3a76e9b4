"""Run the coordinator daemon: ``python -m ringmaster.coordinator --size N ...``.

Started by ``ringrun`` (or by rank 0 under plain ``mpirun``). The job token comes from
``RINGMASTER_SECRET`` in the environment, never from the command line, where ``ps``
would show it. Once listening, the daemon writes ``host:port`` to ``--address-file``. Its
start (configuration, logging, token, address file, standard input) is every daemon's:
``ringmaster.common.daemon``.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time

from ringmaster.common.config import Config
from ringmaster.common.daemon import on_stdin_eof, refuse, run_daemon, write_address
from ringmaster.coordinator.server import Coordinator


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m ringmaster.coordinator",
                                     description="ringmaster's negotiation daemon (one per job)")
    parser.add_argument("--size", type=int, required=True, help="number of ranks in the job")
    parser.add_argument("--bind", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="port to listen on (default: any free port)")
    parser.add_argument("--address-file", help="write host:port here once listening")
    parser.add_argument("--advertise", help="address ranks should use, if not --bind (e.g. bind 0.0.0.0)")
    parser.add_argument("--exit-on-stdin-eof", action="store_true",
                        help="exit when standard input closes (the parent that started us died)")
    parser.add_argument("--persistent", action="store_true",
                        help="after all ranks shut down, wait for the job's next init() instead of exiting")
    parser.add_argument("--report-file",
                        help="append one JSON line per abort (event 'abort': kind, reason, failed_rank, "
                             "failed_host, host_unreachable) and per complete registration (event 'welcome': "
                             "size): ringrun reads it to end an aborted job and to leave failed hosts out")
    parser.add_argument("--elastic", action="store_true",
                        help="after a rank failed, wait for the survivors to register again as a smaller job")
    return parser.parse_args(argv)


def append_report(path: str, event: dict) -> None:
    """Append ``event`` as one JSON line (one write: a reader sees whole lines)."""
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(event) + "\n")


def report_abort(path: str, kind: int, reason: str, failed_rank: int, failed_host: str,
                 host_unreachable: bool = False) -> None:
    """The job (or, for an elastic job, its current size) was aborted: what failed."""
    from ringmaster.proto import ringmaster_pb2 as pb

    append_report(path, {"event": "abort", "time": time.time(),
                         "kind": pb.ErrorKind.Name(kind) if kind in pb.ErrorKind.values() else str(kind),
                         "reason": reason, "failed_rank": failed_rank, "failed_host": failed_host,
                         "host_unreachable": host_unreachable})


def main(argv=None) -> int:
    args = parse_args(argv)
    return run_daemon("coordinator", "coordinator", lambda config: serve(args, config))


def serve(args: argparse.Namespace, config: Config) -> int:
    """Run the coordinator until the job is over or the daemon is told to stop."""
    if args.size < 1:
        return refuse("coordinator", f"--size must be >= 1, got {args.size}")
    try:
        coordinator = Coordinator(args.size, config.secret, config, args.bind, args.port,
                                  persistent=args.persistent, elastic=args.elastic).start()
    except OSError as error:
        return refuse("coordinator", f"cannot listen on {args.bind}:{args.port}: {error}", status=1)
    if args.report_file:
        coordinator.on_abort = lambda *abort: report_abort(args.report_file, *abort)
        coordinator.on_welcome = lambda size: append_report(
            args.report_file, {"event": "welcome", "time": time.time(), "size": size})
    advertised = f"{args.advertise or args.bind}:{coordinator.port}"
    if args.address_file:
        write_address(args.address_file, advertised)
    else:
        print(advertised, flush=True)

    stop_requested = threading.Event()

    def request_stop(*_):
        # Only set a flag: a handler that took locks could deadlock with the thread it interrupted.
        stop_requested.set()

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    if args.exit_on_stdin_eof:
        on_stdin_eof(stop_requested.set)
    while not (coordinator.finished.is_set() or stop_requested.wait(0.2)):
        pass
    coordinator.stop(grace=0.5 if stop_requested.is_set() else 2.0)  # 2 s lets abort messages reach the ranks
    return coordinator.exit_code


if __name__ == "__main__":
    sys.exit(main())
