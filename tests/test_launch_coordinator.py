"""Starting, waiting for and stopping the coordinator daemon (fake daemons and the real one)."""

import os
import socket
import sys
import textwrap
import time

import pytest

from ringmaster.launch import coordinator_process
from ringmaster.launch.coordinator_process import CoordinatorProcess
from ringmaster.launch.errors import LaunchError

SECRET = "ab" * 32


def _fake(tmp_path, monkeypatch, body):
    """Make ``python -m <COORDINATOR_MODULE>`` run ``body`` (a fake daemon in tmp_path)."""
    (tmp_path / "fake_coordinator.py").write_text(textwrap.dedent(body))
    monkeypatch.setattr(coordinator_process, "COORDINATOR_MODULE", "fake_coordinator")
    return {"PYTHONPATH": str(tmp_path), "PATH": os.environ["PATH"], "RINGMASTER_SECRET": SECRET}


def _coordinator(tmp_path, env, timeout=10.0, bind="127.0.0.1", advertise="127.0.0.1"):
    return CoordinatorProcess(size=2, bind=bind, advertise=advertise, env=env,
                              address_file=str(tmp_path / "address"), start_timeout=timeout)


def test_command_carries_no_secret(tmp_path):
    coordinator = _coordinator(tmp_path, {"RINGMASTER_SECRET": SECRET})
    command = coordinator.command()
    assert command[:3] == [sys.executable, "-m", "ringmaster.coordinator"]
    assert "--exit-on-stdin-eof" in command and command[command.index("--size") + 1] == "2"
    assert command[command.index("--port") + 1] == "0"
    assert SECRET not in " ".join(command)
    assert "--advertise" not in command
    remote = _coordinator(tmp_path, {}, bind="0.0.0.0", advertise="10.1.2.3").command()
    assert remote[remote.index("--advertise") + 1] == "10.1.2.3"


@pytest.mark.timeout(30)
def test_exit_before_listening_is_reported(tmp_path, monkeypatch):
    env = _fake(tmp_path, monkeypatch, "import sys; print('boom', file=sys.stderr); sys.exit(7)")
    coordinator = _coordinator(tmp_path, env)
    with pytest.raises(LaunchError, match="exited with status 7") as error:
        coordinator.start()
    assert error.value.exit_code == 1
    coordinator.stop()


@pytest.mark.timeout(30)
def test_start_timeout(tmp_path, monkeypatch):
    env = _fake(tmp_path, monkeypatch, "import time; time.sleep(60)")
    coordinator = _coordinator(tmp_path, env, timeout=1.0)
    started = time.monotonic()
    try:
        with pytest.raises(LaunchError, match=r"within 1 s \(--start-timeout\)"):
            coordinator.start()
        assert time.monotonic() - started < 5
    finally:
        coordinator.stop(eof_grace=0.2, term_grace=1.0)
    assert coordinator.process.poll() is not None


@pytest.mark.timeout(30)
def test_wildcard_address_is_advertised_and_secret_in_environment(tmp_path, monkeypatch):
    env = _fake(tmp_path, monkeypatch, """
        import argparse, os, sys
        parser = argparse.ArgumentParser()
        for flag in ("--size", "--bind", "--port", "--address-file", "--advertise"):
            parser.add_argument(flag)
        parser.add_argument("--exit-on-stdin-eof", action="store_true")
        parser.add_argument("--persistent", action="store_true")
        args = parser.parse_args()
        assert os.environ["RINGMASTER_SECRET"] == "%s"
        with open(args.address_file + ".tmp", "w") as handle:
            handle.write("0.0.0.0:4242\\n")
        os.rename(args.address_file + ".tmp", args.address_file)
        sys.stdin.read()
    """ % SECRET)
    coordinator = _coordinator(tmp_path, env, bind="0.0.0.0", advertise="10.9.8.7")
    try:
        assert coordinator.start() == "10.9.8.7:4242"
    finally:
        coordinator.stop(eof_grace=5.0)
    assert coordinator.process.returncode == 0  # it left on stdin EOF, not by a signal


@pytest.mark.timeout(30)
def test_stop_kills_a_stubborn_daemon(tmp_path, monkeypatch):
    env = _fake(tmp_path, monkeypatch, """
        import signal, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        sys.stdin.close()
        time.sleep(60)
    """)
    coordinator = _coordinator(tmp_path, env, timeout=0.5)
    with pytest.raises(LaunchError):
        coordinator.start()
    started = time.monotonic()
    coordinator.stop(eof_grace=0.2, term_grace=0.5)
    assert coordinator.process.returncode == -9
    assert time.monotonic() - started < 5


@pytest.mark.timeout(60)
def test_real_coordinator_starts_listens_and_stops(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RINGMASTER_")}
    env["RINGMASTER_SECRET"] = SECRET
    coordinator = _coordinator(tmp_path, env, timeout=30.0)
    try:
        address = coordinator.start()
        host, port = address.rsplit(":", 1)
        assert host == "127.0.0.1"
        with socket.create_connection((host, int(port)), timeout=5):
            pass
    finally:
        coordinator.stop()
    assert coordinator.process.poll() is not None
