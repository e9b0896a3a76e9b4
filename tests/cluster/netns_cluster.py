"""A test cluster of K "hosts" on this one machine: Linux network namespaces with sshd.

Each host is a network namespace joined by a veth pair to a bridge in the root namespace,
with its own IPv4 address on a private /24 not otherwise routed here, its own hostname (its
own UTS namespace: Open MPI tells nodes apart by hostname, and two hosts sharing one would
be taken for one node), loopback up, and an ``sshd`` listening on port 22 inside it that
lets ``root`` in with the cluster's key only. Names resolve through ``/etc/hosts`` lines,
and ssh trusts the cluster's host key through ``/etc/ssh/ssh_known_hosts`` lines, both
between marker comments naming the cluster, so that a plain ``ssh -i KEY root@HOST`` (and
the ssh that ``mpirun`` runs) neither prompts nor writes ``~/.ssh/known_hosts``.

Where the job starts: run the launcher (``ringrun``/``mpirun``) *inside the first host*
(``cluster.hosts[0].command([...])``), so that every rank, rank 0 and the coordinator
included, runs on a cluster host and reaches the others over the cluster network, as on a
real cluster where one logs into a node and launches from there. The root namespace also
reaches every host (the bridge has the subnet's ``.1``), for ssh and checks from outside.

Inside every host, the cluster link has the same name, :data:`INTERFACE` (``eth0``), so
``--network-interface eth0`` means the same network on all hosts.

Shaped links: ``rate`` (``tc`` ``tbf``, e.g. ``"1gbit"``) and ``delay`` (``tc`` ``netem``,
e.g. ``"0.1ms"``) are applied to both ends of each host's veth, i.e. to each direction of
the host's link. A packet between two hosts crosses two links, so it is limited by the
slower of the two rates and delayed by the two links' delays (one way); a round trip pays
four. ``delay`` needs the kernel's ``sch_netem``; without it :class:`ClusterUnavailable` is
raised naming that.

Everything is removed again by :meth:`NetnsCluster.close` (also called on ``with`` exit,
at interpreter exit, and on SIGTERM/SIGHUP when no other handler was set), which is
idempotent and removes only what this cluster created: its processes (everything running
in its namespaces: sshd, and the sessions, daemons and ranks started over ssh), veths,
bridge, namespaces, its ``/etc/hosts`` and ``ssh_known_hosts`` lines, and its temporary
directory; with the last cluster also ``/run/sshd`` (sshd's privilege-separation
directory) and ``/run/netns`` (``ip netns``'s), where clusters made them.
``python tests/cluster/netns_cluster.py cleanup-stale`` (and the pytest fixtures, once per
run) removes what crashed runs left behind: clusters whose owning process is gone.

Needs root, ``ip`` with ``ip netns``, ``nsenter``, ``tc`` (for shaping), ``ssh``,
``ssh-keygen`` and ``/usr/sbin/sshd`` (Debian's openssh-server; ``tests/cluster/setup.sh``
installs it). :func:`unavailable_reason` says what is missing; :class:`NetnsCluster`
raises :class:`ClusterUnavailable` with that reason, and the pytest fixtures skip with it.

Command line (as root)::

    python tests/cluster/netns_cluster.py up -n 2 [--rate 1gbit] [--delay 0.1ms]
    python tests/cluster/netns_cluster.py cleanup-stale [--all]
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import fcntl
import ipaddress
import json
import os
import random
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Union

#: Every object a cluster creates is named ``rmc`` + 6 hex digits (the cluster id) + a suffix.
PREFIX = "rmc"
_ID_RE = re.compile(rf"^{PREFIX}([0-9a-f]{{6}})")
#: Marker comments around the cluster's lines in /etc/hosts and ssh_known_hosts.
MARKER = "ringmaster-netns-cluster"
#: The name of the cluster link inside every host.
INTERFACE = "eth0"
HOSTS_FILE = "/etc/hosts"
KNOWN_HOSTS_FILE = "/etc/ssh/ssh_known_hosts"
SSHD = "/usr/sbin/sshd"
#: The cluster subnets are /24s taken from here (checked against every route and address).
SUPERNET = ipaddress.ip_network("10.213.0.0/16")
STATE_DIR_PREFIX = "ringmaster-cluster-"
SSHD_PRIVSEP_DIR = "/run/sshd"
PRIVSEP_MARKER = os.path.join(SSHD_PRIVSEP_DIR, f".{MARKER}")
#: Where ``ip netns add`` keeps namespaces; it creates the directory (a bind mount on itself).
NETNS_DIR = "/run/netns"


class ClusterUnavailable(RuntimeError):
    """The cluster cannot be built on this machine; ``str()`` says why (for a skip)."""


class ClusterError(RuntimeError):
    """Building or using the cluster failed although the machine supports it."""


# --------------------------------------------------------------------------- helpers

def _run(argv: Sequence[str], check: bool = True, timeout: float = 30,
         input: Optional[str] = None) -> subprocess.CompletedProcess:
    result = subprocess.run(list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            timeout=timeout, input=input, stdin=None if input is not None else subprocess.DEVNULL)
    if check and result.returncode != 0:
        raise ClusterError(f"`{shlex.join(argv)}` failed ({result.returncode}): "
                           f"{(result.stderr or result.stdout).strip()}")
    return result


def _quiet(argv: Sequence[str], timeout: float = 30) -> bool:
    """Run a teardown step; True if it succeeded. Never raises."""
    try:
        return subprocess.run(list(argv), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              stdin=subprocess.DEVNULL, timeout=timeout).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


_REASON: Optional[List[Optional[str]]] = None
_REASON_LOCK = threading.Lock()


def unavailable_reason(shaping_delay: bool = False) -> Optional[str]:
    """Why a cluster cannot be built here, or ``None`` when it can.

    Checks root, the tools, that sshd is installed, and that network namespaces, bridges
    and veth pairs can actually be created (a probe namespace is created and removed).
    With ``shaping_delay``, also that ``tc``'s ``netem`` qdisc exists.
    """
    global _REASON
    with _REASON_LOCK:
        if _REASON is None:
            _REASON = [_basic_reason()]
        reason = _REASON[0]
    if reason is None and shaping_delay:
        return _netem_reason()
    return reason


def _basic_reason() -> Optional[str]:
    if not sys.platform.startswith("linux"):
        return f"network-namespace cluster needs Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return "network-namespace cluster needs root (creates namespaces, links, /etc/hosts lines)"
    for tool in ("ip", "nsenter", "tc", "ssh", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"network-namespace cluster needs `{tool}` on PATH"
    if not os.access(SSHD, os.X_OK):
        return (f"network-namespace cluster needs {SSHD} (Debian's openssh-server; "
                f"run tests/cluster/setup.sh as root to install it)")
    if not os.access(HOSTS_FILE, os.W_OK):
        return f"network-namespace cluster needs a writable {HOSTS_FILE}"
    if _NETNS_DIR_EXISTED[0] is None:
        _NETNS_DIR_EXISTED[0] = os.path.isdir(NETNS_DIR)
    probe = f"{PREFIX}{secrets.token_hex(3)}pr"
    try:
        steps = [
            (["ip", "netns", "add", probe], "ip netns add"),
            (["ip", "link", "add", probe + "b", "type", "bridge"], "ip link add type bridge"),
            (["ip", "link", "add", probe + "v", "type", "veth", "peer", "name", INTERFACE,
              "netns", probe], "ip link add type veth"),
        ]
        for argv, what in steps:
            try:
                result = _run(argv, check=False)
            except (OSError, subprocess.SubprocessError) as error:
                return f"network-namespace cluster: `{what}` cannot run here: {error}"
            if result.returncode != 0:
                return (f"network-namespace cluster: `{what}` is not possible here: "
                        f"{(result.stderr or result.stdout).strip()}")
    finally:
        _quiet(["ip", "link", "del", probe + "v"])
        _quiet(["ip", "link", "del", probe + "b"])
        _quiet(["ip", "netns", "del", probe])
        if not _LIVE:
            _remove_system_dirs(_NETNS_DIR_EXISTED[0] is False)
    return None


_NETEM: Optional[List[Optional[str]]] = None


def _netem_reason() -> Optional[str]:
    """Whether ``tc qdisc ... netem`` works (a probe on a throwaway veth pair)."""
    global _NETEM
    if _NETEM is None:
        probe = f"{PREFIX}{secrets.token_hex(3)}nq"
        try:
            _run(["ip", "link", "add", probe, "type", "veth", "peer", "name", probe + "p"])
            result = _run(["tc", "qdisc", "add", "dev", probe, "root", "netem", "delay", "1ms"], check=False)
            _NETEM = [None if result.returncode == 0 else
                      f"link delay needs tc's netem qdisc (sch_netem), which this kernel lacks: "
                      f"{result.stderr.strip()}"]
        except ClusterError as error:
            _NETEM = [f"cannot probe for netem: {error}"]
        finally:
            _quiet(["ip", "link", "del", probe])
    return _NETEM[0]


def _process_start_time(pid: int) -> Optional[str]:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as handle:
            return handle.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


@contextlib.contextmanager
def _locked(path: str, mode: str = "r+"):
    """Open ``path`` and hold an exclusive flock on it (serialises clusters editing it)."""
    with open(path, mode, encoding="utf-8") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield handle
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _begin(cluster_id: str) -> str:
    return f"# BEGIN {MARKER} {cluster_id} (removed when the test cluster is torn down)"


def _end(cluster_id: str) -> str:
    return f"# END {MARKER} {cluster_id}"


_BLOCK_RE = re.compile(rf"^# (BEGIN|END) {MARKER} ({PREFIX}[0-9a-f]{{6}})\b")


def _without_blocks(text: str, keep) -> str:
    """``text`` without the marked blocks whose cluster id ``keep(id)`` rejects."""
    out, dropping = [], None
    for line in text.splitlines(keepends=True):
        match = _BLOCK_RE.match(line)
        if dropping is not None:
            if match and match.group(1) == "END" and match.group(2) == dropping:
                dropping = None
            continue
        if match and match.group(1) == "BEGIN" and not keep(match.group(2)):
            dropping = match.group(2)
            continue
        out.append(line)
    return "".join(out)


def _block_ids(text: str) -> List[str]:
    return [m.group(2) for m in map(_BLOCK_RE.match, text.splitlines()) if m and m.group(1) == "BEGIN"]


#: First line of a file a cluster created (ssh_known_hosts): removed with the last block.
_CREATED_HEADER = f"# made by {MARKER}; removed when no test cluster is left"


def _add_block(path: str, cluster_id: str, lines: Sequence[str], create: bool = False) -> None:
    """Append the cluster's block to ``path`` (with ``create``, make the file if missing)."""
    if create and not os.path.exists(path):
        with contextlib.suppress(FileExistsError):
            with open(path, "x", encoding="utf-8") as handle:
                handle.write(_CREATED_HEADER + "\n")
            os.chmod(path, 0o644)
    with _locked(path) as handle:
        text = handle.read()
        if text and not text.endswith("\n"):
            text += "\n"
        text += "\n".join([_begin(cluster_id), *lines, _end(cluster_id)]) + "\n"
        handle.seek(0)
        handle.write(text)
        handle.truncate()


def _remove_blocks(path: str, keep, remove_if_empty: bool = False) -> List[str]:
    """Remove the marked blocks ``keep(id)`` rejects from ``path`` (rewritten in place, so a
    bind-mounted /etc/hosts stays valid); returns the removed ids. With ``remove_if_empty``,
    a file that a cluster created and that holds no other block is deleted."""
    if not os.path.exists(path):
        return []
    with _locked(path) as handle:
        text = handle.read()
        removed = [cid for cid in _block_ids(text) if not keep(cid)]
        if not removed:
            return []
        new = _without_blocks(text, keep)
        handle.seek(0)
        handle.write(new)
        handle.truncate()
        if remove_if_empty and new.strip() == _CREATED_HEADER:
            os.unlink(path)
    return removed


def _used_networks() -> List[ipaddress.IPv4Network]:
    nets = []
    for argv in (["ip", "-4", "-o", "addr", "show"], ["ip", "-4", "route", "show", "table", "all"]):
        for line in _run(argv).stdout.splitlines():
            for word in line.split():
                with contextlib.suppress(ValueError):
                    if "/" in word or re.fullmatch(r"\d+\.\d+\.\d+\.\d+", word):
                        nets.append(ipaddress.ip_network(word, strict=False))
    return [net for net in nets if net.version == 4 and net.prefixlen > 0]


def _free_subnet() -> ipaddress.IPv4Network:
    used = _used_networks()
    candidates = list(SUPERNET.subnets(new_prefix=24))
    random.shuffle(candidates)
    for net in candidates:
        if not any(net.overlaps(other) for other in used):
            return net
    raise ClusterError(f"no free /24 left in {SUPERNET}")


# --------------------------------------------------------------------------- the cluster

@dataclass
class Host:
    """One namespace host. ``name`` is its hostname (resolvable everywhere through
    /etc/hosts), ``address`` its IPv4 address on the cluster link :data:`INTERFACE`."""

    index: int
    name: str
    namespace: str
    address: str
    veth: str  # the root-namespace end of the host's link (the host's end is INTERFACE)
    sshd: Optional[subprocess.Popen] = field(default=None, repr=False)
    workdir: str = field(default="", repr=False)  # the cluster's (its sshd logs are there)

    @property
    def sshd_pid(self) -> int:
        if self.sshd is None:
            raise ClusterError(f"{self.name}: sshd is not running")
        return self.sshd.pid

    def command(self, argv: Sequence[str]) -> List[str]:
        """``argv`` wrapped to run on this host: in its network namespace (with its /sys)
        and in its sshd's UTS namespace (its hostname). The wrapper execs, so the process
        started is ``argv`` itself; the environment passes through unchanged."""
        return ["ip", "netns", "exec", self.namespace,
                "nsenter", f"--target={self.sshd_pid}", "--uts", "--", *argv]

    def run(self, argv: Sequence[str], timeout: float = 30, check: bool = False,
            **kwargs) -> subprocess.CompletedProcess:
        """Run ``argv`` on this host (see :meth:`command`), capturing text output."""
        kwargs.setdefault("stdout", subprocess.PIPE)
        kwargs.setdefault("stderr", subprocess.PIPE)
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        result = subprocess.run(self.command(argv), text=True, timeout=timeout, check=check, **kwargs)
        if isinstance(result.stderr, str):
            result.stderr = explain_refused_login(result.stderr, self.workdir)
        return result

    def explain(self, output: str) -> str:
        """``output`` with the cluster's sshd reasons appended where it says a login was denied."""
        return explain_refused_login(output, self.workdir)

    def processes(self) -> Dict[int, str]:
        """``{pid: command line}`` of what runs on this host, its sshd listener excepted
        (sessions it started, daemons and ranks are included; zombies are not)."""
        found = {}
        for pid in _netns_pids(self.namespace):
            if self.sshd is not None and pid == self.sshd.pid:
                continue
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as handle:
                    cmdline = handle.read().replace(b"\0", b" ").decode(errors="replace").strip()
            except OSError:
                continue  # it ended meanwhile
            if cmdline:
                found[pid] = cmdline
        return found


Shape = Union[None, str, Sequence[Optional[str]]]


class NetnsCluster:
    """K hosts as network namespaces with sshd; a context manager.

    Args:
        num_hosts: how many hosts (``hosts[0]`` .. ``hosts[K-1]``).
        rate: cap on each host link's bandwidth in each direction (``tc`` rate syntax, e.g.
            ``"1gbit"``), one value for all hosts or one per host (``None``: no cap).
        delay: latency added on each host link in each direction (e.g. ``"0.1ms"``), one
            value or one per host. Needs ``sch_netem``.
        start_timeout: seconds to wait for every sshd to answer.
        parent_dir: where the cluster's work directory (keys, sshd configs and logs) is made
            (default: the temporary directory). Its mode does not matter: the test sshd does
            not check the ownership and modes of the directories above its keys.

    Raises (from :meth:`start`, i.e. on ``with``):
        ClusterUnavailable: the machine cannot host the cluster (the reason says why).
        ClusterError: building it failed; everything created so far is removed.
    """

    def __init__(self, num_hosts: int = 2, rate: Shape = None, delay: Shape = None,
                 start_timeout: float = 15.0, parent_dir: Optional[str] = None):
        if num_hosts < 1 or num_hosts > 250:
            raise ValueError(f"num_hosts must be 1..250, got {num_hosts}")
        self.num_hosts = num_hosts
        self.rates = self._per_host(rate, "rate")
        self.delays = self._per_host(delay, "delay")
        self.start_timeout = start_timeout
        self.parent_dir = parent_dir
        self.id = ""
        self.name = ""
        self.bridge = ""
        self.interface = INTERFACE
        self.subnet: Optional[ipaddress.IPv4Network] = None
        self.gateway = ""  # the root namespace's address on the cluster network
        self.workdir = ""
        self.key = ""  # the cluster's ssh private key (root on every host accepts it)
        self.hosts: List[Host] = []
        self._created: Dict[str, object] = {"namespaces": [], "links": [], "hosts_block": False,
                                            "known_hosts_block": False}
        self._started = False
        self._closed = False
        self._close_lock = threading.Lock()

    def _per_host(self, value: Shape, what: str) -> List[Optional[str]]:
        if value is None or isinstance(value, str):
            return [value] * self.num_hosts
        values = list(value)
        if len(values) != self.num_hosts:
            raise ValueError(f"{what}: {len(values)} values for {self.num_hosts} hosts")
        return values

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> "NetnsCluster":
        if self._closed:
            raise ClusterError("cluster already closed")
        return self if self._started else self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> "NetnsCluster":
        """Build the cluster. Raises :class:`ClusterUnavailable` or :class:`ClusterError`."""
        if self._started:
            raise ClusterError("cluster already started")
        reason = unavailable_reason(shaping_delay=any(self.delays))
        if reason is not None:
            raise ClusterUnavailable(reason)
        self._started = True
        _register(self)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _build(self) -> None:
        self._make_workdir()
        self._make_keys()
        self._make_network()
        self._add_name_blocks()
        for host in self.hosts:
            self._start_sshd(host)
        deadline = time.monotonic() + self.start_timeout
        for host in self.hosts:
            self._wait_for_sshd(host, deadline)
        self._check_logins()
        for host, rate, delay in zip(self.hosts, self.rates, self.delays):
            if rate or delay:
                self._shape(host, rate, delay)

    def _make_workdir(self) -> None:
        tmp = self.parent_dir or tempfile.gettempdir()
        for _ in range(100):
            cluster_id = secrets.token_hex(3)
            path = os.path.join(tmp, f"{STATE_DIR_PREFIX}{PREFIX}{cluster_id}")
            try:
                os.mkdir(path, 0o700)
            except FileExistsError:
                continue
            if any(ns.startswith(PREFIX + cluster_id) for ns in _netns_list()):
                os.rmdir(path)
                continue
            break
        else:
            raise ClusterError("cannot find a free cluster id")
        self.id, self.workdir = cluster_id, path
        self.name = f"{PREFIX}{cluster_id}"
        self.bridge = f"{self.name}br"
        pid = os.getpid()
        self._write_state({"owner_pid": pid, "owner_start": _process_start_time(pid),
                           "netns_dir_created": _NETNS_DIR_EXISTED[0] is False})

    def _write_state(self, extra: Dict[str, object]) -> None:
        path = os.path.join(self.workdir, "state.json")
        state = {}
        with contextlib.suppress(OSError, ValueError):
            with open(path, encoding="utf-8") as handle:
                state = json.load(handle)
        state.update(extra)
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(state, handle)

    def _make_keys(self) -> None:
        self.key = os.path.join(self.workdir, "id_ed25519")
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"{self.name}-client", "-f", self.key])
        self.host_key = os.path.join(self.workdir, "ssh_host_ed25519_key")
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"{self.name}-host", "-f", self.host_key])
        shutil.copyfile(self.key + ".pub", os.path.join(self.workdir, "authorized_keys"))
        os.chmod(os.path.join(self.workdir, "authorized_keys"), 0o600)

    def _make_network(self) -> None:
        # the /etc/hosts lock also serialises subnet choice between concurrent clusters
        with _locked(HOSTS_FILE):
            self.subnet = _free_subnet()
            addresses = list(self.subnet.hosts())
            self.gateway = str(addresses[0])
            self._created["links"].append(self.bridge)
            self._write_state({"subnet": str(self.subnet)})
            _run(["ip", "link", "add", self.bridge, "type", "bridge"])
            _run(["ip", "addr", "add", f"{self.gateway}/{self.subnet.prefixlen}", "dev", self.bridge])
        _run(["ip", "link", "set", self.bridge, "up"])
        for index in range(1, self.num_hosts + 1):
            host = Host(index=index, name=f"{self.name}-h{index}", namespace=f"{self.name}-h{index}",
                        address=str(addresses[index]), veth=f"{self.name}v{index}", workdir=self.workdir)
            self._created["namespaces"].append(host.namespace)
            _run(["ip", "netns", "add", host.namespace])
            self._created["links"].append(host.veth)
            _run(["ip", "link", "add", host.veth, "type", "veth", "peer", "name", INTERFACE,
                  "netns", host.namespace])
            _run(["ip", "link", "set", host.veth, "master", self.bridge])
            _run(["ip", "link", "set", host.veth, "up"])
            ns = ["ip", "-n", host.namespace]
            _run([*ns, "addr", "add", f"{host.address}/{self.subnet.prefixlen}", "dev", INTERFACE])
            _run([*ns, "link", "set", INTERFACE, "up"])
            _run([*ns, "link", "set", "lo", "up"])
            self.hosts.append(host)

    def _add_name_blocks(self) -> None:
        self._created["hosts_block"] = True
        _add_block(HOSTS_FILE, self.name, [f"{h.address} {h.name}" for h in self.hosts])
        with open(self.host_key + ".pub", encoding="ascii") as handle:
            key_type, key_data = handle.read().split()[:2]
        names = ",".join(n for h in self.hosts for n in (h.name, h.address))
        os.makedirs(os.path.dirname(KNOWN_HOSTS_FILE), exist_ok=True)
        self._created["known_hosts_block"] = True
        _add_block(KNOWN_HOSTS_FILE, self.name, [f"{names} {key_type} {key_data}"], create=True)

    def _sshd_config(self, host: Host) -> str:
        path = os.path.join(self.workdir, f"sshd_config.h{host.index}")
        config = f"""\
Port 22
ListenAddress {host.address}
ListenAddress 127.0.0.1
HostKey {self.host_key}
PidFile none
AuthorizedKeysFile {os.path.join(self.workdir, "authorized_keys")}
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
UseDNS no
PrintMotd no
PrintLastLog no
X11Forwarding no
MaxStartups 100:30:200
MaxSessions 100
LogLevel VERBOSE
Subsystem sftp internal-sftp
# This sshd serves only this throwaway cluster, whose keys live in its work directory under
# the temporary directory. StrictModes (on by default) refuses an AuthorizedKeysFile below
# any group- or world-writable directory, and /tmp is world-writable on most machines.
StrictModes no
"""
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(config)
        return path

    def _start_sshd(self, host: Host) -> None:
        config = self._sshd_config(host)
        _ensure_privsep_dir()
        log = open(os.path.join(self.workdir, f"sshd.h{host.index}.log"), "w", encoding="utf-8")
        with log:
            # own UTS namespace with the host's name; exec so the pid is sshd's
            script = 'hostname "$1" && exec "$2" -D -e -f "$3"'
            host.sshd = subprocess.Popen(
                ["ip", "netns", "exec", host.namespace, "unshare", "--uts", "--",
                 "sh", "-c", script, "sh", host.name, SSHD, config],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )

    def _wait_for_sshd(self, host: Host, deadline: float) -> None:
        last = None
        while True:
            if host.sshd.poll() is not None:
                raise ClusterError(f"sshd of {host.name} exited ({host.sshd.returncode}): {self._sshd_log(host)}")
            try:
                with socket.create_connection((host.address, 22), timeout=1) as conn:
                    if conn.recv(64).startswith(b"SSH-"):
                        return
            except OSError as error:
                last = error
            if time.monotonic() > deadline:
                raise ClusterError(f"sshd of {host.name} ({host.address}:22) did not answer from the "
                                   f"root namespace within {self.start_timeout:g} s ({last}); "
                                   f"log: {self._sshd_log(host)}")
            time.sleep(0.05)

    def _check_logins(self) -> None:
        """Log in to every host with the cluster's key, from the root namespace, so that a
        cluster whose sshd refuses the key fails here, with the sshd's reason, rather than in
        the middle of a job."""
        for host in self.hosts:
            result = self.ssh(host, ["true"])
            if result.returncode != 0:
                raise ClusterError(f"ssh root@{host.name} with the cluster key failed "
                                   f"({result.returncode}): {result.stderr.strip()}")

    def login_refusals(self) -> List[str]:
        """The lines of the hosts' sshd logs that say why a login was refused or failed."""
        return login_refusals(self.workdir)

    def _sshd_log(self, host: Host) -> str:
        with contextlib.suppress(OSError):
            with open(os.path.join(self.workdir, f"sshd.h{host.index}.log"), encoding="utf-8") as handle:
                return handle.read().strip() or "(empty)"
        return "(none)"

    def _shape(self, host: Host, rate: Optional[str], delay: Optional[str]) -> None:
        for prefix in ([], ["-n", host.namespace]):
            dev = INTERFACE if prefix else host.veth
            tc = ["tc", *prefix, "qdisc", "replace", "dev", dev]
            if delay:
                _run([*tc, "root", "handle", "1:", "netem", "delay", delay, "limit", "100000"])
                if rate:
                    _run(["tc", *prefix, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:",
                          "tbf", *self._tbf_args(rate)])
            else:
                _run([*tc, "root", "handle", "1:", "tbf", *self._tbf_args(rate)])

    @staticmethod
    def _tbf_args(rate: str) -> List[str]:
        # burst: at least one 64 KiB GSO packet (veths pass TSO-sized skbs), else ~1 ms of rate
        bits = _rate_bits(rate)
        burst = max(256 * 1024, bits // 8 // 1000)
        return ["rate", rate, "burst", str(burst), "latency", "20ms"]

    def close(self) -> None:
        """Remove everything this cluster created (idempotent; never raises)."""
        with self._close_lock:
            if self._closed or not self._started:
                self._closed = True
                return
            self._closed = True
        try:
            _teardown(self.name, self.workdir, [h.sshd for h in self.hosts],
                      self._created["namespaces"], self._created["links"],
                      self._created["hosts_block"], self._created["known_hosts_block"])
        finally:
            _unregister(self)

    # ------------------------------------------------------------------ using it

    def host(self, name_or_index: Union[str, int]) -> Host:
        if isinstance(name_or_index, int):
            return self.hosts[name_or_index]
        return next(h for h in self.hosts if name_or_index in (h.name, h.address, h.namespace))

    def hosts_arg(self, slots: int = 1, hosts: Optional[Sequence[Host]] = None) -> str:
        """``-H`` for ``ringrun``/``mpirun``: ``NAME:SLOTS,...``."""
        return ",".join(f"{h.name}:{slots}" for h in (hosts or self.hosts))

    def ssh_options(self) -> List[str]:
        """ssh options for this cluster's hosts (its key, no prompts)."""
        return ["-i", self.key, "-o", "BatchMode=yes", "-o", "ConnectTimeout=5"]

    def ssh_command(self, host: Union[Host, str, int], argv: Sequence[str]) -> List[str]:
        """``ssh ... root@HOST CMD`` (run from the root namespace or any host)."""
        target = host if isinstance(host, Host) else self.host(host)
        return ["ssh", *self.ssh_options(), f"root@{target.name}", shlex.join(argv)]

    def ssh(self, host: Union[Host, str, int], argv: Sequence[str], timeout: float = 20,
            from_host: Optional[Host] = None) -> subprocess.CompletedProcess:
        """Run ``argv`` on ``host`` over ssh (from the root namespace, or from ``from_host``)."""
        command = self.ssh_command(host, argv)
        if from_host is not None:
            command = from_host.command(command)
        result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                stdin=subprocess.DEVNULL, text=True, timeout=timeout)
        result.stderr = explain_refused_login(result.stderr, self.workdir)
        return result

    def throughput_mbit(self, src: Host, dst: Host, nbytes: int = 10_000_000, timeout: float = 30) -> float:
        """Mbit/s of one TCP stream of ``nbytes`` from ``src`` to ``dst`` (receiver-timed)."""
        server = subprocess.Popen(dst.command([sys.executable, "-c", _SINK, dst.address]),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            port = server.stdout.readline().strip()
            if not port.isdigit():
                raise ClusterError(f"throughput sink on {dst.name} failed: {server.communicate(timeout=5)[1]}")
            src.run([sys.executable, "-c", _SOURCE, dst.address, port, str(nbytes)], timeout=timeout, check=True)
            received, seconds = server.communicate(timeout=timeout)[0].split()
        finally:
            if server.poll() is None:
                server.kill()
                server.wait()
        return int(received) * 8 / float(seconds) / 1e6

    def rtt_ms(self, src: Host, dst: Host, count: int = 20, timeout: float = 30) -> float:
        """Median TCP connect time (one round trip) from ``src`` to ``dst``'s sshd, in ms."""
        result = src.run([sys.executable, "-c", _RTT, dst.address, str(count)], timeout=timeout, check=True)
        return float(result.stdout.strip())

    def describe(self) -> str:
        lines = [f"cluster {self.name}: subnet {self.subnet}, bridge {self.bridge} ({self.gateway}), "
                 f"key {self.key}"]
        for host, rate, delay in zip(self.hosts, self.rates, self.delays):
            shaped = f" rate {rate}" if rate else ""
            shaped += f" delay {delay}" if delay else ""
            lines.append(f"  {host.name}: {host.address} on {INTERFACE} (netns {host.namespace}, "
                         f"veth {host.veth}, sshd pid {host.sshd.pid if host.sshd else '-'}){shaped}")
        return "\n".join(lines)


#: What sshd (LogLevel VERBOSE) logs when it refuses or fails a login, e.g. "Authentication
#: refused: bad ownership or modes for directory /tmp" or "Failed publickey for root ...".
_REFUSAL_RE = re.compile(r"refused|Failed|[Bb]ad ownership|not allowed|Invalid user|error:")
#: What ssh prints when the server would not let it in.
_DENIED_RE = re.compile(r"Permission denied \(")


def login_refusals(workdir: str) -> List[str]:
    """The lines of the sshd logs in cluster work directory ``workdir`` (every host's) that
    say why a login was refused or failed, each prefixed with the host's log name."""
    lines = []
    with contextlib.suppress(OSError):
        for name in sorted(os.listdir(workdir)):
            if name.startswith("sshd.") and name.endswith(".log"):
                with contextlib.suppress(OSError):
                    with open(os.path.join(workdir, name), encoding="utf-8", errors="replace") as handle:
                        lines += [f"{name}: {line.strip()}" for line in handle if _REFUSAL_RE.search(line)]
    return lines


def explain_refused_login(output: str, workdir: str) -> str:
    """``output`` of an ssh (or of a launcher that ran ssh) with, where it says a login was
    denied, the cluster's sshd log lines giving the reason appended."""
    if not workdir or not _DENIED_RE.search(output or ""):
        return output
    reasons = login_refusals(workdir) or ["(no sshd log line gives a reason)"]
    return (output.rstrip("\n") + "\n--- the cluster's sshd logs say ---\n" + "\n".join(reasons[-20:]) + "\n")


# Clusters of this process that are up: closed at exit and on SIGTERM/SIGHUP.
_LIVE: "set" = set()
_LIVE_LOCK = threading.Lock()
_OLD_HANDLERS: Dict[int, object] = {}
_NETNS_DIR_EXISTED: List[Optional[bool]] = [None]


def _register(cluster: NetnsCluster) -> None:
    with _LIVE_LOCK:
        first = not _LIVE
        _LIVE.add(cluster)
    if first:
        atexit.register(_close_all)
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGHUP):
                if signal.getsignal(signum) in (signal.SIG_DFL, None):
                    _OLD_HANDLERS[signum] = signal.signal(signum, _on_signal)


def _unregister(cluster: NetnsCluster) -> None:
    with _LIVE_LOCK:
        _LIVE.discard(cluster)
        last = not _LIVE
    if last:
        with contextlib.suppress(Exception):
            atexit.unregister(_close_all)
        if threading.current_thread() is threading.main_thread():
            for signum, handler in list(_OLD_HANDLERS.items()):
                if signal.getsignal(signum) is _on_signal:
                    signal.signal(signum, handler)
                del _OLD_HANDLERS[signum]
        _remove_system_dirs(_NETNS_DIR_EXISTED[0] is False)


def _close_all() -> None:
    for cluster in list(_LIVE):
        cluster.close()


def _on_signal(signum, frame) -> None:
    _close_all()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _ensure_privsep_dir() -> None:
    """sshd refuses to start without its privilege-separation directory (which systemd's
    ``RuntimeDirectory=`` or the init script normally make). Make it if missing, with a
    marker file inside saying so; :func:`_remove_system_dirs` removes both again."""
    try:
        os.mkdir(SSHD_PRIVSEP_DIR, 0o755)
    except FileExistsError:
        return
    with open(PRIVSEP_MARKER, "w", encoding="utf-8") as handle:
        handle.write("made by tests/cluster/netns_cluster.py; removed with the last test cluster\n")


def _remove_system_dirs(netns_dir_ours: bool) -> None:
    """Once no cluster (of any process) is left: remove /run/sshd if a cluster made it (its
    marker file is there and nothing else), and /run/netns if ``netns_dir_ours`` (``ip netns
    add`` made it, as a bind mount on itself, for our clusters) and it is empty."""
    if any(_ID_RE.match(ns) for ns in _netns_list()):
        return
    with contextlib.suppress(OSError):
        if os.listdir(SSHD_PRIVSEP_DIR) == [os.path.basename(PRIVSEP_MARKER)]:
            os.unlink(PRIVSEP_MARKER)
            os.rmdir(SSHD_PRIVSEP_DIR)
    if netns_dir_ours and os.path.isdir(NETNS_DIR) and not os.listdir(NETNS_DIR):
        while _quiet(["umount", NETNS_DIR]):
            pass
        with contextlib.suppress(OSError):
            os.rmdir(NETNS_DIR)


_SINK = """\
import socket, sys, time
server = socket.create_server((sys.argv[1], 0))
print(server.getsockname()[1], flush=True)
conn, _ = server.accept()
received, start = 0, None
while True:
    chunk = conn.recv(1 << 20)
    if start is None:
        start = time.monotonic()
    if not chunk:
        break
    received += len(chunk)
print(received, time.monotonic() - start, flush=True)
"""
_SOURCE = """\
import socket, sys
with socket.create_connection((sys.argv[1], int(sys.argv[2]))) as conn:
    conn.sendall(bytes(int(sys.argv[3])))
"""
_RTT = """\
import socket, statistics, sys, time
times = []
for _ in range(int(sys.argv[2])):
    start = time.perf_counter()
    socket.create_connection((sys.argv[1], 22), timeout=5).close()
    times.append((time.perf_counter() - start) * 1000)
print(statistics.median(times))
"""


def _rate_bits(rate: str) -> int:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmgt]?)(bit|bps)?", rate.strip().lower())
    if not match:
        raise ValueError(f"rate {rate!r}: expected e.g. 100mbit, 1gbit, 10gbit")
    number, scale, unit = float(match.group(1)), match.group(2), match.group(3) or "bit"
    bits = number * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[scale]
    return int(bits * (8 if unit == "bps" else 1))


def _netns_list() -> List[str]:
    try:
        out = _run(["ip", "netns", "list"], check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _netns_pids(namespace: str) -> List[int]:
    try:
        out = _run(["ip", "netns", "pids", namespace], check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [int(word) for word in out.split() if word.isdigit()]


def _kill_namespace_processes(namespaces: Sequence[str], popens: Sequence[Optional[subprocess.Popen]],
                              grace: float = 2.0) -> None:
    """SIGTERM, then SIGKILL, everything running in ``namespaces`` (sshd, and whatever ssh
    sessions started there: prted, ranks)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = {pid for ns in namespaces for pid in _netns_pids(ns)}
        pids |= {p.pid for p in popens if p is not None and p.poll() is None}
        pids.discard(os.getpid())
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            for popen in popens:
                if popen is not None:
                    popen.poll()
            if not any(_netns_pids(ns) for ns in namespaces) and all(
                    p is None or p.poll() is not None for p in popens):
                break
            time.sleep(0.05)
    for popen in popens:
        if popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                popen.wait(timeout=1)


def _teardown(name: str, workdir: str, popens, namespaces, links, hosts_block: bool,
              known_hosts_block: bool) -> None:
    """Remove one cluster's objects. Every step runs even if an earlier one failed."""
    _kill_namespace_processes(namespaces, popens)
    for link in reversed(list(links)):  # host veths first (their peers go with them), then the bridge
        if _link_exists(link):
            _quiet(["ip", "link", "del", link])
    for ns in namespaces:
        if ns in _netns_list():
            _quiet(["ip", "netns", "del", ns])
    if hosts_block:
        with contextlib.suppress(OSError):
            _remove_blocks(HOSTS_FILE, lambda cid: cid != name)
    if known_hosts_block:
        with contextlib.suppress(OSError):
            _remove_blocks(KNOWN_HOSTS_FILE, lambda cid: cid != name, remove_if_empty=True)
    if workdir:
        shutil.rmtree(workdir, ignore_errors=True)


def _link_exists(name: str) -> bool:
    return _quiet(["ip", "link", "show", "dev", name])


# --------------------------------------------------------------------------- stale clusters

def _read_state(cluster_name: str) -> dict:
    path = os.path.join(tempfile.gettempdir(), f"{STATE_DIR_PREFIX}{cluster_name}", "state.json")
    try:
        with open(path, encoding="utf-8") as handle:
            state = json.load(handle)
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def _owner_alive(cluster_name: str) -> bool:
    """Whether the process that made cluster ``cluster_name`` still runs."""
    state = _read_state(cluster_name)
    try:
        pid = int(state["owner_pid"])
    except (ValueError, KeyError, TypeError):
        return False
    start = _process_start_time(pid)
    return start is not None and start == state.get("owner_start")


def cleanup_stale(include_live: bool = False) -> List[str]:
    """Remove what clusters whose owning process is gone left behind (with ``include_live``,
    every cluster's): processes in their namespaces, links, namespaces, /etc/hosts and
    ssh_known_hosts lines, state directories. Only objects named ``rmc`` + 6 hex digits (and
    marker-delimited lines) are touched. Returns what was removed."""
    def stale(cluster_name: str) -> bool:
        return include_live or not _owner_alive(cluster_name)

    removed: List[str] = []
    namespaces = [ns for ns in _netns_list() if _ID_RE.match(ns) and stale(_ID_RE.match(ns).group(0))]
    _kill_namespace_processes(namespaces, [])
    links = []
    with contextlib.suppress(ClusterError, OSError, subprocess.SubprocessError):
        for line in _run(["ip", "-o", "link", "show"]).stdout.splitlines():
            parts = line.split(":", 2)
            if len(parts) > 2:
                link = parts[1].strip().split("@", 1)[0]
                match = _ID_RE.match(link)
                if match and stale(match.group(0)):
                    links.append(link)
    for link in sorted(links, key=lambda n: n.endswith("br")):  # veths before bridges
        if _link_exists(link) and _quiet(["ip", "link", "del", link]):
            removed.append(f"link {link}")
    for ns in namespaces:
        if _quiet(["ip", "netns", "del", ns]):
            removed.append(f"netns {ns}")
    keep = lambda cid: not stale(cid)  # noqa: E731
    for path, if_empty in ((HOSTS_FILE, False), (KNOWN_HOSTS_FILE, True)):
        with contextlib.suppress(OSError):
            removed += [f"{path} lines of {cid}" for cid in _remove_blocks(path, keep, remove_if_empty=if_empty)]
    tmp = tempfile.gettempdir()
    netns_dir_ours = False
    for entry in os.listdir(tmp):
        if entry.startswith(STATE_DIR_PREFIX):
            cluster_name = entry[len(STATE_DIR_PREFIX):]
            if _ID_RE.fullmatch(cluster_name) and stale(cluster_name):
                netns_dir_ours |= bool(_read_state(cluster_name).get("netns_dir_created"))
                shutil.rmtree(os.path.join(tmp, entry), ignore_errors=True)
                removed.append(f"directory {os.path.join(tmp, entry)}")
    with contextlib.suppress(OSError):
        had = [path for path in (SSHD_PRIVSEP_DIR, NETNS_DIR) if os.path.isdir(path)]
        _remove_system_dirs(netns_dir_ours)
        removed += [f"directory {path}" for path in had if not os.path.isdir(path)]
    return removed


def leftovers(cluster_name: Optional[str] = None) -> List[str]:
    """Objects of cluster ``cluster_name`` (default: of any cluster) that still exist."""
    pattern = re.compile(re.escape(cluster_name) if cluster_name else _ID_RE.pattern)
    found = [f"netns {ns}" for ns in _netns_list() if pattern.match(ns)]
    out = _run(["ip", "-o", "link", "show"], check=False).stdout
    found += [f"link {line.split(':', 2)[1].strip()}" for line in out.splitlines()
              if len(line.split(":", 2)) > 2 and pattern.match(line.split(":", 2)[1].strip())]
    for path in (HOSTS_FILE, KNOWN_HOSTS_FILE):
        with contextlib.suppress(OSError):
            with open(path, encoding="utf-8") as handle:
                found += [f"{path} lines of {cid}" for cid in _block_ids(handle.read()) if pattern.match(cid)]
    tmp = tempfile.gettempdir()
    found += [f"directory {os.path.join(tmp, e)}" for e in os.listdir(tmp)
              if e.startswith(STATE_DIR_PREFIX) and pattern.match(e[len(STATE_DIR_PREFIX):])]
    return found


# --------------------------------------------------------------------------- command line

def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="network-namespace test cluster")
    sub = parser.add_subparsers(dest="action", required=True)
    up = sub.add_parser("up", help="build a cluster, print it, keep it until Ctrl-C")
    up.add_argument("-n", "--hosts", type=int, default=2)
    up.add_argument("--rate", help="per-link bandwidth, e.g. 1gbit")
    up.add_argument("--delay", help="per-link delay, e.g. 0.1ms")
    stale = sub.add_parser("cleanup-stale", help="remove leftovers of clusters whose owner is gone")
    stale.add_argument("--all", action="store_true", help="also clusters whose owner still runs")
    sub.add_parser("check", help="say whether a cluster can be built here")
    args = parser.parse_args(argv)
    if args.action == "check":
        reason = unavailable_reason()
        print(reason or "ok")
        return 0 if reason is None else 1
    if args.action == "cleanup-stale":
        if os.geteuid() != 0:
            print("cleanup-stale needs root", file=sys.stderr)
            return 1
        for item in cleanup_stale(include_live=args.all):
            print("removed", item)
        return 0
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even when started in the background
    try:
        with NetnsCluster(args.hosts, rate=args.rate, delay=args.delay) as cluster:
            print(cluster.describe())
            first = cluster.hosts[0]
            print(f"\nssh:   ssh -i {cluster.key} root@{first.name}")
            print(f"shell: {shlex.join(first.command(['bash']))}")
            print("Ctrl-C tears it down.", flush=True)
            with contextlib.suppress(KeyboardInterrupt):
                signal.pause()
    except ClusterUnavailable as error:
        print(f"cannot build the cluster: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
