"""Partitions, a stopped coordinator and stragglers, on the namespace cluster (tests/cluster/; issue 46).

Each job is ``tests/jobs/cluster_partition.py``: a 1 MiB allreduce every 20 ms, one rank per
host, launched by ``ringrun`` from the first host. What is checked, each bounded in time and
each ending with no process of the job left on any host:

- a straggler on host 2 is named by the stall warning, with its Python stack, and by the
  straggler report; then host 2's link is cut mid-training (its bridge port set down, as a
  switch port or cable failure does): the coordinator names host 2 as unreachable within the
  host timeout (8 s) and 2 s (its report's abort time), ringrun ends within its grace after
  that, non-zero, its last line naming the cause and the host; the rank and MPI daemon left
  on host 2 end themselves before the link comes back;
- the coordinator is stopped (SIGSTOP, as a frozen VM is): the rank off its host ends first,
  saying that the coordinator stopped answering (its stream's keepalive pings went unanswered
  for the host timeout), mpirun then ends the other, no rank names another cause, and ringrun's
  last line says the same (a rank on the coordinator's host, which reads the coordinator's
  state in /proc, is checked in tests/test_liveness.py);
- an elastic job (``--min-np``) whose host 3 is cut is relaunched on hosts 1 and 2 within 15 s,
  and trains again within that relaunch time plus the start-up of a job on those hosts
  measured just before (``mpirun`` over ssh, ``import torch``, ``init()``), with a small margin.
"""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from mpijob import job_environment

from cluster.fixtures import netns_cluster, netns_cluster_factory, start_on, wait_for_no_processes  # noqa: F401, F811

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "tests" / "jobs" / "cluster_partition.py"
#: RINGMASTER_HOST_TIMEOUT_S's default, which these tests check.
HOST_TIMEOUT_S = 8.0
#: ringrun's grace for mpirun after an abort (launch/abort_watch.py), and its own teardown.
GRACE_S = 5.0


def ringrun(cluster, *options: str, steps: int = 100_000, script_args=()):
    return [sys.executable, "-m", "ringmaster.launch", "-np", str(len(cluster.hosts)), "-H", cluster.hosts_arg(1),
            "--ssh-identity-file", cluster.key, "--network-interface", cluster.interface, *options,
            sys.executable, str(TRAIN), str(steps), *map(str, script_args)]


def set_link(host, up: bool) -> None:
    subprocess.run(["ip", "link", "set", host.veth, "up" if up else "down"], check=True, timeout=10)


def abort_times(directory) -> list:
    """The abort times (``time.time()``) in the coordinator's report of the ringrun whose TMPDIR
    is ``directory`` (ringrun removes its work directory at its end: read it while it runs)."""
    times = []
    for path in glob.glob(os.path.join(str(directory), "ringrun-*", "coordinator.report")):
        try:
            with open(path, encoding="utf-8") as handle:
                times += [event["time"] for event in map(json.loads, handle.read().splitlines())
                          if event.get("event") == "abort"]
        except (OSError, ValueError):
            pass
    return times


def wait_reading_aborts(job, directory, timeout: float):
    """``job.wait(timeout)``, reading the abort times of its coordinator's report meanwhile."""
    deadline, aborts = time.monotonic() + timeout, []
    while job.process.poll() is None and time.monotonic() < deadline:
        aborts = abort_times(directory) or aborts
        time.sleep(0.1)
    return job.wait(timeout=max(1.0, deadline - time.monotonic())), aborts


def last_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.strip()]
    return lines[-1] if lines else ""


@pytest.mark.timeout(120)
def test_a_straggler_then_a_cut_host_end_the_job_named_and_leave_nothing(netns_cluster, tmp_path):  # noqa: F811
    """One job, two things. First a straggler: rank 1 (host 2) sleeps 30 ms before each
    allreduce, and 3 s more before step 20 (in ``pause_here``): the stall warning (after 1 s)
    names rank 1, and rank 1 prints its Python stack, through host 2's agent, while the job
    goes on. Then, after step 40, host 2's link is cut: the coordinator names host 2 as
    unreachable within the host timeout and 2 s (the abort's time in its report), its
    straggler report (at the abort) names rank 1 as the straggler, ringrun ends within its
    grace, non-zero, its last line naming the cause and the host, and the rank, agent and MPI
    daemon on host 2 end themselves before the link comes back."""
    cluster = netns_cluster
    first, second = cluster.hosts
    command = ringrun(cluster, "--stall-warning-s", "1", script_args=(1, 0.03, 20, 3.0))
    with start_on(first, command, env=dict(job_environment(), TMPDIR=str(tmp_path)), cwd=str(ROOT)) as job:
        job.wait_for_matches(r"STEP [01] 40\b", count=2, timeout=60)
        cut_at, cut_wall = time.monotonic(), time.time()
        set_link(second, up=False)
        try:
            returncode, aborts = wait_reading_aborts(job, tmp_path, timeout=HOST_TIMEOUT_S + GRACE_S + 20)
            ended_s = time.monotonic() - cut_at
            # the rank, host agent and MPI daemon on host 2 end themselves while the link is still
            # down (2 host timeouts, then 2 s for each kill); only the sshd session that served the
            # cut-off launcher waits for the link, to learn that its client is gone
            left_on_second = {}
            deadline = cut_at + 2 * HOST_TIMEOUT_S + 15
            while time.monotonic() < deadline and (left_on_second := {
                    pid: line for pid, line in second.processes().items() if not line.startswith("sshd: ")}):
                time.sleep(0.2)
            orphans_s = time.monotonic() - cut_at
        finally:
            set_link(second, up=True)
    output = job.output
    abort_s = aborts[0] - cut_wall if aborts else float("inf")
    print(f"the coordinator aborted the job {abort_s:.1f} s after the cut; ringrun ended {ended_s:.1f} s after it; "
          f"host 2 was empty {orphans_s:.1f} s after it")
    # the straggler
    assert re.search(rf"stall: .*rank 1 .*{re.escape(second.name)}", output), output[-4000:]
    assert re.search(rf"rank 1 \(host {re.escape(second.name)}, pid \d+\) was asked for its Python stacks", output), \
        output[-4000:]
    # faulthandler's dump from rank 1, tagged by mpirun with its rank: the pause is on its stack
    assert re.search(r"\[1\]:\s+File \".*cluster_partition\.py\", line \d+ in pause_here", output), output[-4000:]
    report = output[output.index("straggler report:"):].splitlines()
    assert f"rank 1 on {second.name}: mean lateness" in report[1], report
    lateness_ms = float(re.search(r"mean lateness ([\d.]+) ms", report[1])[1])
    assert 20 < lateness_ms < 300, report  # 30 ms a step, plus the 3 s pause over 40-odd steps
    assert any(f"rank 1 on {second.name} is a straggler" in line for line in report[:12]), report
    # the cut
    assert returncode != 0, output[-4000:]
    assert f"host {second.name} is unreachable" in last_line(output), output[-4000:]
    assert last_line(output).startswith("ringrun: the job was aborted: "), output[-4000:]
    assert abort_s <= HOST_TIMEOUT_S + 2, f"the coordinator aborted {abort_s:.1f} s after the cut\n{output[-4000:]}"
    assert ended_s < HOST_TIMEOUT_S + 2 + GRACE_S + 5, f"ringrun ended {ended_s:.1f} s after the cut\n{output}"
    assert left_on_second == {}, f"{orphans_s:.1f} s after the cut, host 2 still runs {left_on_second}"
    assert wait_for_no_processes(cluster) == {}


@pytest.mark.timeout(120)
def test_a_stopped_coordinator_ends_the_job_saying_so(netns_cluster):  # noqa: F811
    """SIGSTOP on the coordinator mid-training. Rank 1 (host 2) notices first, by design: its
    stream's pings break once the host timeout has passed since their last answer, where rank 0
    (the coordinator's host) counts the timeout from its first look at the stopped process in
    /proc, up to a second later; once rank 1 has ended, mpirun ends rank 0, which may say
    nothing. So: rank 1 names the silence, any rank that says more names the same cause, and
    ringrun ends within the host timeout and its grace, non-zero, its last line naming it."""
    cluster = netns_cluster
    first, second = cluster.hosts
    with start_on(first, ringrun(cluster), env=job_environment(), cwd=str(ROOT)) as job:
        job.wait_for_matches(r"STEP [01] 20\b", count=2, timeout=60)
        [coordinator] = [pid for pid, line in first.processes().items() if "-m ringmaster.coordinator " in line]
        stopped_at = time.monotonic()
        os.kill(coordinator, signal.SIGSTOP)
        try:
            returncode = job.wait(timeout=HOST_TIMEOUT_S + GRACE_S + 20)
        finally:
            try:
                os.kill(coordinator, signal.SIGKILL)
            except ProcessLookupError:
                pass
        ended_s = time.monotonic() - stopped_at
    output = job.output
    print(f"ringrun ended {ended_s:.1f} s after the coordinator was stopped")
    assert returncode != 0, output
    assert re.search(r"rank 1: the coordinator at \S+ stopped answering: keepalive pings on this stream got no "
                     r"answer for 8 s", output), output
    errors = [line for line in output.splitlines() if "ringmaster ERROR" in line]
    assert errors and all("stopped answering" in line for line in errors), output
    assert "stopped answering" in last_line(output), output
    assert ended_s < HOST_TIMEOUT_S + 2 + GRACE_S + 5, f"ringrun ended {ended_s:.1f} s after the stop\n{output}"
    assert wait_for_no_processes(cluster, timeout=3 * HOST_TIMEOUT_S) == {}


ELASTIC_JOB = ROOT / "tests" / "jobs" / "elastic_train.py"
#: how soon after the cut ringrun must have started the job on the reachable hosts (issue 46)
REFORM_S = 15.0
#: what training again may take beyond the relaunch and the ranks' measured start-up (issue 55):
#: the restore of the last commit and the first steps. Measured 2026-12-08 (two runs, nothing else
#: running): 2.6 s and 2.0 s, so 3 s left 0.4 s to spare in one of them; 4 s leaves 1.4 s or more.
RESUME_MARGIN_S = 4.0
STARTUP = "import torch, ringmaster as rm; rm.init(); print('STARTUP', rm.rank(), flush=True); rm.shutdown()"


def ranks_startup_s(cluster, hosts) -> float:
    """The ranks' start-up on ``hosts`` as a relaunch pays it, measured now: from starting a job
    there (``mpirun`` over ssh, ``import torch``, ``init()``) until every rank has started."""
    command = [sys.executable, "-m", "ringmaster.launch", "--ssh-identity-file", cluster.key, "--network-interface",
               cluster.interface, "-np", str(len(hosts)), "-H", cluster.hosts_arg(1, hosts), sys.executable, "-c",
               STARTUP]
    started = time.monotonic()
    with start_on(hosts[0], command, env=job_environment(), cwd=str(ROOT)) as probe:
        probe.wait_for_matches(r"STARTUP \d", count=len(hosts), timeout=90)
        startup_s = time.monotonic() - started
        probe.wait(timeout=30)
    return startup_s


@pytest.mark.timeout(180)
def test_an_elastic_job_reforms_on_the_reachable_hosts_after_a_cut(netns_cluster_factory, tmp_path):  # noqa: F811
    """Host 3's link is cut mid-training under ``--min-np 2``, with default timeouts: within
    15 s of the cut ringrun has started the job again on hosts 1 and 2 (MPI never learns of
    the cut, so the survivors cannot shrink in place), which trains again within that relaunch
    time plus the start-up of a job on hosts 1 and 2 measured just before (``mpirun`` over
    ssh, ``import torch``, ``init()``), plus a small margin (:data:`RESUME_MARGIN_S`), resumes
    from the last commit and finishes there, its final parameters equal to the one-process
    replay of its committed steps; nothing of the job is left on any host once the link is back."""
    sys.path.insert(0, str(ROOT / "tests" / "jobs"))
    import elastic_train

    cluster = netns_cluster_factory(3)
    first, second, third = cluster.hosts
    startup_s = ranks_startup_s(cluster, [first, second])
    out = tmp_path / "final.pt"
    command = [sys.executable, "-m", "ringmaster.launch", "--ssh-identity-file", cluster.key, "--network-interface",
               cluster.interface, "--start-timeout", "20", "-np", "3", "--min-np", "2", "-H", cluster.hosts_arg(1),
               sys.executable, str(ELASTIC_JOB), str(out), "--step-sleep", "0.1", "--epochs", "3"]
    with start_on(first, command, env=job_environment(), cwd=str(ROOT)) as job:
        job.wait_for_matches(rf"STEP 0 5 rank 2 host {third.name}", count=1, timeout=60)
        cut_at = time.monotonic()
        set_link(third, up=False)
        try:
            deadline = cut_at + REFORM_S + 20
            while "generation 1: 2 rank(s)" not in job.output and time.monotonic() < deadline:
                time.sleep(0.1)
            relaunched_s = time.monotonic() - cut_at
            job.wait_for_matches(r"RESET size 2", count=2, timeout=60)
            reformed_s = time.monotonic() - cut_at
            returncode = job.wait(timeout=60)
            deadline = cut_at + 2 * HOST_TIMEOUT_S + 15
            while time.monotonic() < deadline and {
                    pid for pid, line in third.processes().items() if not line.startswith("sshd: ")}:
                time.sleep(0.2)
        finally:
            set_link(third, up=True)
    bound_s = relaunched_s + startup_s + RESUME_MARGIN_S
    print(f"ringrun started the job on 2 hosts {relaunched_s:.1f} s after the cut; it trained again "
          f"{reformed_s:.1f} s after the cut (bound {bound_s:.1f} s: the relaunch, the ranks' start-up "
          f"{startup_s:.1f} s and {RESUME_MARGIN_S:g} s)")
    assert returncode == 0, job.output[-4000:]
    assert re.search(rf"host {re.escape(third.name)} is unreachable", job.output), job.output[-4000:]
    assert relaunched_s < REFORM_S, f"re-formed {relaunched_s:.1f} s after the cut\n{job.output[-4000:]}"
    assert reformed_s <= bound_s, (f"trained again {reformed_s:.1f} s after the cut, more than the relaunch "
                                   f"({relaunched_s:.1f} s) + the ranks' start-up ({startup_s:.1f} s) + "
                                   f"{RESUME_MARGIN_S:g} s\n{job.output[-4000:]}")
    record = torch.load(out, weights_only=False)
    reference = elastic_train.replay(record["history"], elastic_train.EXAMPLES)
    worst = max((reference[name] - record["state_dict"][name]).abs().max().item() for name in reference)
    assert worst < 1e-5, f"final parameters differ from the replay by {worst:g}"
    assert [size for size, _ in record["history"]][-1] == 2
    assert wait_for_no_processes(cluster, timeout=20) == {}

