"""tests/mpijob.py itself: a job whose launcher failed to start is started again, nothing else is."""

from __future__ import annotations

import os
import time

import pytest
from mpijob import LAUNCH_FAILURE, LAUNCH_RETRIES, run_command

pytestmark = pytest.mark.timeout(30)


def counting_job(tmp_path, failing_runs: int, message: str):
    """A shell command that fails with ``message`` on its first ``failing_runs`` runs, then prints OK."""
    runs = tmp_path / "runs"
    script = (f'echo x >> "{runs}"; '
              f'if [ "$(wc -l < "{runs}")" -le {failing_runs} ]; then echo "{message}" >&2; exit 213; fi; '
              'echo OK')
    return ["sh", "-c", script], runs


def test_a_job_whose_launcher_failed_to_start_runs_again(tmp_path):
    command, runs = counting_job(tmp_path, 1, f"The PMIx server's {LAUNCH_FAILURE}. We cannot continue.")
    result = run_command(command, timeout=10)
    assert result.returncode == 0 and result.stdout.strip() == "OK", result
    assert len(runs.read_text().splitlines()) == 2


def test_it_is_started_a_bounded_number_of_times(tmp_path):
    command, runs = counting_job(tmp_path, 100, f"The PMIx server's {LAUNCH_FAILURE}. We cannot continue.")
    result = run_command(command, timeout=10)
    assert result.returncode == 213 and LAUNCH_FAILURE in result.stderr
    assert len(runs.read_text().splitlines()) == LAUNCH_RETRIES + 1


def test_a_job_that_failed_otherwise_is_not_run_again(tmp_path):
    command, runs = counting_job(tmp_path, 1, "rank 1: ValueError")
    result = run_command(command, timeout=10)
    assert result.returncode == 213 and "ValueError" in result.stderr
    assert len(runs.read_text().splitlines()) == 1


def test_a_timed_out_job_leaves_no_process_behind_even_outside_its_group(tmp_path):
    """``setsid`` puts the sleeper in a session of its own, as Open MPI does with ranks."""
    pid_file = tmp_path / "pid"
    command = ["sh", "-c", f'setsid sh -c \'echo $$ > "{pid_file}"; exec sleep 600\' & wait']
    with pytest.raises(AssertionError, match="did not finish"):
        run_command(command, timeout=2)
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 10  # SIGKILL is sent; the process still has to die and be reaped
    while os.path.exists(f"/proc/{pid}") and not _is_zombie(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{pid}") or _is_zombie(pid), f"process {pid} is still running"


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] == "Z"
    except FileNotFoundError:  # gone meanwhile
        return True
