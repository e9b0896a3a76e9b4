"""The hierarchical allreduce in real jobs across network-namespace hosts (tests/cluster/).

Two hosts of two ranks each, ``ringrun --hierarchical-allreduce``: big allreduces, in and
out of place, and DistributedOptimizer's gradient plan give what a one-process reference
computes, and they went through the hosts' communicators; uneven hosts are refused at
``init()`` with the reason. Skips where no cluster can be built, as tests/test_cluster.py does.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
from mpijob import job_environment

from cluster.fixtures import netns_cluster, netns_cluster_factory, run_on  # noqa: F401

ROOT = Path(__file__).resolve().parent.parent

JOB = textwrap.dedent("""\
    import torch, ringmaster as rm
    from torch import nn
    from ringmaster.worker.runtime.current import runtime
    rm.init()
    rank, size = rm.rank(), rm.size()
    failures = []
    big = torch.full((1 << 20,), float(rank + 1))                      # 4 MiB: the ring, so the hosts
    total = float(sum(range(1, size + 1)))
    if not torch.equal(rm.allreduce(big, op=rm.Sum, name="big.sum"), torch.full((1 << 20,), total)):
        failures.append("big sum")
    again = big.clone()
    rm.allreduce_(again, name="big.average")                           # twice: cached the second time
    rm.allreduce_(big.clone(), name="big.average")
    if not torch.allclose(again, torch.full((1 << 20,), total / size)):
        failures.append("big average in place")

    def inputs(r):
        generator = torch.Generator().manual_seed(r)
        return torch.randn(8, 600, generator=generator)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(600, 600), nn.ReLU(), nn.Linear(600, 10))  # 1.4 MB: a bucket of its own
    reference = nn.Sequential(nn.Linear(600, 600), nn.ReLU(), nn.Linear(600, 10))
    reference.load_state_dict(model.state_dict())
    optimizer = rm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                        named_parameters=model.named_parameters())
    plain = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        optimizer.zero_grad()
        model(inputs(rank)).square().mean().backward()
        optimizer.step()
        plain.zero_grad()
        (sum(reference(inputs(r)).square().mean() for r in range(size)) / size).backward()
        plain.step()
    worst = max((a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters()))
    if worst > 1e-5:
        failures.append(f"training differs from the reference by {worst}")
    plan = optimizer._plan
    used = (bool(runtime().executor._devices.host.hierarchies) and plan is not None
            and plan.transport.name == "hierarchical")
    if not used:
        failures.append("the hosts' communicators were not used")
    print("RESULT", rank, rm.local_size(), rm.cross_size(), "ok" if not failures else "; ".join(failures),
          flush=True)
    rm.shutdown()
""")


def ringrun_on_cluster(cluster, slots: str, timeout: float):
    first = cluster.hosts[0]
    command = [sys.executable, "-m", "ringmaster.launch", "-np", str(sum(int(s) for s in slots.split(","))),
               "-H", ",".join(f"{host.name}:{count}" for host, count in zip(cluster.hosts, slots.split(","))),
               "--ssh-identity-file", cluster.key, "--network-interface", cluster.interface,
               "--hierarchical-allreduce", "--start-timeout", "30", sys.executable, "-c", JOB]
    return run_on(first, command, timeout=timeout, env=job_environment(), cwd=str(ROOT))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_two_hosts_of_two_ranks_reduce_through_the_hosts(netns_cluster):
    result = ringrun_on_cluster(netns_cluster, "2,2", timeout=110)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    rows = [line.split()[line.split().index("RESULT") + 1:] for line in result.stdout.splitlines()
            if "RESULT" in line.split()]
    assert len(rows) == 4, result.stdout + result.stderr
    for rank, local_size, cross_size, *verdict in rows:
        assert (local_size, cross_size) == ("2", "2")
        assert verdict == ["ok"], f"rank {rank}: {' '.join(verdict)}"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_uneven_hosts_are_refused_with_the_reason(netns_cluster):
    result = ringrun_on_cluster(netns_cluster, "2,1", timeout=110)
    assert result.returncode != 0
    assert "RINGMASTER_HIERARCHICAL_ALLREDUCE=1 needs as many ranks on every host" in result.stdout + result.stderr, \
        result.stdout + result.stderr
