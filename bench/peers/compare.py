"""ringmaster against Horovod 0.28.1 with one harness, jobs in turns, ratios in one run.

    bash bench/peers/build_horovod.sh                      # once: .venv-horovod (about 4 minutes)
    python bench/peers/compare.py --np 2 --rounds 3        # both, in turns, under that venv's mpirun

Runs ``bench/peers/burst.py`` (a Horovod benchmark script whose import is the only
difference) as Horovod and as ringmaster, alternately, ``--rounds`` times each, with the
venv's Python and ``mpirun`` (both frameworks on the same torch and MPI). Prints, per row,
the median over rounds of each job's median, raw mpi4py's (measured inside every job), and
ringmaster / Horovod (below 1: ringmaster is faster).
"""

import argparse
import collections
import os
import pathlib
import statistics
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent


def run_job(venv: pathlib.Path, framework: str, np: int, steps: int) -> dict:
    env = dict(os.environ, PATH=f"{venv / 'bin'}:{os.environ['PATH']}", OMP_NUM_THREADS="1",
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    command = [str(venv / "bin" / "mpirun"), "--oversubscribe", "-np", str(np), str(venv / "bin" / "python"),
               str(HERE / "burst.py"), "--framework", framework, "--steps", str(steps)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        sys.exit(f"{framework} job failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    rows = {}
    for line in done.stdout.splitlines():
        if line.startswith("ROW "):
            name, ours, mpi = (part.strip() for part in line[4:].split("|"))
            rows[name] = (float(ours), float(mpi))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--venv", default=str(HERE.parents[1] / ".venv-horovod"))
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    venv = pathlib.Path(args.venv)
    if not (venv / "bin" / "python").exists():
        sys.exit(f"no virtual environment at {venv}: run bash bench/peers/build_horovod.sh first")
    results = collections.defaultdict(lambda: collections.defaultdict(list))
    for round_ in range(args.rounds):
        order = ("horovod", "ringmaster") if round_ % 2 == 0 else ("ringmaster", "horovod")
        for framework in order:
            for row, (ours, mpi) in run_job(venv, framework, args.np, args.steps).items():
                results[row][framework].append(ours)
                results[row]["mpi"].append(mpi)
        print(f"round {round_ + 1} of {args.rounds} done", file=sys.stderr, flush=True)
    load = open("/proc/loadavg").read().split()[0]
    print(f"\n{args.np} ranks, {args.rounds} rounds of each (jobs in turns), load average {load}; "
          f"medians in ms (each job's median of {args.steps} steps, then the median over jobs)")
    print(f"{'row':<20} {'Horovod':>9} {'ringmaster':>11} {'raw MPI':>9} {'rm / Horovod':>13} {'rm / MPI':>9}")
    for row, by in results.items():
        horovod, ours, mpi = (statistics.median(by[key]) for key in ("horovod", "ringmaster", "mpi"))
        print(f"{row:<20} {horovod:9.3f} {ours:11.3f} {mpi:9.3f} {ours / horovod:13.2f} {ours / mpi:9.2f}")
    print("\nevery job, ms (Horovod | ringmaster):")
    for row, by in results.items():
        horovod, ours = (" ".join(f"{value:.3f}" for value in by[key]) for key in ("horovod", "ringmaster"))
        print(f"{row:<20} {horovod} | {ours}")


if __name__ == "__main__":
    main()
