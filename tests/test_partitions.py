"""Partitions, a stopped coordinator and stragglers, on the namespace cluster (tests/cluster/; issue 46).

Each job is ``tests/jobs/cluster_partition.py``: a 1 MiB allreduce every 20 ms, one rank per
host, launched by ``ringrun`` from the first host. What is checked, each bounded in time and
each ending with no process of the job left on any host:

- host 2's link is cut mid-training (its bridge port set down, as a switch port or cable
  failure does): the coordinator names host 2 as unreachable within the host timeout (8 s),
  ringrun ends within its grace after that, non-zero, its last line naming the cause and the
  host; the rank and MPI daemon left on host 2 end themselves before the link comes back;
- the coordinator is stopped (SIGSTOP, as a frozen VM is): every rank ends saying that the
  coordinator stopped answering, and so does ringrun.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
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


def last_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.strip()]
    return lines[-1] if lines else ""


@pytest.mark.timeout(120)
def test_a_host_cut_off_mid_training_ends_the_job_and_leaves_nothing(netns_cluster):  # noqa: F811
    cluster = netns_cluster
    first, second = cluster.hosts
    with start_on(first, ringrun(cluster), env=job_environment(), cwd=str(ROOT)) as job:
        job.wait_for_matches(r"STEP [01] 20\b", count=2, timeout=60)
        cut_at = time.monotonic()
        set_link(second, up=False)
        try:
            returncode = job.wait(timeout=HOST_TIMEOUT_S + GRACE_S + 20)
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
    assert returncode != 0, output
    assert f"host {second.name} is unreachable" in output, output
    assert f"host {second.name} is unreachable" in last_line(output), output
    assert ended_s < HOST_TIMEOUT_S + 2 + GRACE_S + 5, f"ringrun ended {ended_s:.1f} s after the cut\n{output}"
    assert left_on_second == {}, f"{orphans_s:.1f} s after the cut, host 2 still runs {left_on_second}"
    assert wait_for_no_processes(cluster) == {}


@pytest.mark.timeout(120)
def test_a_stopped_coordinator_ends_every_rank_saying_so(netns_cluster):  # noqa: F811
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
    assert returncode != 0, output
    for rank in (0, 1):
        assert re.search(rf"rank {rank}: the coordinator at \S+ stopped answering", output), output
    assert "stopped answering" in last_line(output), output
    assert ended_s < HOST_TIMEOUT_S + 2 + GRACE_S + 5, f"ringrun ended {ended_s:.1f} s after the stop\n{output}"
    assert wait_for_no_processes(cluster, timeout=3 * HOST_TIMEOUT_S) == {}
