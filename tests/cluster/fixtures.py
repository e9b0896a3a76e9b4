"""pytest fixtures for the network-namespace cluster (import them into a test module).

    from cluster.fixtures import netns_cluster, netns_cluster_factory  # noqa: F401

``netns_cluster``: a 2-host cluster for one test. ``netns_cluster_factory(num_hosts=..., rate=...,
delay=...)``: clusters of any shape, all torn down after the test (the first use in a process
also removes what crashed earlier runs left, see ``cleanup_stale``). Both skip the test, with the
reason, where no cluster can be built here (not root, no ``ip netns``, no sshd, no netem for a
delay); after a test, whether it passed or failed, nothing of its clusters is left.

:func:`run_on` runs a command (e.g. ``ringrun``) on a cluster host, bounded in time, and kills
its process group if it overruns; whatever it started on other hosts goes with the cluster.
"""

from __future__ import annotations

import os
import signal
import subprocess
from typing import List, Mapping, Optional, Sequence

import pytest

from .netns_cluster import ClusterUnavailable, Host, NetnsCluster, cleanup_stale, unavailable_reason

_STALE_CLEANED = [False]


@pytest.fixture
def netns_cluster_factory():
    clusters: List[NetnsCluster] = []

    def make(num_hosts: int = 2, rate=None, delay=None) -> NetnsCluster:
        if not _STALE_CLEANED[0] and unavailable_reason() is None:
            _STALE_CLEANED[0] = True
            cleanup_stale()  # what crashed earlier runs left (clusters whose owner is gone)
        cluster = NetnsCluster(num_hosts, rate=rate, delay=delay)
        try:
            cluster.start()
        except ClusterUnavailable as error:
            pytest.skip(str(error))
        clusters.append(cluster)
        return cluster

    yield make
    for cluster in clusters:
        cluster.close()


@pytest.fixture
def netns_cluster(netns_cluster_factory) -> NetnsCluster:
    return netns_cluster_factory(2)


def run_on(host: Host, command: Sequence[str], timeout: float, env: Optional[Mapping[str, str]] = None,
           cwd: Optional[str] = None) -> subprocess.CompletedProcess:
    """Run ``command`` on ``host`` in its own process group, capturing text output; on
    timeout kill the group and fail with what it printed."""
    process = subprocess.Popen(host.command(command), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               stdin=subprocess.DEVNULL, text=True, env=env, cwd=cwd, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(process)
        stdout, stderr = process.communicate()
        pytest.fail(f"did not finish within {timeout} s on {host.name}: {' '.join(command)}\n"
                    f"--- stdout ---\n{stdout}\n--- stderr ---\n{stderr}")
    finally:
        if process.poll() is None:
            _kill_group(process)
            process.wait()
    _kill_group(process)  # stray children (a coordinator, prterun) of a finished command
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
