"""Elastic training across namespace hosts (tests/cluster/): lose a host, keep training; get it back, grow.

Each job runs tests/jobs/elastic_train.py under an elastic ``ringrun`` started on host 1,
one rank per host. The job's state records every optimizer step it kept (world size and
each rank's batch indices); the final parameters must equal
:func:`elastic_train.replay` of that record in this process, to 1e-5. The tests skip where
no cluster can be built (see tests/test_cluster.py).
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest
import torch
from mpijob import JOBS_DIR, job_environment

from cluster.fixtures import netns_cluster_factory, start_on, wait_for_no_processes  # noqa: F401

sys.path.insert(0, JOBS_DIR)
import elastic_train  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "tests" / "jobs" / "elastic_train.py"


def elastic_ringrun(cluster, out: Path, *options: str, job_args=()):
    return [sys.executable, "-m", "ringmaster.launch", "--ssh-identity-file", cluster.key,
            "--network-interface", cluster.interface, "--start-timeout", "20", *options,
            sys.executable, str(JOB), str(out), *job_args]


def assert_matches_replay(out: Path):
    """The job's final parameters equal the one-process replay of its committed steps."""
    record = torch.load(out, weights_only=False)
    reference = elastic_train.replay(record["history"], elastic_train.EXAMPLES)
    worst = max((reference[name] - record["state_dict"][name]).abs().max().item() for name in reference)
    assert worst < 1e-5, f"final parameters differ from the replay by {worst:g}"
    return record


def kill_ranks_on(host) -> list:
    """SIGKILL every rank of the job on ``host``: the python processes running the job script
    (not ringrun or mpirun, whose command lines name it too)."""
    pids = [pid for pid, line in host.processes().items() if line.split()[1:2] == [str(JOB)]]
    assert pids, host.processes()
    host.run([sys.executable, "-c", f"import os; [os.kill(p, 9) for p in {pids}]"], check=True)
    return pids


@pytest.mark.timeout(120)
def test_lost_ranks_are_shrunk_away_in_place_rank_0_too_matching_the_replay(netns_cluster_factory, tmp_path):
    """SIGKILL of the ranks on host 3 mid-training (its MPI daemon lives on): the ranks on
    hosts 1 and 2, the same processes, shrink the job in place (ULFM) within seconds and go
    on from the last commit after the reset callbacks, a log line naming host 3. Then rank 0
    (on host 1, where ringrun and the coordinator stay) is killed: host 2's rank goes on
    alone as the new rank 0. The job finishes, and its final parameters equal the
    one-process replay of its (world size, batches) record: steps on 3, 2, then 1 rank."""
    cluster = netns_cluster_factory(3)
    first, second, third = cluster.hosts
    out = tmp_path / "final.pt"
    command = elastic_ringrun(cluster, out, "-np", "3", "--min-np", "1", "-H", cluster.hosts_arg(1),
                              job_args=["--step-sleep", "0.1"])
    with start_on(first, command, env=job_environment(), cwd=str(ROOT)) as job:
        job.wait_for_matches(rf"STEP 0 5 rank 2 host {third.name}", count=1, timeout=60)
        kill_ranks_on(third)
        killed_at = time.monotonic()
        job.wait_for_matches(r"RESET size 2", count=2, timeout=40)
        reset_after = time.monotonic() - killed_at
        print(f"the survivors went on {reset_after:.2f} s after the kill")
        job.wait_for_matches(rf"STEP 0 1[0-9] rank 0 host {first.name}", count=1, timeout=40)
        kill_ranks_on(first)
        job.wait_for_matches(r"RESET size 1", count=1, timeout=40)
        returncode = job.wait(timeout=60)
    assert returncode == 0, job.output[-4000:]
    for host, size in ((third, 2), (first, 1)):
        assert re.search(rf"lost rank \d on host {re.escape(host.name)} .*the other ranks shrank the job in place "
                         rf"to {size} rank\(s\)", job.output), job.output[-4000:]
    steps = re.findall(r"STEP (\d+) \d+ rank (\d) host (\S+) pid (\d+)", job.stdout)
    assert {generation for generation, _, _, _ in steps} == {"0"}, "a new mpirun was started"
    assert len({pid for _, _, host, pid in steps if host == second.name}) == 1  # the same process throughout
    assert steps[-1][1:3] == ("0", second.name), steps[-1]
    record = assert_matches_replay(out)
    sizes = [size for size, _ in record["history"]]
    changes = [size for index, size in enumerate(sizes) if index == 0 or sizes[index - 1] != size]
    assert changes == [3, 2, 1] and record["resets"] == 2, sizes
    assert reset_after < 10, f"the job took {reset_after:.1f} s to shrink"
    assert wait_for_no_processes(cluster) == {}


def horovod_elastic_script(tmp_path: Path) -> Path:
    """tests/jobs/horovod_elastic_script.py with its import line changed to ringmaster, and nothing else."""
    source = (Path(JOBS_DIR) / "horovod_elastic_script.py").read_text()
    assert source.count("import horovod.torch as hvd\n") == 1
    script = tmp_path / "horovod_elastic_script.py"
    script.write_text(source.replace("import horovod.torch as hvd\n", "import ringmaster as hvd\n"))
    return script


@pytest.mark.timeout(60)
def test_horovod_elastic_script_runs_then_below_min_np_ends_with_an_error_naming_the_lost_host(
        netns_cluster_factory, tmp_path):
    """A script written for Horovod's elastic API, with only its import changed, trains on 3
    hosts under an elastic ringrun, each epoch covering every example once (ElasticSampler,
    record_batch). With --min-np 3, losing host 3's rank then ends the job within 10 s, with
    an error naming host 3 and --min-np, and nothing left running."""
    cluster = netns_cluster_factory(3)
    first, _, third = cluster.hosts
    script = horovod_elastic_script(tmp_path)
    command = [sys.executable, "-m", "ringmaster.launch", "--ssh-identity-file", cluster.key, "--network-interface",
               cluster.interface, "--start-timeout", "20", "-np", "3", "--min-np", "3", "-H", cluster.hosts_arg(1),
               sys.executable, str(script), "--epochs", "100", "--step-sleep", "0.05"]
    with start_on(first, command, env=job_environment(), cwd=str(ROOT)) as job:
        job.wait_for_matches(r"EPOCH 0 processed 192 of 192", count=1, timeout=60)
        pids = [pid for pid, line in third.processes().items() if line.split()[1:2] == [str(script)]]
        assert pids, third.processes()
        third.run([sys.executable, "-c", f"import os; [os.kill(p, 9) for p in {pids}]"], check=True)
        killed_at = time.monotonic()
        returncode = job.wait(timeout=30)
        elapsed = time.monotonic() - killed_at
    assert returncode != 0
    message = re.search(r"ringrun: error: only 2 slot\(s\) left, below --min-np 3; lost hosts: (.*)", job.output)
    assert message and third.name in message[1], job.output[-3000:]
    assert elapsed < 10, f"the job took {elapsed:.1f} s to end"
    assert wait_for_no_processes(cluster) == {}


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_host_whose_network_stops_is_left_out_and_the_job_grows_back_when_it_returns(netns_cluster_factory,
                                                                                    tmp_path):
    """Host 3's network link goes down mid-training (and the discovery script stops listing
    it): its rank stops answering, the coordinator names it after the heartbeat timeout, the
    survivors cannot shrink in place (MPI does not learn of the loss), and ringrun re-forms
    the job on hosts 1 and 2 with a new mpirun from the commit it holds. The link comes back
    and the discovery script lists host 3 again: once its cooldown is over, at the next commit
    the ranks re-form on 3 hosts, the new one receiving the committed state by broadcast, and
    the job finishes there, matching the one-process replay."""
    cluster = netns_cluster_factory(3)
    first, _, third = cluster.hosts
    out = tmp_path / "final.pt"
    hosts_file = tmp_path / "hosts"
    hosts_file.write_text("".join(f"{host.name}:1\n" for host in cluster.hosts))
    command = elastic_ringrun(cluster, out, "-np", "3", "--min-np", "2", "--max-np", "3",
                              "--host-discovery-script", f"cat {hosts_file}", "--blacklist-cooldown-s", "4",
                              "--heartbeat-timeout-s", "4", "--heartbeat-interval-s", "0.5",
                              job_args=["--step-sleep", "0.1", "--epochs", "4"])
    # 4 epochs: with ranks that start in a second, 2 could end on 2 hosts before host 3's
    # cooldown was over. MPI never learns that host 3's rank is gone: the survivors give up
    # shrinking in place after 2 s.
    environment = job_environment({"RINGMASTER_ELASTIC_SHRINK_TIMEOUT_S": "2"})
    with start_on(first, command, env=environment, cwd=str(ROOT)) as job:
        job.wait_for_matches(rf"STEP 0 5 rank 2 host {third.name}", count=1, timeout=60)
        third.run(["ip", "link", "set", "eth0", "down"], check=True)
        hosts_file.write_text("".join(f"{host.name}:1\n" for host in cluster.hosts[:2]))
        try:
            job.wait_for_matches(r"RESET size 2", count=2, timeout=40)
        finally:
            third.run(["ip", "link", "set", "eth0", "up"], check=True)
        hosts_file.write_text("".join(f"{host.name}:1\n" for host in cluster.hosts))
        job.wait_for_matches(r"RESET size 3", count=3, timeout=60)
        returncode = job.wait(timeout=60)
    assert returncode == 0, job.output[-4000:]
    assert re.search(rf"lost rank 2 on host {re.escape(third.name)} .*sent no heartbeat", job.output), \
        job.output[-4000:]
    assert re.search(rf"hosts added {re.escape(third.name)}:1", job.output), job.output[-4000:]
    record = assert_matches_replay(out)
    sizes = [size for size, _ in record["history"]]
    changes = [size for index, size in enumerate(sizes) if index == 0 or sizes[index - 1] != size]
    # a heartbeat that came late on the loaded machine may add a re-form that loses nothing
    assert changes == [3, 2, 3] and record["size"] == 3 and record["resets"] >= 2, changes
    assert wait_for_no_processes(cluster, timeout=20) == {}
