"""How late a host agent's heartbeats arrive on a loaded host: what chose RINGMASTER_HOST_TIMEOUT_S.

    python bench/host_beats.py --runs 5          # 8-rank stress jobs on this machine's cores
    python bench/host_beats.py --runs 0 --idle-s 30   # the same probe with nothing else running

A coordinator (``ringmaster.coordinator.server.Coordinator``, in this process, so that it is as
starved as the job's own would be) and a real host agent (``python -m
ringmaster.coordinator.host_agent``, beating every second) run beside ``--runs`` jobs of the
8-rank stress test of ``tests/test_response_cache.py`` (``ringrun -np 8 python -c
tests/jobs/cache_stress.py 12 8``: on 2 cores, 4 ranks a core). The agent watches a sleeping
process as its "rank", so it keeps beating. Printed per job: its exit status and time, how
many beats the coordinator received, the largest gap between two of them, and how many gaps
exceeded 4, 8 and 10 s. A gap over the host timeout would be a false death of a live host.
The agent's own watch on the coordinator is off (``RINGMASTER_HOST_TIMEOUT_S=0`` in its
environment), so that it measures without ending anything.
"""

from __future__ import annotations

import argparse
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

from ringmaster.common.config import Config
from ringmaster.coordinator.server import Coordinator

ROOT = Path(__file__).resolve().parent.parent
STRESS = ROOT / "tests" / "jobs" / "cache_stress.py"
THRESHOLDS_S = (4.0, 8.0, 10.0)


class BeatLog:
    """Arrival times of the agent's beats, as the coordinator's loop handles them."""

    def __init__(self, coordinator: Coordinator):
        self.times = []
        original = coordinator.host_beat

        def beat(value: str) -> None:
            self.times.append(time.monotonic())
            original(value)

        coordinator.host_beat = beat

    def window(self, start: float, end: float):
        """Beats in [start, end] and the gaps between them (the first counted from ``start``)."""
        beats = [t for t in self.times if start <= t <= end]
        edges = [start, *beats, end]
        return beats, [b - a for a, b in zip(edges, edges[1:])]


def run_stress(timeout: float) -> tuple:
    command = [sys.executable, "-m", "ringmaster.launch", "-np", "8", sys.executable, "-c",
               STRESS.read_text(), "12", "8"]
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    started = time.monotonic()
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=str(ROOT))
        status = result.returncode
    except subprocess.TimeoutExpired:
        status = "timeout"
    return status, time.monotonic() - started


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="8-rank stress jobs to run (default 5)")
    parser.add_argument("--idle-s", type=float, default=0.0, help="also measure this long with no job")
    parser.add_argument("--timeout", type=float, default=200.0, help="per job")
    args = parser.parse_args(argv)
    secret = secrets.token_hex(32)
    coordinator = Coordinator(1, secret, Config(secret=secret)).start()
    beats = BeatLog(coordinator)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1e6)"])
    agent = subprocess.Popen(
        [sys.executable, "-m", "ringmaster.coordinator.host_agent", "--coordinator", coordinator.address,
         "--host", "probe", "--ranks", f"0:{sleeper.pid}"],
        env=dict(os.environ, RINGMASTER_SECRET=secret, RINGMASTER_HOST_TIMEOUT_S="0"))
    try:
        deadline = time.monotonic() + 30
        while not beats.times and time.monotonic() < deadline:
            time.sleep(0.1)
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=str(ROOT)).stdout.strip()
        print(f"host agent beats on {os.cpu_count()} cores, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
              f"commit {commit}")
        print(f"{'run':>8} {'status':>7} {'time s':>7} {'beats':>6} {'max gap s':>10} "
              + " ".join(f"{'>' + format(t, 'g') + ' s':>6}" for t in THRESHOLDS_S))
        rows = []
        if args.idle_s > 0:
            start = time.monotonic()
            time.sleep(args.idle_s)
            rows.append(("idle", "-", start, time.monotonic()))
        for run in range(args.runs):
            start = time.monotonic()
            status, _ = run_stress(args.timeout)
            rows.append((f"8 ranks {run + 1}", status, start, time.monotonic()))
        worst = 0.0
        for name, status, start, end in rows:
            got, gaps = beats.window(start, end)
            worst = max(worst, max(gaps))
            print(f"{name:>8} {status!s:>7} {end - start:7.1f} {len(got):6d} {max(gaps):10.2f} "
                  + " ".join(f"{sum(g > t for g in gaps):6d}" for t in THRESHOLDS_S))
        print(f"largest gap over all runs: {worst:.2f} s")
    finally:
        agent.kill()
        sleeper.kill()
        coordinator.stop(0.1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
