"""``ringrun``'s elastic flags: checked, turned into an :class:`~.elastic_driver.ElasticOptions`.

A job is elastic when any of ``--min-np``, ``--max-np`` or ``--host-discovery-script`` is
given (as with ``horovodrun``); otherwise ringrun runs it exactly as before.
"""

from __future__ import annotations

import argparse
import secrets
import shutil
import signal
from typing import Mapping, Tuple

from ringmaster.common.elastic import shrink_timeout_s

from .elastic_driver import ElasticDriver, ElasticOptions, ulfm_available
from .elastic_hosts import HostDiscovery
from .errors import LaunchError
from .hosts import Host, resolve_hosts, total_slots
from .mpi_command import OPENMPI
from .workdir import make_workdir, remove_stale_workdirs


def add_elastic_arguments(parser: argparse.ArgumentParser, number) -> None:
    """The ``elastic`` group of ringrun's flags (``number`` is ringrun's checked-number type)."""
    group = parser.add_argument_group("elastic (any of these makes the job elastic; docs/elastic.md)")
    group.add_argument("--min-np", type=number(int, 1, True), metavar="N",
                       help="fewest ranks the job may go on with after losing hosts (default: -np)")
    group.add_argument("--max-np", type=number(int, 1, True), metavar="N",
                       help="most ranks the job may grow to when hosts are added (default: -np)")
    group.add_argument("--host-discovery-script", metavar="SCRIPT",
                       help="command printing the usable hosts, one 'host' or 'host:slots' per line; run at "
                            "the start and every --discovery-interval-s")
    group.add_argument("--slots-per-host", type=number(int, 1, True), metavar="N",
                       help="slots of a discovered host printed without ':slots' (default 1)")
    group.add_argument("--elastic-timeout", type=number(float, 0, True), metavar="S",
                       help="how long to wait for --min-np slots after losing hosts (default 600)")
    group.add_argument("--reset-limit", type=number(int, 0, True), metavar="K",
                       help="end the job instead of re-forming it a (K+1)-th time (default: no limit)")
    group.add_argument("--blacklist-cooldown-s", type=number(float, 0, True), metavar="S",
                       help="a host whose ranks failed is left out for S seconds, doubled at each further "
                            "failure (default 60)")
    group.add_argument("--no-shrink-in-place", dest="shrink_in_place", action="store_false", default=None,
                       help="re-form with a new mpirun also when a rank is lost on a live host (default: with an "
                            "Open MPI that has ULFM, the survivors shrink the job in place, over TCP)")
    group.add_argument("--discovery-interval-s", type=number(float, 0, False), metavar="S",
                       help="how often the discovery script runs while the job trains (default 1)")


def elastic_requested(args: argparse.Namespace) -> bool:
    """True when a flag that makes the job elastic was given."""
    return any(getattr(args, name, None) is not None for name in ("min_np", "max_np", "host_discovery_script"))


def check_elastic_args(args: argparse.Namespace, environ: Mapping[str, str]) -> Tuple[ElasticOptions, str]:
    """Check the elastic flags; set ``args.num_proc`` (the first generation's size).

    Returns the options and the first generation's hosts as a ``-H`` string, for
    :func:`~.cli.plan_job` to check like any other.

    Raises:
        LaunchError: naming the flag and the fix.
    """
    slots_per_host = args.slots_per_host or 1
    if args.host_discovery_script is not None:
        if args.hosts is not None or args.hostfile is not None:
            raise LaunchError("--host-discovery-script replaces -H/--hostfile: give one or the other")
        discovery = HostDiscovery(args.host_discovery_script, slots_per_host=slots_per_host)
    else:
        if args.slots_per_host is not None:
            raise LaunchError("--slots-per-host applies to --host-discovery-script's hosts; with -H give "
                              "host:slots")
        fixed = resolve_hosts(args.hosts, args.hostfile, None)
        discovery = HostDiscovery(None, fixed)
    hosts = discovery.discover()
    if not hosts:
        raise LaunchError(f"--host-discovery-script {args.host_discovery_script!r} printed no hosts at the start; "
                          f"it must print at least --min-np slots' worth, one 'host' or 'host:slots' per line")
    num_proc = args.num_proc if args.num_proc is not None else min(total_slots(hosts), args.max_np or 1 << 30)
    min_np = args.min_np if args.min_np is not None else num_proc
    max_np = args.max_np if args.max_np is not None else max(num_proc, min_np)
    if not min_np <= num_proc <= max_np:
        raise LaunchError(f"elastic sizes must satisfy --min-np <= -np <= --max-np, got --min-np {min_np}, "
                          f"-np {num_proc}, --max-np {max_np}")
    if total_slots(hosts) < num_proc:
        raise LaunchError(f"-np {num_proc} needs {num_proc} slots at the start, but the hosts have "
                          f"{total_slots(hosts)} ({','.join(str(h) for h in hosts)}); lower -np or add hosts")
    if args.oversubscribe:
        raise LaunchError("--oversubscribe is not supported with elastic jobs: give each host its real slots")
    args.num_proc = num_proc
    options = ElasticOptions(
        min_np=min_np, max_np=max_np, discovery=discovery,
        elastic_timeout_s=args.elastic_timeout if args.elastic_timeout is not None else 600.0,
        reset_limit=args.reset_limit,
        blacklist_cooldown_s=args.blacklist_cooldown_s if args.blacklist_cooldown_s is not None else 60.0,
        discovery_interval_s=args.discovery_interval_s if args.discovery_interval_s is not None else 1.0,
        shrink_in_place=args.shrink_in_place is not False,
        shrink_timeout_s=_shrink_timeout(environ),
    )
    return options, ",".join(str(Host(h.name, h.slots)) for h in hosts)


def _shrink_timeout(environ: Mapping[str, str]) -> float:
    try:
        return shrink_timeout_s(environ)
    except ValueError as error:
        raise LaunchError(str(error)) from None


def run_elastic(plan, options: ElasticOptions, forwarded_signals) -> int:
    """Run the elastic job of ``plan``; returns ringrun's exit status.

    The survivors of a lost rank shrink the job in place when ``options.shrink_in_place``
    allows it, the MPI is an Open MPI with ULFM, and ``--mpi-args`` choose no transport
    (ULFM needs TCP: shared memory does not detect failures).
    """
    if options.shrink_in_place:
        chooses_transport = any(arg.lstrip("-") in ("with-ft", "mca") and value in ("btl", "pml", "ulfm")
                                for arg, value in zip(plan.spec.mpi_args, list(plan.spec.mpi_args[1:]) + [""]))
        options.shrink_in_place = (plan.mpi.kind == OPENMPI and not chooses_transport
                                   and ulfm_available(plan.mpi.executable))
    secret = secrets.token_hex(32)
    remove_stale_workdirs()
    workdir = make_workdir()
    try:
        return ElasticDriver(plan, options, secret, workdir).run()
    finally:
        for signum in forwarded_signals:
            signal.signal(signum, signal.SIG_IGN)
        shutil.rmtree(workdir, ignore_errors=True)


__all__ = ["add_elastic_arguments", "check_elastic_args", "elastic_requested", "run_elastic"]
