"""Start real ``mpirun`` jobs from tests, bounded in time, and always clean them up."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import warm_pool

#: Arguments every test job passes to Open MPI's mpirun: tests run as root in CI, on 2
#: cores, with 4 ranks (oversubscribed).
MPIRUN_ARGS = [
    "--allow-run-as-root",
    "--oversubscribe",
    "--bind-to", "none",
]


RANK_TAG = re.compile(r"^\[\d+\]: ")


@dataclass
class JobResult:
    """What a finished job printed and how it ended."""

    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def lines_starting(self, prefix: str):
        """The rest of each stdout line that starts with ``prefix``.

        ringrun's ``[rank]: `` tag is skipped, unless ``prefix`` is itself such a tag.
        """
        lines = self.stdout.splitlines()
        if not prefix.startswith("["):
            lines = (RANK_TAG.sub("", line, count=1) for line in lines)
        return [line[len(prefix):].strip() for line in lines if line.startswith(prefix)]


#: The job scripts' folder, on every job's PYTHONPATH: they share ``job_report``.
JOBS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "jobs")


#: What every test job's processes start with, to start faster (measured 2026-12-07, 2 cores):
#: - Open MPI's ofi BTL sleeps 1 s in every MPI_Init while it closes itself (no libfabric
#:   provider here): ``from mpi4py import MPI`` takes 1.11 s with it and 0.10 s without, in every
#:   rank of every job. tcp, sm and self stay, so the multi-host tests are unchanged.
#: - Ranks write the bytecode of ringmaster's modules once instead of compiling them again in
#:   every process (PYTHONDONTWRITEBYTECODE, where the shell sets it, is dropped; __pycache__
#:   is ignored by git): a rank's ``rm.init()`` went from 0.64 to 0.40 s.
#: A test's own ``env=``, or the shell's own setting, still overrides these.
FAST_START = {"OMPI_MCA_btl": "^ofi"}


def job_environment(extra: Optional[Mapping[str, str]] = None) -> dict:
    """The environment for a test job: ours, minus any coordinator of an outer job."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RINGMASTER_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [JOBS_DIR, env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    for name, value in FAST_START.items():
        env.setdefault(name, value)
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # see FAST_START
    if extra:
        env.update(extra)
    return env


#: The environment variable that marks every process of one test job.
JOB_MARK = "RMTEST_JOB_MARK"

#: How long a timed-out job gets to print its ranks' stacks before it is killed.
STACKS_GRACE_S = 3.0

#: What Open MPI's launcher prints when it could not start its PMIx server, before any rank
#: ran (seen once in a fresh-clone CI run on the busy 2-core machine). Nothing of ringmaster
#: ran in such a job, so it is started again, at most LAUNCH_RETRIES times.
LAUNCH_FAILURE = "listener thread failed to start"
LAUNCH_RETRIES = 2


def run_command(command: Sequence[str], timeout: float, env=None, cwd=None) -> JobResult:
    """Run ``command`` in its own process group; on timeout, ask for the ranks' stacks, then kill the group.

    A job whose launcher failed to start (:data:`LAUNCH_FAILURE`) is started again.
    """
    for _ in range(LAUNCH_RETRIES):
        result = _run_once(command, timeout, env, cwd)
        if not _launcher_failed(result):
            return result
    return _run_once(command, timeout, env, cwd)


def _launcher_failed(result: JobResult) -> bool:
    return result.returncode != 0 and not result.stdout and LAUNCH_FAILURE in result.stderr


#: Set to a file's path, every job appends a line to it: its test, its wall time and its command's
#: first words (how many jobs the suite starts, and where its time goes).
JOB_LOG = "RMTEST_JOB_LOG"


def _log_job(command: Sequence[str], seconds: float) -> None:
    path = os.environ.get(JOB_LOG)
    if path:
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
        with open(path, "a", encoding="utf-8") as log:
            words = " ".join(" ".join(command[:6]).split())  # one line, whatever the script holds
            log.write(f"{seconds:.2f}\t{test}\t{words[:160]}\n")


def _run_once(command: Sequence[str], timeout: float, env, cwd) -> JobResult:
    started = time.monotonic()
    try:
        return _run_bounded(command, timeout, env, cwd)
    finally:
        _log_job(command, time.monotonic() - started)


def _run_bounded(command: Sequence[str], timeout: float, env, cwd) -> JobResult:
    env = dict(env if env is not None else job_environment())
    if warm_pool.enabled():
        warm = warm_pool.rewrite(command)
        if warm != list(command):
            command = warm
            env.update(warm_pool.pool(job_environment()).client_environment())
    env[JOB_MARK] = uuid.uuid4().hex  # every process of the job inherits it: see _kill_group
    process = subprocess.Popen(
        list(command), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=env, cwd=cwd, start_new_session=True,
    )
    process.job_mark = env[JOB_MARK]
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stdout, stderr = stop_hung_job(process)
        raise AssertionError(
            f"job did not finish within {timeout}s: {' '.join(command)}\n"
            f"--- stdout ---\n{stdout}\n--- stderr ---\n{stderr}"
        ) from None
    finally:
        if process.poll() is None:
            _kill_group(process)
    _kill_group(process)  # stray children (a coordinator, orted) of a finished job
    return JobResult(process.returncode, stdout, stderr)


def stop_hung_job(process: subprocess.Popen):
    """Have every rank of a hung job print where its threads are, then kill the job; its (stdout, stderr).

    mpirun and ringrun pass SIGUSR1 on to the ranks (ringmaster.worker.runtime.stack_dumps).
    """
    try:
        os.kill(process.pid, signal.SIGUSR1)
        return process.communicate(timeout=STACKS_GRACE_S)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        _kill_group(process)
        return process.communicate()


def _kill_group(process: subprocess.Popen) -> None:
    """Kill the job's process group, and every process that carries its mark: Open MPI starts
    the ranks in sessions of their own, out of reach of the group."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    mark = getattr(process, "job_mark", None)
    if mark is None:
        return
    needle = f"{JOB_MARK}={mark}".encode()
    for pid in filter(str.isdigit, os.listdir("/proc") if os.path.isdir("/proc") else ()):
        try:
            with open(f"/proc/{pid}/environ", "rb") as environ:
                if needle in environ.read():
                    os.kill(int(pid), signal.SIGKILL)
        except (OSError, ValueError):
            pass  # gone already, or not ours to read


def mpirun(np: int, script: str, timeout: float = 120, env=None, args: Sequence[str] = ()) -> JobResult:
    """Run the Python source ``script`` on ``np`` ranks under plain ``mpirun``."""
    command = ["mpirun", *MPIRUN_ARGS, "-np", str(np), sys.executable, "-c",
               textwrap.dedent(script), *args]
    return run_command(command, timeout, env=job_environment(env))


def ringrun(np: int, script: str, timeout: float = 120, env=None, ringrun_args: Sequence[str] = (),
            args: Sequence[str] = ()) -> JobResult:
    """Run the Python source ``script`` (with ``args``) on ``np`` ranks under ``ringrun``."""
    command = [sys.executable, "-m", "ringmaster.launch", "-np", str(np), *ringrun_args,
               sys.executable, "-c", textwrap.dedent(script), *args]
    return run_command(command, timeout, env=job_environment(env))


def assert_job_passed(result: JobResult, np: int, section: Optional[str] = None) -> None:
    """A job of ``tests/jobs`` reporting through ``job_report.Tally`` passed on all ``np``
    ranks: no ``FAIL`` line, every rank's ``DONE`` with 0 failures, exit status 0, and, for
    a ``section``, its ``CASES`` line on every rank with a positive count."""
    failures = [line for line in result.stdout.splitlines() if line.startswith("FAIL ")]
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:40])
    if section is not None:
        counts = result.lines_starting(f"CASES {section} ")
        assert len(counts) == np and all(int(count) > 0 for count in counts), result.output[-4000:]
    done = result.lines_starting("DONE")
    assert len(done) == np and all(line.endswith(" 0 failures") for line in done), result.output[-4000:]
    assert result.returncode == 0, result.output[-4000:]
