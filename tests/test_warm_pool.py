"""The suite's warm pool (tests/warm_pool.py): a rank forked from a zygote behaves as the
``python`` it replaces — arguments, paths, output, exit codes, signals, death with its launcher —
and a request it cannot serve runs a plain Python instead."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import warm_pool
from mpijob import job_environment

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not warm_pool.enabled(), reason="the warm pool is off (RMTEST_WARM_POOL=0)")]


@pytest.fixture(scope="module")
def pool_env():
    pool = warm_pool.pool(job_environment())
    return dict(job_environment(), **pool.client_environment())


def start(env, code: str, *args: str, local_rank: int = 0, cwd=None) -> subprocess.Popen:
    env = dict(env, OMPI_COMM_WORLD_LOCAL_RANK=str(local_rank))
    return subprocess.Popen([sys.executable, "-S", warm_pool.CLIENT, "-c", textwrap.dedent(code), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd)


def run(env, code: str, *args: str, **kwargs):
    process = start(env, code, *args, **kwargs)
    stdout, stderr = process.communicate(timeout=30)
    return process.returncode, stdout, stderr


def test_a_served_rank_has_torch_loaded_and_the_requests_argv_cwd_env_and_path(pool_env, tmp_path):
    env = dict(pool_env, RMTEST_PROBE="42", PYTHONPATH=os.pathsep.join([str(tmp_path), pool_env["PYTHONPATH"]]))
    (tmp_path / "probe_module.py").write_text("VALUE = 'from PYTHONPATH'\n")
    code, stdout, stderr = run(env, """
        import os, sys
        import probe_module
        print('torch' in sys.modules, sys.argv, os.getcwd(), os.environ['RMTEST_PROBE'], probe_module.VALUE)
        print('to stderr', file=sys.stderr)
        sys.exit(3)
    """, "a", "b", cwd=tmp_path)
    assert code == 3, stderr
    assert stdout.split("\n")[0] == f"True ['-c', 'a', 'b'] {tmp_path} 42 from PYTHONPATH"
    assert stderr == "to stderr\n"


def test_an_uncaught_exception_prints_its_traceback_and_exits_1(pool_env):
    code, _, stderr = run(pool_env, "raise ValueError('boom')")
    assert code == 1
    assert stderr.startswith("Traceback (most recent call last):\n  File \"<string>\", line 1")
    assert stderr.rstrip().endswith("ValueError: boom")


def test_a_rank_killed_by_a_signal_ends_its_client_by_the_same_signal(pool_env):
    code, _, _ = run(pool_env, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert code == -signal.SIGKILL


def test_signals_to_the_client_reach_the_rank(pool_env):
    process = start(pool_env, """
        import signal, sys, time
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))
        print('ready', flush=True)
        time.sleep(30)
    """)
    assert process.stdout.readline() == "ready\n"
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=20) == 7


@pytest.mark.parametrize("state", ["running", "stopped"])
def test_a_rank_dies_with_its_client(pool_env, state):
    """A stopped rank (as tests/test_failures.py makes one) cannot act on SIGIO: the zygote kills it."""
    process = start(pool_env, f"""
        import os, signal, time
        print(os.getpid(), flush=True)
        if {state!r} == "stopped":
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(60)
    """)
    rank = int(process.stdout.readline())
    process.kill()
    process.wait()
    deadline = time.monotonic() + 10
    while _alive(rank) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(rank), f"rank {rank} outlived its client"


def test_a_request_whose_start_up_variables_differ_runs_a_plain_python(pool_env):
    env = dict(pool_env, OMP_NUM_THREADS="2", RMTEST_WARM_POOL_DEBUG="1")
    code, stdout, stderr = run(env, "import sys; print('torch' in sys.modules)")
    assert (code, stdout) == (0, "False\n")
    assert "start-up variables differ: OMP_NUM_THREADS" in stderr


def test_a_variable_read_when_used_does_not_keep_a_request_from_the_pool(pool_env, tmp_path):
    env = dict(pool_env, TORCHINDUCTOR_CACHE_DIR=str(tmp_path))  # inductor sets it in the suite's process
    code, stdout, _ = run(env, "import os, sys; print('torch' in sys.modules, os.environ['TORCHINDUCTOR_CACHE_DIR'])")
    assert (code, stdout) == (0, f"True {tmp_path}\n")


def test_ranks_of_one_job_differ_in_hash_seed_and_random_state(pool_env):
    probe = "import random; print(hash('ringmaster'), random.random())"
    seen = [run(pool_env, probe, local_rank=rank)[1] for rank in (0, 1, 0)]
    assert len({line.split()[0] for line in seen[:2]}) == 2, seen  # two zygotes, two hash seeds
    assert len({line.split()[1] for line in seen}) == 3, seen  # every child reseeds


def test_launch_commands_are_rewritten_and_others_left_alone():
    python = sys.executable
    client = [python, "-S", warm_pool.CLIENT]
    assert warm_pool.rewrite(["mpirun", "-np", "2", python, "-c", "x"]) == ["mpirun", "-np", "2", *client, "-c", "x"]
    ringrun = [python, "-m", "ringmaster.launch", "-np", "2"]
    assert warm_pool.rewrite([*ringrun, python, "t.py"]) == [*ringrun, *client, "t.py"]
    assert warm_pool.rewrite([python, "-c", "x"]) == [python, "-c", "x"]
    assert warm_pool.rewrite(["sh", "-c", f"{python} x"]) == ["sh", "-c", f"{python} x"]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
