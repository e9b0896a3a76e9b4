"""The Kubernetes recipe (docs/kubernetes.md, examples/kubernetes/), as far as it runs without Kubernetes.

No Kubernetes runs here. Checked instead: the MPIJob manifests are well-formed and their
launcher's command is one ringrun accepts, with a hostfile in the MPI Operator's format; and
the SSH-less launch itself, on the network-namespace cluster (tests/cluster/): ringrun on one
host ("the launcher pod") starts both ranks on the other host ("the worker pod") through
examples/kubernetes/kubexec.sh as Open MPI's remote agent, without the cluster's ssh key, with a
stand-in ``kubectl`` whose ``exec POD -- CMD`` runs CMD on the namespace host named POD
(where a real one would ask the Kubernetes API).
"""

from __future__ import annotations

import os
import shlex
import stat
import sys
import textwrap
from pathlib import Path

import pytest
from mpijob import job_environment

from cluster.fixtures import netns_cluster, netns_cluster_factory, run_on  # noqa: F401
from ringmaster.launch.cli import parse_args
from ringmaster.launch.hosts import Host, parse_hostfile

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "examples" / "kubernetes"
KUBEXEC = RECIPE / "kubexec.sh"


def _manifests(name: str) -> dict:
    yaml = pytest.importorskip("yaml")  # PyYAML comes with the lightning extra of .[test]
    return {document["kind"]: document for document in yaml.safe_load_all((RECIPE / name).read_text())}


def _container(job: dict, replica: str) -> dict:
    (container,) = job["spec"]["mpiReplicaSpecs"][replica]["template"]["spec"]["containers"]
    return container


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", ["mpijob.yaml", "mpijob-kubexec.yaml"])
def test_mpijob_launchers_run_ringrun_on_the_operators_hostfile(name, tmp_path):
    """Both manifests: a v2beta1 MPIJob whose launcher runs ringrun on /etc/mpi/hostfile (in the
    operator's format) and the example; the SSH-less one with kubexec.sh and the rights it needs."""
    documents = _manifests(name)
    job = documents["MPIJob"]
    assert job["apiVersion"] == "kubeflow.org/v2beta1"
    assert job["spec"]["mpiImplementation"] == "OpenMPI"
    assert job["spec"]["launcherCreationPolicy"] == "WaitForWorkersReady"
    command = _container(job, "Launcher")["command"]
    assert command[0] == "ringrun"
    args = parse_args(command[1:])
    assert args.hostfile == "/etc/mpi/hostfile"
    assert args.command[:2] == ["python", "examples/lightning_digits.py"]
    assert (ROOT / args.command[1]).is_file()
    # The operator's hostfile: each worker pod with slotsPerWorker ranks.
    slots, job_name = job["spec"]["slotsPerWorker"], job["metadata"]["name"]
    replicas = job["spec"]["mpiReplicaSpecs"]["Worker"]["replicas"]
    workers = [f"{job_name}-worker-{i}.{job_name}.default.svc" for i in range(replicas)]
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(f"{worker} slots={slots}\n" for worker in workers))
    assert parse_hostfile(str(hostfile)) == [Host(worker, slots) for worker in workers]
    worker = _container(job, "Worker")["command"]
    if name == "mpijob.yaml":
        assert worker[0] == "/usr/sbin/sshd"
    else:
        assert worker == ["sleep", "infinity"]
        mpi_args = shlex.split(args.mpi_args)
        assert mpi_args == ["--mca", "plm_ssh_agent", "/usr/local/bin/kubexec.sh",
                            "--mca", "plm_ssh_no_tree_spawn", "1"]
        assert "/usr/local/bin/kubexec.sh" in (RECIPE / "Dockerfile").read_text()
        spec = job["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]
        assert spec["serviceAccountName"] == documents["ServiceAccount"]["metadata"]["name"]
        rules = {(resource, verb) for rule in documents["Role"]["rules"] for resource in rule["resources"]
                 for verb in rule["verbs"]}
        assert {("pods/exec", "create"), ("pods", "get"), ("pods", "watch")} <= rules


RANKS = textwrap.dedent("""\
    import socket, torch, ringmaster as rm
    rm.init()
    total = rm.allreduce(torch.tensor([rm.rank() + 1.0]), op=rm.Sum)
    print("RESULT", rm.rank(), socket.gethostname(), total.item(), flush=True)
    rm.shutdown()
""")


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_kubexec_agent_starts_the_ranks_without_ssh(netns_cluster, tmp_path):
    """ringrun on the "launcher" host, both ranks on the "worker" host, started through kubexec.sh."""
    cluster = netns_cluster
    launcher, worker = cluster.hosts
    calls = tmp_path / "kubectl.calls"
    # kubectl's stand-in: `wait` succeeds, `exec [--namespace=NS] POD -- CMD...` runs CMD on host POD.
    kubectl = tmp_path / "bin" / "kubectl"
    kubectl.parent.mkdir()
    kubectl.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        echo "$@" >> {calls}
        [ "$1" = wait ] && exit 0
        shift
        while [ "$1" != -- ]; do case "$1" in --namespace=*) ;; *) pod=$1 ;; esac; shift; done
        shift
        [ "$pod" = {worker.name} ] || {{ echo "kubectl stand-in: no pod $pod" >&2; exit 1; }}
        exec {shlex.join(worker.command([]))} "$@"
    """))
    kubectl.chmod(kubectl.stat().st_mode | stat.S_IXUSR)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(f"{worker.name} slots=2\n")
    env = job_environment({"PATH": f"{kubectl.parent}{os.pathsep}{os.environ['PATH']}"})
    command = [sys.executable, "-m", "ringmaster.launch", "--hostfile", str(hostfile), "--start-timeout", "40",
               f"--mpi-args=--mca plm_ssh_agent {KUBEXEC} --mca plm_ssh_no_tree_spawn 1",
               sys.executable, "-c", RANKS]
    result = run_on(launcher, command, timeout=80, env=env, cwd=str(ROOT))
    output = f"{result.stdout}\n{result.stderr}"
    assert result.returncode == 0, output[-4000:]
    rows = sorted(line.split()[line.split().index("RESULT") + 1:] for line in result.stdout.splitlines()
                  if "RESULT" in line.split())
    # Both ranks ran on the worker host, reached the coordinator on the launcher host, and reduced.
    assert rows == [["0", worker.name, "3.0"], ["1", worker.name, "3.0"]], output[-4000:]
    # Open MPI went through kubexec.sh: it waited for the pod, then exec'd its daemon there.
    lines = calls.read_text().splitlines()
    assert lines[0].startswith(f"wait --for=condition=Ready pod/{worker.name} "), lines
    assert lines[1].startswith(f"exec {worker.name} -- /bin/sh -c ") and "prted" in lines[1], lines
