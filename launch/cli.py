"""``ringrun``: run a training script on N processes with a coordinator and MPI.

``ringrun -np 4 -H host1:2,host2:2 python train.py --lr 0.1``

Inside a SLURM allocation, without ``-H``/``--hostfile``, the hosts and slots come from
SLURM's variables and ``-np`` defaults to ``SLURM_NTASKS`` (see :mod:`.slurm`).

Steps: parse and check everything (hosts, slots, the script, MPI) before starting anything;
start the job's coordinator daemon with a fresh secret; run ``mpirun`` with the coordinator's
address and the secret in the ranks' environment; relay rank-tagged output; forward
SIGINT/SIGTERM; return the first failing rank's exit status; always stop the coordinator and
remove temporary files.
"""

from __future__ import annotations

import argparse
import math
import os
import secrets
import shlex
import shutil
import signal
import sys
from dataclasses import dataclass
from typing import Dict, Mapping, Optional, Sequence

from ringmaster.common.config import Config

from .command import check_command, normalize_command
from .coordinator_process import CoordinatorProcess
from .environment import (base_environment, coordinator_environment, exported_names, job_environment,
                          tuning_environment, validated_config)
from .elastic_cli import add_elastic_arguments, check_elastic_args, elastic_requested, run_elastic
from .abort_watch import AbortWatch
from .errors import FAILURE_EXIT, LaunchError
from .hosts import Host, all_local, check_slots, resolve_hosts, total_slots
from .job import FORWARDED_SIGNALS, MpiJob
from .mpi_command import (LaunchSpec, MpiImplementation, build_command, detect_mpi, find_mpirun,
                          hostfile_text, split_mpi_args)
from .network import coordinator_address, interface_ipv4
from .output import OutputRelay
from .setting_flags import FLAG_SETTINGS, add_setting_flags
from .slurm import SlurmAllocation, slurm_allocation
from .workdir import make_workdir, remove_stale_workdirs

START_TIMEOUT = "RINGMASTER_START_TIMEOUT"

PROG = "ringrun"

EXAMPLES = """\
examples:
  ringrun -np 4 python train.py --lr 0.1
  ringrun -np 8 -H node1:4,node2:4 --network-interface eth0 python train.py
  ringrun -np 8 --hostfile hosts.txt --output-filename logs/ python train.py
  (hostfile: one 'host slots=N' per line, '#' starts a comment)
  ringrun python train.py        (in an sbatch script: hosts and -np from SLURM)
"""


class _Interrupted(Exception):
    """ringrun received a signal before the job was running."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, raised so main() reports it like any other
        raise LaunchError(f"{message} (see ringrun --help)")


def _number(kind, minimum: float, inclusive: bool):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if value < minimum or (value == minimum and not inclusive):
            relation = ">=" if inclusive else ">"
            raise argparse.ArgumentTypeError(f"must be {relation} {minimum:g}, got {text!r}")
        return value
    return parse


def build_parser() -> argparse.ArgumentParser:
    """The ``ringrun`` argument parser (everything after the options is the command)."""
    parser = _Parser(
        prog=PROG, usage="ringrun [options] COMMAND [ARGS...]", allow_abbrev=False,
        description="Run a ringmaster training command on N processes through MPI.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    job = parser.add_argument_group("job")
    job.add_argument("-np", "--num-proc", dest="num_proc", type=int, metavar="N",
                     help="number of processes (default: every slot of -H/--hostfile; in a SLURM "
                          "allocation, SLURM_NTASKS)")
    where = job.add_mutually_exclusive_group()
    where.add_argument("-H", "--hosts", metavar="HOST:SLOTS,...",
                       help="hosts and their slots, e.g. node1:4,node2:4 (default: the SLURM "
                            "allocation's nodes and tasks, else this host, one slot per CPU)")
    where.add_argument("--hostfile", metavar="FILE", help="file with one 'host slots=N' per line")
    job.add_argument("--oversubscribe", action="store_true", help="allow more processes than slots")
    job.add_argument("--output-filename", metavar="DIR",
                     help="also write each rank's output to DIR/rank.R/{stdout,stderr}")
    job.add_argument("--verbose", "-v", action="store_true",
                     help="print the mpirun command; ringmaster logs at INFO")

    tuning = parser.add_argument_group("tuning (each sets a RINGMASTER_* variable)")
    network = parser.add_argument_group("network and MPI")
    add_setting_flags({"job": job, "tuning": tuning, "network": network})
    network.add_argument("--ssh-port", type=_number(int, 1, True), metavar="PORT",
                         help="ssh port of the remote hosts")
    network.add_argument("--ssh-identity-file", metavar="FILE", help="ssh private key for the remote hosts")
    network.add_argument("--mpi-args", metavar="ARGS",
                         help='extra mpirun arguments (shell-quoted), e.g. --mpi-args="--mca btl tcp,self"')

    add_elastic_arguments(parser, _number)
    parser.add_argument("command", nargs=argparse.REMAINDER, metavar="COMMAND", help=argparse.SUPPRESS)
    return parser


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse ``argv`` (default ``sys.argv[1:]``); the user's command is ``.command``.

    Raises:
        LaunchError: on any bad option.
    """
    args = build_parser().parse_args(argv)
    args.command = normalize_command(args.command)
    if args.ssh_port is not None and args.ssh_port > 65535:
        raise LaunchError(f"--ssh-port must be a TCP port (1-65535), got {args.ssh_port}")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``ringrun``; returns the exit status."""
    previous = {signum: signal.signal(signum, _raise_interrupted) for signum in FORWARDED_SIGNALS}
    try:
        args = parse_args(argv)
        if elastic_requested(args):  # ringrun's elastic driver (docs/elastic.md)
            options, args.hosts = check_elastic_args(args, os.environ)
            args.hostfile = None
            return run_elastic(plan_job(args, os.environ), options, FORWARDED_SIGNALS)
        return run_job(plan_job(args, os.environ))
    except LaunchError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return error.exit_code
    except (_Interrupted, KeyboardInterrupt) as interrupt:
        signum = getattr(interrupt, "signum", signal.SIGINT)
        print(f"{PROG}: interrupted by {signal.Signals(signum).name}", file=sys.stderr)
        return 128 + signum
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _raise_interrupted(signum: int, frame) -> None:
    raise _Interrupted(signum)


@dataclass
class JobPlan:
    """Everything checked and decided before any process is started."""

    num_proc: int
    base_env: Dict[str, str]
    coordinator_bind: str
    coordinator_advertise: str
    start_timeout: float
    spec: LaunchSpec
    mpi: MpiImplementation
    output_dir: Optional[str]
    hostfile_text: Optional[str]
    verbose: bool
    hosts_origin: Optional[str] = None
    #: said on stderr before the job starts, verbose or not (e.g. "inside an srun step: ...")
    notes: Sequence[str] = ()


def plan_job(args: argparse.Namespace, environ: Mapping[str, str]) -> JobPlan:
    """Check ``args`` and decide hosts, environment, coordinator address and MPI command.

    Raises:
        LaunchError: for anything that would make the job fail to start.
    """
    explicit_hosts = args.hosts is not None or args.hostfile is not None
    allocation = None if explicit_hosts else slurm_allocation(environ)
    hosts = resolve_hosts(args.hosts, args.hostfile, allocation)
    num_proc = args.num_proc if args.num_proc is not None else _default_num_proc(hosts, allocation,
                                                                                  explicit_hosts)
    notes = []
    oversubscribe = args.oversubscribe
    if not explicit_hosts and allocation is None and num_proc > total_slots(hosts) and not oversubscribe:
        # As `horovodrun -np N`: with no host list, N ranks run on this machine, however many cores.
        oversubscribe = True
        notes.append(f"{num_proc} ranks on this machine's {total_slots(hosts)} core(s): ranks share cores")
    check_slots(num_proc, hosts, oversubscribe, allocation)
    check_command(args.command, local_only=all_local(hosts))
    if args.ssh_identity_file is not None and not os.path.isfile(args.ssh_identity_file):
        raise LaunchError(f"--ssh-identity-file {args.ssh_identity_file!r} does not exist")
    if args.network_interface is not None:
        interface_ipv4(args.network_interface)  # fails now if there is no such interface
    mpi_args = split_mpi_args(args.mpi_args)

    tuning = tuning_environment({dest: getattr(args, dest) for dest in FLAG_SETTINGS}, verbose=args.verbose)
    base_env = base_environment(environ, tuning)
    if oversubscribe and START_TIMEOUT not in base_env:
        shared = math.ceil(num_proc / max(1, total_slots(hosts)))
        if shared > 1:
            # Ranks that share cores start that much slower (each imports torch); 30 s was too
            # short for 8 ranks on 2 busy cores (2 of 19 runs of bench/small_collectives.py).
            base_env[START_TIMEOUT] = f"{Config.start_timeout_s * shared:g}"
            notes.append(f"start timeout {base_env[START_TIMEOUT]} s ({shared} ranks a core; "
                         f"{START_TIMEOUT} or --start-timeout sets it)")
    config = validated_config(base_env)
    mpi = detect_mpi(find_mpirun())
    address = coordinator_address(hosts, args.network_interface)
    spec = LaunchSpec(
        num_proc=num_proc, hosts=hosts, command=args.command,
        # the names only: the values (address, secret) exist once the coordinator runs
        export_names=exported_names(job_environment(base_env, "", "")),
        oversubscribe=oversubscribe, network_interface=args.network_interface,
        ssh_port=args.ssh_port, ssh_identity_file=args.ssh_identity_file,
        # a remote host whose sshd hangs must fail the launch within the start timeout
        ssh_connect_timeout=None if all_local(hosts) else config.start_timeout_s,
        run_as_root=hasattr(os, "geteuid") and os.geteuid() == 0, mpi_args=mpi_args,
    )
    build_command(mpi, spec)  # refuses what this MPI cannot do, before anything starts
    return JobPlan(
        num_proc=num_proc, base_env=base_env, coordinator_bind=address.bind,
        coordinator_advertise=address.advertise, start_timeout=config.start_timeout_s,
        spec=spec, mpi=mpi, output_dir=_output_dir(args.output_filename),
        hostfile_text=hostfile_text(mpi.kind, hosts) if args.hostfile is not None else None,
        verbose=args.verbose, hosts_origin=allocation.describe() if allocation is not None else None,
        notes=notes + ([note] if allocation is not None and (note := allocation.step_note()) else []),
    )


def _default_num_proc(hosts: Sequence[Host], allocation: Optional[SlurmAllocation],
                      explicit_hosts: bool) -> int:
    """``-np`` when it was not given: ``SLURM_NTASKS`` (else every slot) in an allocation,
    every slot of ``-H``/``--hostfile``; on this machine alone it is required."""
    if allocation is not None and allocation.ntasks is not None:
        return allocation.ntasks
    if allocation is None and not explicit_hosts:
        raise LaunchError("-np N is required (or give -H/--hostfile to use every slot)")
    return total_slots(hosts)


def run_job(plan: JobPlan) -> int:
    """Start the coordinator, run the MPI job, tear everything down; return the exit status."""
    secret = secrets.token_hex(32)
    remove_stale_workdirs()  # what ringruns killed with SIGKILL left
    workdir = make_workdir()
    coordinator = CoordinatorProcess(
        size=plan.num_proc, bind=plan.coordinator_bind, advertise=plan.coordinator_advertise,
        env=coordinator_environment(plan.base_env, secret),
        address_file=os.path.join(workdir, "coordinator.address"), start_timeout=plan.start_timeout,
        report_file=os.path.join(workdir, "coordinator.report"),
    )
    watch = AbortWatch(coordinator.report_file, stop_limit_s=validated_config(plan.base_env).host_timeout_s)
    try:
        if plan.hostfile_text is not None:
            plan.spec.hostfile = os.path.join(workdir, "hostfile")
            with open(plan.spec.hostfile, "w", encoding="utf-8") as handle:
                handle.write(plan.hostfile_text)
        command = build_command(plan.mpi, plan.spec)
        for note in plan.notes:
            print(f"{PROG}: {note}", file=sys.stderr)
        if plan.verbose and plan.hosts_origin is not None:
            hosts = ",".join(str(host) for host in plan.spec.hosts)
            print(f"{PROG}: hosts {hosts} from {plan.hosts_origin}", file=sys.stderr)
        if plan.verbose:
            print(f"{PROG}: starting the coordinator: {shlex.join(coordinator.command())}", file=sys.stderr)
        coordinator_addr = coordinator.start()
        watch.coordinator_pid = coordinator.process.pid
        if plan.verbose:
            print(f"{PROG}: coordinator listening on {coordinator_addr}", file=sys.stderr)
            print(f"{PROG}: {shlex.join(command)}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        env = job_environment(plan.base_env, coordinator_addr, secret, str(coordinator.process.pid))
        job = MpiJob(command, env, OutputRelay(plan.mpi.kind, plan.output_dir),
                     on_signal=coordinator.send_signal, abort_watch=watch)
        status = job.run()
    finally:
        for signum in FORWARDED_SIGNALS:  # a bounded teardown is not to be interrupted
            signal.signal(signum, signal.SIG_IGN)
        coordinator.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    last_line = watch.last_line()
    if status != 0 and last_line is not None:  # after everything else: the cause is the last line
        print(f"{PROG}: {last_line}", file=sys.stderr, flush=True)
        return status if status != 0 else FAILURE_EXIT
    return status


def _output_dir(path: Optional[str]) -> Optional[str]:
    if path is None:
        return None
    path = os.path.abspath(path)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as error:
        raise LaunchError(f"--output-filename: cannot create directory {path!r}: {error.strerror}") from None
    return path


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
