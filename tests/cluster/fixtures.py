"""pytest fixtures for the network-namespace cluster (import them into a test module).

    from cluster.fixtures import netns_cluster, netns_cluster_factory  # noqa: F401

``netns_cluster``: a 2-host cluster for one test. ``netns_cluster_factory(num_hosts=..., rate=...,
delay=...)``: clusters of any shape, all torn down after the test (the first use in a process
also removes what crashed earlier runs left, see ``cleanup_stale``). Both skip the test, with the
reason, where no cluster can be built here (not root, no ``ip netns``, no sshd), or fail it where
``RINGMASTER_REQUIRE_CLUSTER=1`` (CI); a cluster with a link delay where only the kernel's netem
is missing skips in either case. After a test, whether it passed or failed, nothing of its
clusters is left.

:func:`run_on` runs a command (e.g. ``ringrun``) on a cluster host, bounded in time, and kills
its process group if it overruns; whatever it started on other hosts goes with the cluster.
:func:`start_on` starts one in the background (a :class:`RunningCommand`, for tests that act on
a job while it runs), and :func:`wait_for_no_processes` waits until nothing but the sshd
listeners runs on the cluster's hosts.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from typing import Dict, List, Mapping, Optional, Sequence

import pytest
from mpijob import stop_hung_job

from .netns_cluster import ClusterUnavailable, Host, NetnsCluster, cleanup_stale, unavailable_reason

_STALE_CLEANED = [False]
#: Set (to 1) where a cluster is required (CI, in .ci/run): then a cluster that cannot be built
#: fails the test instead of skipping it, as tests/cluster/setup.sh fails.
REQUIRE = "RINGMASTER_REQUIRE_CLUSTER"


def unavailable(reason: str) -> None:
    """No cluster here: skip the test with ``reason``, or fail it where one is required."""
    if os.environ.get(REQUIRE) == "1":
        pytest.fail(f"{REQUIRE}=1 and no cluster can be built: {reason}", pytrace=False)
    pytest.skip(reason)


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
            if delay is not None and unavailable_reason() is None:
                # A cluster can be built; only the kernel's netem (link delay) is missing: a
                # kernel feature, not a broken set-up, so it skips even where one is required.
                pytest.skip(str(error))
            unavailable(str(error))
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
        stdout, stderr = stop_hung_job(process)  # the ranks print their stacks first
        pytest.fail(f"did not finish within {timeout} s on {host.name}: {' '.join(command)}\n"
                    f"--- stdout ---\n{stdout}\n--- stderr ---\n{stderr}")
    finally:
        if process.poll() is None:
            _kill_group(process)
            process.wait()
    _kill_group(process)  # stray children (a coordinator, prterun) of a finished command
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, host.explain(stderr))


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class RunningCommand:
    """A command started on a cluster host in its own process group; its output is collected
    as it arrives. Use it as a context manager: on exit the group is killed if still running."""

    def __init__(self, host: Host, command: Sequence[str], env: Optional[Mapping[str, str]] = None,
                 cwd: Optional[str] = None):
        self.host = host
        self.command = list(command)
        self.process = subprocess.Popen(host.command(command), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        stdin=subprocess.DEVNULL, text=True, env=env, cwd=cwd,
                                        start_new_session=True)
        self._streams: Dict[str, List[str]] = {"stdout": [], "stderr": []}
        self._changed = threading.Condition()
        self._readers = [threading.Thread(target=self._read, args=(pipe, name), daemon=True)
                         for pipe, name in ((self.process.stdout, "stdout"), (self.process.stderr, "stderr"))]
        for reader in self._readers:
            reader.start()

    def _read(self, pipe, name: str) -> None:
        for line in pipe:
            with self._changed:
                self._streams[name].append(line)
                self._changed.notify_all()

    @property
    def stdout(self) -> str:
        with self._changed:
            return "".join(self._streams["stdout"])

    @property
    def output(self) -> str:
        """Everything it printed so far, stdout then stderr (with the cluster's sshd reasons
        appended where it says a login was denied)."""
        with self._changed:
            return self.host.explain("".join(self._streams["stdout"]) + "".join(self._streams["stderr"]))

    def wait_for_matches(self, pattern: str, count: int, timeout: float) -> List["re.Match"]:
        """The first ``count`` stdout lines matching ``pattern`` (``re.search``); fails the test
        with the output if they do not all come within ``timeout`` s or the command ends first."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                matches = [m for m in map(regex.search, self._streams["stdout"]) if m]
                if len(matches) >= count:
                    return matches[:count]
                if self.process.poll() is not None and not any(r.is_alive() for r in self._readers):
                    break
                if time.monotonic() > deadline:
                    break
                self._changed.wait(0.1)
        pytest.fail(f"{count} lines matching {pattern!r} did not come within {timeout} s on {self.host.name} "
                    f"(exit status {self.process.poll()}):\n{self.output}")

    def wait(self, timeout: float) -> int:
        """Its exit status; fails the test (after killing the group) if it runs longer than ``timeout`` s."""
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"did not finish within {timeout} s on {self.host.name}: {' '.join(self.command)}\n"
                        f"{self.output}")
        for reader in self._readers:
            reader.join(timeout=5)
        return self.process.returncode

    def kill(self) -> None:
        """SIGKILL its process group (what it started on other hosts goes with the cluster)."""
        _kill_group(self.process)
        self.process.wait()

    def __enter__(self) -> "RunningCommand":
        return self

    def __exit__(self, *exc) -> None:
        if self.process.poll() is None:
            self.kill()
        _kill_group(self.process)  # stray children (a coordinator, prterun) of a finished command


def start_on(host: Host, command: Sequence[str], env: Optional[Mapping[str, str]] = None,
             cwd: Optional[str] = None) -> RunningCommand:
    """Start ``command`` on ``host`` in the background (see :class:`RunningCommand`)."""
    return RunningCommand(host, command, env=env, cwd=cwd)


def wait_for_no_processes(cluster: NetnsCluster, timeout: float = 10.0) -> Dict[str, Dict[int, str]]:
    """Wait until only the sshd listeners run on the cluster's hosts; return what is still
    running then (``{host name: {pid: command line}}``, empty when nothing is)."""
    deadline = time.monotonic() + timeout
    while True:
        left = {host.name: procs for host in cluster.hosts if (procs := host.processes())}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)
