"""Unit tests of ringrun's host handling: -H, hostfiles, slot checks, local hosts."""

import os
import socket

import pytest

from ringmaster.launch.errors import LaunchError
from ringmaster.launch.hosts import (Host, all_local, check_slots, default_hosts, is_local_host,
                                     parse_hostfile, parse_hosts, resolve_hosts, total_slots)


def test_parse_hosts():
    assert parse_hosts("a:2,b:4") == [Host("a", 2), Host("b", 4)]
    assert parse_hosts(" a:2 , b ") == [Host("a", 2), Host("b", 1)]
    assert parse_hosts("node-1.example.com:8") == [Host("node-1.example.com", 8)]


def test_parse_hosts_merges_repeated_names():
    assert parse_hosts("a:1,b:2,a:3") == [Host("a", 4), Host("b", 2)]


@pytest.mark.parametrize("spec", ["a:", "a:x", ":2", "a:0", "a:-1", "a:2,,b:2", "", "a:1:2", "a:1.5"])
def test_parse_hosts_rejects_malformed(spec):
    with pytest.raises(LaunchError) as error:
        parse_hosts(spec)
    assert "-H" in str(error.value)


def test_parse_hosts_message_names_entry():
    with pytest.raises(LaunchError, match=r"'b:x'.*positive integer"):
        parse_hosts("a:2,b:x")


def test_parse_hostfile(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("# cluster\n\nnode1 slots=4\nnode2 slots=2   # the small one\n  node3\n")
    assert parse_hostfile(str(path)) == [Host("node1", 4), Host("node2", 2), Host("node3", 1)]


@pytest.mark.parametrize("line", ["node2 slots=x", "node2 slots=0", "node2 slots", "node2 cpus=4",
                                  "node2:4", "node2 slots=2 slots=3"])
def test_parse_hostfile_names_bad_line(tmp_path, line):
    path = tmp_path / "hosts"
    path.write_text(f"node1 slots=4\n# comment\n{line}\n")
    with pytest.raises(LaunchError, match=r"line 3"):
        parse_hostfile(str(path))


def test_parse_hostfile_missing(tmp_path):
    with pytest.raises(LaunchError, match="does not exist"):
        parse_hostfile(str(tmp_path / "nope"))


def test_parse_hostfile_empty(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("# nothing here\n\n")
    with pytest.raises(LaunchError, match="no hosts"):
        parse_hostfile(str(path))


def test_resolve_hosts(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("a slots=2\n")
    assert resolve_hosts("b:3", None) == [Host("b", 3)]
    assert resolve_hosts(None, str(path)) == [Host("a", 2)]
    assert resolve_hosts(None, None) == default_hosts() == [Host("localhost", os.cpu_count())]
    with pytest.raises(LaunchError, match="not both"):
        resolve_hosts("b:3", str(path))


def test_check_slots():
    hosts = [Host("a", 2), Host("b", 2)]
    assert total_slots(hosts) == 4
    check_slots(4, hosts, oversubscribe=False)
    check_slots(9, hosts, oversubscribe=True)
    with pytest.raises(LaunchError) as error:
        check_slots(5, hosts, oversubscribe=False)
    message = str(error.value)
    assert "-np 5" in message and "4 available" in message and "--oversubscribe" in message


@pytest.mark.parametrize("num_proc", [0, -1])
def test_check_slots_rejects_nonpositive(num_proc):
    with pytest.raises(LaunchError, match="at least 1"):
        check_slots(num_proc, [Host("a", 2)], oversubscribe=True)


def test_is_local_host():
    for name in ("localhost", "LOCALHOST", "127.0.0.1", "127.0.1.1", "::1", socket.gethostname()):
        assert is_local_host(name), name
    assert not is_local_host("no-such-host.invalid")
    assert not is_local_host("192.0.2.254") or _can_bind("192.0.2.254")
    assert all_local([Host("localhost", 1), Host(socket.gethostname(), 2)])
    assert not all_local([Host("localhost", 1), Host("no-such-host.invalid", 2)])


def _can_bind(address):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind((address, 0))
            return True
        except OSError:
            return False
