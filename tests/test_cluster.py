"""Multi-host tests on a cluster of network-namespace hosts on this machine (tests/cluster/).

Each host is a network namespace with its own hostname, address and sshd; ``ringrun`` runs
inside the first host, as one would log into a node of a real cluster and launch from there.
The tests skip, with the reason, where no cluster can be built (not root, no ``ip netns``,
no ``/usr/sbin/sshd``: ``tests/cluster/setup.sh`` installs it). Every cluster is torn down
after its test, whether the test passed or not.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from mpijob import job_environment

from cluster import netns_cluster as ncl
from cluster.fixtures import netns_cluster, netns_cluster_factory, run_on  # noqa: F401

ROOT = Path(__file__).resolve().parent.parent
CLUSTER_DIR = Path(__file__).resolve().parent / "cluster"


def _start_or_skip(num_hosts: int = 2) -> ncl.NetnsCluster:
    try:
        return ncl.NetnsCluster(num_hosts).start()
    except ncl.ClusterUnavailable as error:
        pytest.skip(str(error))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat", encoding="ascii") as handle:  # a zombie is gone too
        return handle.read().rsplit(")", 1)[1].split()[0] != "Z"


def _user_known_hosts() -> bytes:
    path = Path("~/.ssh/known_hosts").expanduser()
    return path.read_bytes() if path.exists() else b""


@pytest.mark.timeout(30)
def test_hosts_have_own_names_and_answer_ssh_with_the_cluster_key(netns_cluster):
    cluster = netns_cluster
    known_hosts_before = _user_known_hosts()
    names = [host.name for host in cluster.hosts]
    assert len(set(names)) == len(names)
    for host in cluster.hosts:
        assert host.run(["hostname"], check=True).stdout.strip() == host.name
        result = cluster.ssh(host, ["hostname"])  # from the root namespace
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == host.name
        # a host's own name resolves to its cluster address (not to loopback)
        own = host.run(["getent", "ahostsv4", host.name], check=True).stdout.split()[0]
        assert own == host.address
    first, second = cluster.hosts
    result = cluster.ssh(second, ["hostname"], from_host=first)  # host to host, by name
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == second.name
    # without the key, root is not let in
    result = subprocess.run(["ssh", "-o", "BatchMode=yes", "-o", "IdentitiesOnly=yes",
                             f"root@{first.name}", "true"], capture_output=True, text=True, timeout=20)
    assert result.returncode == 255
    # the host key is known from the cluster's ssh_known_hosts lines: nothing is added to ~/.ssh
    assert _user_known_hosts() == known_hosts_before


@pytest.mark.timeout(30)
def test_teardown_removes_everything_even_after_a_failure():
    with pytest.raises(RuntimeError, match="the test failed"):
        with _start_or_skip(2) as cluster:
            name, workdir = cluster.name, cluster.workdir
            sshd_pids = [host.sshd_pid for host in cluster.hosts]
            assert ncl.leftovers(name)
            raise RuntimeError("the test failed")
    assert ncl.leftovers(name) == []
    assert not os.path.exists(workdir)
    assert not any(_alive(pid) for pid in sshd_pids)
    cluster.close()  # idempotent


_OWNER = """\
import sys, time
sys.path.insert(0, sys.argv[1])
import netns_cluster as ncl
cluster = ncl.NetnsCluster(2).start()
print(cluster.name, *(host.sshd_pid for host in cluster.hosts), flush=True)
time.sleep(60)
"""


def _owner_process():
    process = subprocess.Popen([sys.executable, "-c", _OWNER, str(CLUSTER_DIR)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    line = process.stdout.readline().split()
    if not line:
        stderr = process.communicate(timeout=10)[1]
        if "ClusterUnavailable" in stderr:
            pytest.skip(stderr.strip().splitlines()[-1])
        pytest.fail(f"the cluster owner failed: {stderr}")
    return process, line[0], [int(pid) for pid in line[1:]]


@pytest.mark.timeout(30)
def test_sigterm_to_the_owner_tears_the_cluster_down():
    ncl.unavailable_reason() and pytest.skip(ncl.unavailable_reason())
    process, name, sshd_pids = _owner_process()
    assert ncl.leftovers(name)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=20) == -signal.SIGTERM
    assert ncl.leftovers(name) == []
    assert not any(_alive(pid) for pid in sshd_pids)


@pytest.mark.timeout(30)
def test_cleanup_stale_removes_what_a_killed_owner_left():
    ncl.unavailable_reason() and pytest.skip(ncl.unavailable_reason())
    process, name, sshd_pids = _owner_process()
    process.kill()  # no teardown can run
    process.wait(timeout=10)
    try:
        left = ncl.leftovers(name)
        assert any(item.startswith("netns") for item in left) and any("/etc/hosts" in item for item in left)
        assert all(_alive(pid) for pid in sshd_pids)
    finally:
        removed = ncl.cleanup_stale()
    assert any(name in item for item in removed)
    assert ncl.leftovers(name) == []
    deadline = time.monotonic() + 5
    while any(_alive(pid) for pid in sshd_pids) and time.monotonic() < deadline:
        time.sleep(0.05)  # orphans are reaped by init
    assert not any(_alive(pid) for pid in sshd_pids)


@pytest.mark.timeout(30)
def test_rate_caps_each_host_link(netns_cluster_factory):
    cluster = netns_cluster_factory(2, rate=["100mbit", "10gbit"])
    first, second = cluster.hosts
    for host, rate in ((first, "100Mbit"), (second, "10Gbit")):
        for shown in (subprocess.run(["tc", "qdisc", "show", "dev", host.veth], capture_output=True, text=True).stdout,
                      host.run(["tc", "qdisc", "show", "dev", cluster.interface]).stdout):
            assert "tbf 1: root" in shown and f"rate {rate}" in shown, shown
    # a 100 Mbit/s link is the bottleneck in both directions
    for src, dst in ((first, second), (second, first)):
        mbit = cluster.throughput_mbit(src, dst, nbytes=4_000_000)
        assert 40 < mbit < 125, f"{src.name} -> {dst.name}: {mbit:.0f} Mbit/s through a 100 Mbit/s link"


@pytest.mark.timeout(30)
def test_delay_adds_latency_to_each_host_link(netns_cluster_factory):
    reason = ncl.unavailable_reason(shaping_delay=True)
    if reason:
        pytest.skip(reason)
    cluster = netns_cluster_factory(2, delay="5ms", rate="1gbit")
    first, second = cluster.hosts
    # a TCP connect is one round trip across two links, each delayed 5 ms each way
    assert cluster.rtt_ms(first, second, count=5) >= 18


RANKS = textwrap.dedent("""\
    import socket, torch, ringmaster as rm
    rm.init()
    small = rm.allreduce(torch.tensor([rm.rank() + 1.0]), op=rm.Sum)
    large = rm.allreduce(torch.full((4 << 20,), rm.rank() + 1.0), op=rm.Sum)  # 16 MiB: the ring
    print("RESULT", socket.gethostname(), rm.rank(), rm.size(), rm.local_rank(), rm.local_size(),
          rm.cross_rank(), rm.cross_size(), small.item(), large.min().item(), large.max().item(), flush=True)
    rm.shutdown()
""")


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("interface", [True, False], ids=["network-interface", "default-address"])
def test_ringrun_across_two_hosts(netns_cluster, interface):
    """``ringrun`` started on host 1 puts rank 0 there and rank 1 on host 2 (over ssh with the
    cluster's key); the ranks reach the coordinator on host 1 and reduce across the hosts.
    With ``--network-interface eth0`` the coordinator listens on host 1's cluster address;
    without, on all addresses, advertising the one host 1 uses to reach host 2."""
    cluster = netns_cluster
    first, second = cluster.hosts
    network = ["--network-interface", cluster.interface] if interface else []
    command = [sys.executable, "-m", "ringmaster.launch", "-np", "2", "-H", cluster.hosts_arg(1),
               "--ssh-identity-file", cluster.key, *network, "--verbose",
               "--start-timeout", "30", sys.executable, "-c", RANKS]
    result = run_on(first, command, timeout=50, env=job_environment(), cwd=str(ROOT))
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    assert f"coordinator listening on {first.address}:" in result.stderr, result.stderr
    rows = {}
    for line in result.stdout.splitlines():
        fields = line.split()
        if "RESULT" in fields:
            row = fields[fields.index("RESULT") + 1:]
            rows[int(row[1])] = row
    assert sorted(rows) == [0, 1], result.stdout + result.stderr
    for rank, host in ((0, first), (1, second)):
        name, _, size, local_rank, local_size, cross_rank, cross_size, small, low, high = rows[rank]
        assert name == host.name
        assert (int(size), int(local_rank), int(local_size), int(cross_rank), int(cross_size)) == (2, 0, 1, rank, 2)
        assert float(small) == float(low) == float(high) == 3.0
