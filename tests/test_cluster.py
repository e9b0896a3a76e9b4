"""Multi-host tests on a cluster of network-namespace hosts on this machine (tests/cluster/).

Each host is a network namespace with its own hostname, address and sshd; ``ringrun`` runs
inside the first host, as one would log into a node of a real cluster and launch from there.
The tests skip, with the reason, where no cluster can be built (not root, no ``ip netns``,
no ``/usr/sbin/sshd``: ``tests/cluster/setup.sh`` installs it), and fail instead where
``RINGMASTER_REQUIRE_CLUSTER=1`` (CI sets it in .ci/run). Every cluster is torn down
after its test, whether the test passed or not.

Jobs run one rank per host: across hosts the collectives and the training example give the
numbers they give on one host; a host without a working sshd, or a rank killed on another
host, ends the job in bounded time with a message naming the host; the coordinator refuses
calls from another host that lack the job's token; and ringrun's ssh options reach the
daemons Open MPI starts from other daemons (tree spawn).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from mpijob import JobResult, job_environment, run_command

from cluster import netns_cluster as ncl
from cluster.fixtures import (netns_cluster, netns_cluster_factory, run_on, start_on,  # noqa: F401
                              unavailable, wait_for_no_processes)

ROOT = Path(__file__).resolve().parent.parent
CLUSTER_DIR = Path(__file__).resolve().parent / "cluster"


def _start_or_skip(num_hosts: int = 2) -> ncl.NetnsCluster:
    try:
        return ncl.NetnsCluster(num_hosts).start()
    except ncl.ClusterUnavailable as error:
        unavailable(str(error))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat", encoding="ascii") as handle:  # a zombie is gone too
        return handle.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_a_cluster_that_cannot_be_built_skips_unless_one_is_required(monkeypatch):
    monkeypatch.setenv("RINGMASTER_REQUIRE_CLUSTER", "1")
    with pytest.raises(pytest.fail.Exception, match="REQUIRE_CLUSTER=1 and no cluster can be built: no sshd"):
        unavailable("no sshd")
    monkeypatch.delenv("RINGMASTER_REQUIRE_CLUSTER")
    with pytest.raises(pytest.skip.Exception, match="no sshd"):
        unavailable("no sshd")


def test_ci_requires_the_cluster():
    assert "export RINGMASTER_REQUIRE_CLUSTER=1" in (ROOT / ".ci" / "run").read_text().splitlines()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("required,status", [("1", 1), ("", 0)])
def test_setup_fails_only_where_a_cluster_is_required(tmp_path, required, status):
    # A machine without apt-get, ssh or ip (as a user without root would be, it cannot install them).
    tools = tmp_path / "bin"
    tools.mkdir()
    for tool in ("bash", "id", "head", "dirname"):
        (tools / tool).symlink_to(shutil.which(tool))
    result = subprocess.run([str(tools / "bash"), str(CLUSTER_DIR / "setup.sh")], capture_output=True, text=True,
                            timeout=20, env={"PATH": str(tools), "RINGMASTER_REQUIRE_CLUSTER": required})
    assert result.returncode == status, result.stderr
    assert ("failing" in result.stderr) == (status == 1) and ("will skip" in result.stderr) == (status == 0), \
        result.stderr


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


@pytest.mark.timeout(60)
def test_cluster_under_a_world_writable_sticky_directory_lets_root_in_everywhere(tmp_path):
    # as /tmp is on most machines: mode 1777 (a default sshd refuses keys kept below it)
    parent = tmp_path / "sticky"
    parent.mkdir()
    parent.chmod(0o1777)
    try:
        cluster = ncl.NetnsCluster(3, parent_dir=str(parent)).start()
    except ncl.ClusterUnavailable as error:
        unavailable(str(error))
    with cluster:
        assert (Path(cluster.workdir).parent == parent
                and Path(cluster.key).parent == parent / Path(cluster.workdir).name)
        for source in [None, *cluster.hosts]:
            for target in cluster.hosts:
                result = cluster.ssh(target, ["hostname"], from_host=source)
                assert result.returncode == 0, result.stderr
                assert result.stdout.strip() == target.name
    assert not Path(cluster.workdir).exists()


@pytest.mark.timeout(60)
def test_a_refused_login_carries_the_sshd_reason(netns_cluster):
    cluster = netns_cluster
    first, second = cluster.hosts
    authorized = Path(cluster.workdir) / "authorized_keys"
    saved = authorized.read_bytes()
    other_key = Path(cluster.workdir) / "other_id"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other_key)], check=True, timeout=20)
    authorized.write_bytes(Path(f"{other_key}.pub").read_bytes())  # the cluster's key is no longer let in
    try:
        result = cluster.ssh(second, ["true"], from_host=first)
        assert result.returncode == 255
        assert "Permission denied (publickey)" in result.stderr
        assert "--- the cluster's sshd logs say ---" in result.stderr, result.stderr
        assert re.search(r"sshd\.h2\.log: .*(Failed|refused)", result.stderr), result.stderr
        # a launcher's output that says the same gets the same reasons (run_on, start_on)
        assert "sshd.h2.log" in first.explain("root@x: Permission denied (publickey).")
        assert first.explain("all went well") == "all went well"
    finally:
        authorized.write_bytes(saved)
    assert cluster.ssh(second, ["true"], from_host=first).returncode == 0


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
            unavailable(stderr.strip().splitlines()[-1])
        pytest.fail(f"the cluster owner failed: {stderr}")
    return process, line[0], [int(pid) for pid in line[1:]]


@pytest.mark.timeout(30)
def test_sigterm_to_the_owner_tears_the_cluster_down():
    ncl.unavailable_reason() and unavailable(ncl.unavailable_reason())
    process, name, sshd_pids = _owner_process()
    assert ncl.leftovers(name)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=20) == -signal.SIGTERM
    assert ncl.leftovers(name) == []
    assert not any(_alive(pid) for pid in sshd_pids)


@pytest.mark.timeout(30)
def test_cleanup_stale_removes_what_a_killed_owner_left():
    ncl.unavailable_reason() and unavailable(ncl.unavailable_reason())
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
    if ncl.unavailable_reason() is not None:
        unavailable(ncl.unavailable_reason())
    reason = ncl.unavailable_reason(shaping_delay=True)
    if reason:  # only the kernel's netem is missing: a kernel feature, skipped even where a cluster is required
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


COORDINATOR_WHERE = textwrap.dedent("""\
    import torch, ringmaster as rm
    from ringmaster.worker.runtime.current import runtime
    rm.init()
    total = rm.allreduce(torch.tensor([rm.rank() + 1.0]), op=rm.Sum)
    print("RESULT", rm.rank(), runtime().endpoint.address, total.item(), flush=True)
    rm.shutdown()
""")


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_plain_mpirun_across_hosts_puts_the_coordinator_on_ringmaster_network_interface(netns_cluster):
    """Under plain mpirun (no ringrun, so rank 0 starts the coordinator), the coordinator
    listens on RINGMASTER_NETWORK_INTERFACE's address; an interface that does not exist
    fails rm.init() on every rank, naming the variable."""
    from ringmaster.launch.environment import exported_names
    from ringmaster.launch.hosts import Host
    from ringmaster.launch.mpi_command import LaunchSpec, build_command, detect_mpi, find_mpirun

    cluster = netns_cluster
    first, second = cluster.hosts

    def plain_mpirun(interface):
        env = job_environment({"RINGMASTER_NETWORK_INTERFACE": interface})
        spec = LaunchSpec(num_proc=2, hosts=[Host(first.name, 1), Host(second.name, 1)],
                          command=[sys.executable, "-c", COORDINATOR_WHERE], export_names=exported_names(env),
                          network_interface=cluster.interface, ssh_identity_file=cluster.key,
                          run_as_root=os.geteuid() == 0)
        command = build_command(detect_mpi(find_mpirun()), spec)
        assert "RINGMASTER_COORDINATOR_ADDR" not in " ".join(command)
        return run_on(first, command, timeout=50, env=env, cwd=str(ROOT))

    result = plain_mpirun(cluster.interface)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    rows = sorted(line.split()[line.split().index("RESULT") + 1:] for line in result.stdout.splitlines()
                  if "RESULT" in line.split())
    assert [row[0] for row in rows] == ["0", "1"], result.stdout + result.stderr
    assert all(row[1].startswith(f"{first.address}:") and row[2] == "3.0" for row in rows), rows

    result = plain_mpirun("no-such-if0")
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert output.count("RINGMASTER_NETWORK_INTERFACE: network interface 'no-such-if0' does not exist") >= 2, \
        output[-4000:]


# --------------------------------------------------------------- jobs across hosts

MATRIX = ROOT / "tests" / "jobs" / "collectives_matrix.py"
HOLD = ROOT / "tests" / "jobs" / "cluster_hold.py"
DIGITS = ROOT / "examples" / "pytorch_digits.py"
DIGITS_EPOCHS = 2


def ringrun_on_hosts(cluster: ncl.NetnsCluster, hosts, command, *options: str):
    """``ringrun`` with one rank on each of ``hosts`` (through the cluster's key), running ``command``."""
    return [sys.executable, "-m", "ringmaster.launch", "-np", str(len(hosts)), "-H", cluster.hosts_arg(1, hosts),
            "--ssh-identity-file", cluster.key, *options, *command]


def run_job(cluster: ncl.NetnsCluster, command, timeout: float) -> JobResult:
    """Run ``command`` (a ``ringrun`` line) on the first host, as a :class:`JobResult`."""
    done = run_on(cluster.hosts[0], command, timeout=timeout, env=job_environment(), cwd=str(ROOT))
    return JobResult(done.returncode, done.stdout, done.stderr)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("num_hosts,options", [(2, ["--allreduce", "ring", "--network-interface", "eth0"]),
                                               (3, ["--allreduce", "auto"])],
                         ids=["2-hosts-ring", "3-hosts-auto"])
def test_collectives_matrix_across_hosts(netns_cluster_factory, num_hosts, options):
    """tests/jobs/collectives_matrix.py, every collective x dtype x reduction checked against
    the single-process torch reference (as tests/test_collectives.py runs it on one host),
    passes with one rank on each of 2 and 3 hosts."""
    cluster = netns_cluster_factory(num_hosts)
    result = run_job(cluster, ringrun_on_hosts(cluster, cluster.hosts, [sys.executable, str(MATRIX)], *options),
                     timeout=100)
    failures = [line for line in result.lines_starting("") if line.startswith(("FAIL", "got", "expected"))]
    assert not failures, "\n".join(failures[:40])
    done = result.lines_starting("DONE")
    assert len(done) == num_hosts and len(set(done)) == 1 and done[0].endswith(" 0 failures"), result.output[-4000:]
    assert result.returncode == 0, result.output[-4000:]


def digits_command(checkpoint: Path):
    """The training example for a few epochs, rank 0 saving its final state to ``checkpoint``."""
    return [sys.executable, str(DIGITS), "--epochs", str(DIGITS_EPOCHS), "--checkpoint", str(checkpoint)]


@pytest.fixture(scope="module")
def one_host_digits(tmp_path_factory):
    """``run(num_proc)``: examples/pytorch_digits.py on this machine alone (the root namespace),
    once per number of ranks; returns (result, checkpoint path)."""
    runs = {}

    def run(num_proc: int):
        if num_proc not in runs:
            checkpoint = tmp_path_factory.mktemp(f"digits-one-host-{num_proc}") / "digits.pt"
            command = [sys.executable, "-m", "ringmaster.launch", "-np", str(num_proc), "--oversubscribe",
                       *digits_command(checkpoint)]
            result = run_command(command, timeout=80, env=job_environment(), cwd=str(ROOT))
            assert result.returncode == 0, result.output[-3000:]
            runs[num_proc] = (result, checkpoint)
        return runs[num_proc]

    return run


def training_record(stdout: str):
    """Rank 0's loss and test accuracy after each epoch and its final line, without the timings."""
    epochs = re.findall(r"epoch \d+: loss [0-9.]+ +test accuracy [0-9.]+", stdout)
    final = re.findall(r"final test accuracy .*", stdout)
    return epochs, final


def tensor_differences(one, other, path="checkpoint"):
    """Where two checkpoints (nested dicts and lists of tensors and numbers) differ in any bit."""
    if isinstance(one, torch.Tensor):
        same = isinstance(other, torch.Tensor) and one.dtype == other.dtype and torch.equal(one, other)
        return [] if same else [path]
    if isinstance(one, dict):
        if not isinstance(other, dict) or one.keys() != other.keys():
            return [f"{path} (keys)"]
        return [d for key in one for d in tensor_differences(one[key], other[key], f"{path}[{key!r}]")]
    if isinstance(one, (list, tuple)):
        if not isinstance(other, (list, tuple)) or len(one) != len(other):
            return [f"{path} (length)"]
        return [d for i, (a, b) in enumerate(zip(one, other)) for d in tensor_differences(a, b, f"{path}[{i}]")]
    return [] if one == other else [path]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("num_hosts,options", [(2, []), (3, ["--network-interface", "eth0"])],
                         ids=["2-hosts", "3-hosts"])
def test_digits_training_across_hosts_matches_one_host(netns_cluster_factory, one_host_digits, tmp_path,
                                                       num_hosts, options):
    """examples/pytorch_digits.py with one rank on each of 2 and 3 hosts prints the losses and
    accuracies of the same run on one host, and ends with bit-identical weights and momentum."""
    cluster = netns_cluster_factory(num_hosts)
    checkpoint = tmp_path / "digits.pt"
    result = run_job(cluster, ringrun_on_hosts(cluster, cluster.hosts, digits_command(checkpoint),
                                               *options), timeout=80)
    assert result.returncode == 0, result.output[-3000:]
    one_host, one_host_checkpoint = one_host_digits(num_hosts)
    epochs, final = training_record(result.stdout)
    assert len(epochs) == DIGITS_EPOCHS and final and "(max difference 0.0e+00)" in final[0], result.stdout
    assert (epochs, final) == training_record(one_host.stdout), (result.stdout, one_host.stdout)
    assert f"training on {num_hosts} ranks" in result.stdout
    differences = tensor_differences(torch.load(one_host_checkpoint), torch.load(checkpoint))
    assert not differences, f"weights or optimizer state differ from the one-host run at {differences[:10]}"


# --------------------------------------------------------------- failures across hosts

START_TIMEOUT = 8


@pytest.mark.timeout(60)
@pytest.mark.parametrize("failure", ["stopped", "hung"])
def test_host_without_a_working_sshd_fails_the_launch_within_the_start_timeout(netns_cluster, failure):
    """Host 2's sshd is gone (connection refused) or hangs (accepts, never answers): ringrun
    ends within ``--start-timeout`` with Open MPI's and ssh's messages naming host 2, and
    leaves nothing running. The hung case needs ssh's ConnectTimeout, which ringrun sets from
    ``--start-timeout``; without it the launch waits forever."""
    cluster = netns_cluster
    first, second = cluster.hosts
    if failure == "stopped":
        second.sshd.kill()
        second.sshd.wait()
    else:
        second.sshd.send_signal(signal.SIGSTOP)
    command = ringrun_on_hosts(cluster, cluster.hosts, [sys.executable, "-c", "import ringmaster as rm; rm.init()"],
                               "--start-timeout", str(START_TIMEOUT))
    started = time.monotonic()
    try:
        result = run_job(cluster, command, timeout=START_TIMEOUT + 30)
    finally:
        if failure == "hung":
            second.sshd.send_signal(signal.SIGCONT)
    elapsed = time.monotonic() - started
    assert result.returncode != 0, result.output
    # the bound is the timeout itself plus ringrun's own start and teardown
    assert elapsed < START_TIMEOUT + 5, f"ringrun took {elapsed:.1f} s with --start-timeout {START_TIMEOUT}"
    assert re.search(rf"Remote host:\s+{re.escape(second.name)}\b", result.output), result.output
    ssh_says = (f"connect to host {second.name} port 22: Connection refused" if failure == "stopped"
                else f"Connection to {second.address} port 22 timed out")
    assert ssh_says in result.output, result.output
    assert wait_for_no_processes(cluster) == {}


@pytest.mark.timeout(90)
def test_killing_a_rank_on_the_second_host_ends_the_job(netns_cluster, tmp_path):
    """SIGKILL of rank 1's python process on host 2, from inside host 2: the job ends within
    30 s, the coordinator's message names rank 1, host 2 and the pid, and no process of the
    job is left on any host."""
    cluster = netns_cluster
    first, second = cluster.hosts
    command = ringrun_on_hosts(cluster, cluster.hosts, [sys.executable, str(HOLD), str(tmp_path / "stop"), "60"],
                               "--network-interface", cluster.interface)
    with start_on(first, command, env=job_environment(), cwd=str(ROOT)) as job:
        ready = {int(m[1]): (m[2], int(m[3]))
                 for m in job.wait_for_matches(r"READY (\d+) (\S+) (\d+)", count=2, timeout=40)}
        host, pid = ready[1]
        assert host == second.name and pid in second.processes(), (ready, second.processes())
        killed_at = time.monotonic()
        second.run([sys.executable, "-c", f"import os, signal; os.kill({pid}, signal.SIGKILL)"], check=True)
        returncode = job.wait(timeout=30)
        elapsed = time.monotonic() - killed_at
    assert returncode != 0, job.output
    assert elapsed < 30, f"the job took {elapsed:.1f} s to end after rank 1 was killed"
    assert f"rank 1 (host {second.name}, pid {pid})" in job.output, job.output
    assert wait_for_no_processes(cluster) == {}


TOKEN_CLIENT = textwrap.dedent("""\
    import os, sys, grpc
    from ringmaster.proto.auth import call_metadata
    from ringmaster.proto import ringmaster_pb2 as pb, ringmaster_pb2_grpc as pb_grpc
    stub = pb_grpc.CoordinatorStub(grpc.insecure_channel(sys.argv[1]))
    tokens = {"no": None, "wrong": call_metadata("0" * 64), "right": call_metadata(os.environ["JOB_TOKEN"])}

    def ping(metadata):
        stub.Ping(pb.Empty(), metadata=metadata, timeout=10)

    def register(metadata):  # what a rank sends first: a stranger posing as rank 1
        hello = pb.RankMessage(register=pb.Register(rank=1, size=2, hostname="stranger", pid=1))
        for message in stub.Negotiate(iter([hello]), metadata=metadata, timeout=10):
            print("ANSWERED", message.WhichOneof("kind"), flush=True)

    for call, token in (("Ping", "no"), ("Ping", "wrong"), ("Negotiate", "no"), ("Negotiate", "wrong"),
                        ("Ping", "right")):
        try:
            {"Ping": ping, "Negotiate": register}[call](tokens[token])
            print("CALL", call, token, "OK", flush=True)
        except grpc.RpcError as error:
            print("CALL", call, token, error.code().name, error.details(), flush=True)
""")


def process_environment(pid: int) -> dict:
    with open(f"/proc/{pid}/environ", "rb") as handle:
        entries = handle.read().decode(errors="replace").split("\0")
    return dict(entry.split("=", 1) for entry in entries if "=" in entry)


@pytest.mark.timeout(90)
def test_coordinator_refuses_calls_from_another_host_without_the_token(netns_cluster, tmp_path):
    """With the coordinator on host 1, a gRPC client on host 2 that dials the address the ranks
    were given is refused (UNAUTHENTICATED) without the job's token or with a wrong one, for
    Ping and for registering as a rank; with the token it gets through. The job goes on and
    ends cleanly, and the token appears in no output."""
    cluster = netns_cluster
    first, second = cluster.hosts
    stop = tmp_path / "stop"
    command = ringrun_on_hosts(cluster, cluster.hosts, [sys.executable, str(HOLD), str(stop), "60"],
                               "--network-interface", cluster.interface)
    with start_on(first, command, env=job_environment(), cwd=str(ROOT)) as job:
        ready = {int(m[1]): int(m[3]) for m in job.wait_for_matches(r"READY (\d+) (\S+) (\d+)", count=2, timeout=40)}
        environ = process_environment(ready[1])  # what rank 1 on host 2 was given
        address, token = environ["RINGMASTER_COORDINATOR_ADDR"], environ["RINGMASTER_SECRET"]
        assert address.rsplit(":", 1)[0] == first.address, address
        client = second.run([sys.executable, "-c", TOKEN_CLIENT, address], timeout=40,
                            env=job_environment({"JOB_TOKEN": token}), cwd=str(ROOT))
        stop.touch()
        returncode = job.wait(timeout=30)
    calls = {tuple(line.split()[1:3]): line.split()[3:] for line in client.stdout.splitlines()
             if line.startswith("CALL")}
    assert len(calls) == 5, client.stdout + client.stderr
    for call, token_kind in (("Ping", "no"), ("Ping", "wrong"), ("Negotiate", "no"), ("Negotiate", "wrong")):
        code, *details = calls[call, token_kind]
        assert code == "UNAUTHENTICATED", (call, token_kind, client.stdout)
        assert "missing or wrong ringmaster job token" in " ".join(details)
    assert calls["Ping", "right"] == ["OK"], client.stdout
    assert "ANSWERED" not in client.stdout
    assert returncode == 0, job.output
    assert token not in job.output and token not in client.stdout + client.stderr


# --------------------------------------------------------------- ssh options

def test_ssh_options_are_words_open_mpi_passes_on_intact():
    """Open MPI splits plm_ssh_args at spaces and forwards it to tree-spawned daemons cut at the
    first '=': each option ringrun builds must be one word without '=' (ssh reads a tab as '=')."""
    from ringmaster.launch.mpi_command import ssh_arguments
    words = ssh_arguments(2222, "/k/id", 7.5).split(" ")
    assert words == ["-p", "2222", "-i", "/k/id", "-o", "StrictHostKeyChecking\tno", "-o", "ConnectTimeout\t8"]
    assert not any("=" in word for word in words)


@pytest.mark.timeout(60)
def test_ssh_options_survive_open_mpi_tree_spawn(netns_cluster_factory):
    """With routed_radix 1, Open MPI's daemon on host 2 starts the one on host 3 with the ssh
    options it was handed. ringrun's ``-o StrictHostKeyChecking=no`` used to reach it as
    ``-o StrictHostKeyChecking`` (ssh: no argument), and the job failed without a word."""
    from ringmaster.launch.mpi_command import OPENMPI, detect_mpi, find_mpirun
    mpi = detect_mpi(find_mpirun())
    if mpi.kind != OPENMPI or mpi.version[:1] < (5,):
        pytest.skip(f"tree spawn is checked with Open MPI 5's --prtemca (this is {mpi.kind} {mpi.version})")
    cluster = netns_cluster_factory(3)
    mpi_args = "--prtemca routed_radix 1 --prtemca plm_base_verbose 5"
    hostname = [sys.executable, "-c", "import socket; print('ON', socket.gethostname())"]
    command = ringrun_on_hosts(cluster, cluster.hosts, hostname, "--start-timeout", "20", f"--mpi-args={mpi_args}")
    result = run_job(cluster, command, timeout=50)
    assert result.returncode == 0, result.output[-4000:]
    assert sorted(result.lines_starting("ON")) == [host.name for host in cluster.hosts], result.output[-4000:]
    # the launch really was a tree: host 3's daemon was not started by mpirun itself
    assert "not a child of mine" in result.stderr and "--tree-spawn" in result.stderr, result.stderr[-4000:]
