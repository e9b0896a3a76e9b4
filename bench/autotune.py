"""Autotuning on vs off: bench/train.py's training throughput, jobs taking turns, in one run.

    python bench/autotune.py                               # 3 pairs, gradient plan on and off
    python bench/autotune.py --pairs 5 --plan off -- --models mlp --warmup 250

Autotuning is a per-job setting, so the two sides cannot share a job: this script starts
``ringrun -np 2 python bench/train.py ...`` alternately without and with
``RINGMASTER_AUTOTUNE=1`` (which goes first alternates too), ``--pairs`` times for each
gradient-plan setting, and reads the ``ringmaster`` rows. train.py's untimed warmup runs
each mode's steps back to back (``--warmup 250`` by default here), so the autotuner
(10 steps per sample) is done before the timed rounds, which then measure what it chose.
Prints, per model and plan setting, the median over the pairs of ringmaster's throughput
relative to no-comm (train.py's ``vs no-comm``, which cancels load that hits the whole job)
with and without autotuning, their ratio, and the settings the autotuner chose (rank 0's
CSV, ``RINGMASTER_AUTOTUNE_LOG``).
"""

import argparse
import csv
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
ROW = re.compile(r"^(?:\[\d+\]: )?(\w+)\s+[\d.]+M\s+(\S+)\s+([\d.]+)\s+(\d+)\s+([\d.]+)\s*$")


def run_train(train_args, autotune, plan, log_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RINGMASTER_")}
    env["RINGMASTER_GRADIENT_PLAN"] = "1" if plan == "on" else "0"
    if autotune:
        env.update(RINGMASTER_AUTOTUNE="1", RINGMASTER_AUTOTUNE_LOG=str(log_path))
    command = [sys.executable, "-m", "ringmaster.launch", "-np", "2", sys.executable,
               str(ROOT / "bench" / "train.py"), *train_args]
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
    found = {}  # model -> (ringmaster step ms, its throughput vs no-comm, no-comm step ms)
    for line in done.stdout.splitlines():
        match = ROW.match(line.strip())
        if match:
            model, mode, step_ms, ratio = match.group(1), match.group(2), float(match.group(3)), float(match.group(5))
            entry = found.setdefault(model, [None, None, None])
            if mode == "ringmaster":
                entry[0], entry[1] = step_ms, ratio
            elif mode == "no-comm":
                entry[2] = step_ms
    return {model: tuple(entry) for model, entry in found.items()}


def chosen(log_path):
    if not log_path.exists():
        return "no samples"
    rows = list(csv.DictReader(log_path.open()))
    final = [row for row in rows if row["phase"] == "final"]
    samples = len([row for row in rows if row["phase"] != "final"])
    if not final:
        return f"not finished ({samples} samples)"
    row = final[0]
    return (f"fusion {int(row['fusion_threshold_bytes']) >> 20} MiB, cycle {row['cycle_time_ms']} ms, "
            f"ring from {int(row['ring_min_bytes']) >> 10} KiB, cache {row['cache_enabled']} ({samples} samples)")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--plan", choices=("on", "off", "both"), default="both",
                        help="RINGMASTER_GRADIENT_PLAN of the jobs (default: both, one after the other)")
    parser.add_argument("train_args", nargs="*", help="bench/train.py's arguments (after --)",
                        default=["--models", "mlp", "--warmup", "250"])
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for plan in (("on", "off") if args.plan == "both" else (args.plan,)):
            for pair in range(args.pairs):
                for autotune in ((False, True) if pair % 2 == 0 else (True, False)):
                    log_path = pathlib.Path(tmp) / f"tune.{plan}.{pair}.csv"
                    print(f"[autotune bench] plan {plan}, pair {pair + 1}/{args.pairs}, autotune "
                          f"{'on' if autotune else 'off'}", file=sys.stderr, flush=True)
                    for model, measured in run_train(args.train_args, autotune, plan, log_path).items():
                        entry = results.setdefault((model, plan), {"off": [], "on": [], "chosen": []})
                        entry["on" if autotune else "off"].append(measured)
                        if autotune:
                            entry["chosen"].append(chosen(log_path))
    print(f"\nbench/train.py {' '.join(args.train_args)}, 2 ranks, {args.pairs} jobs each way, taking turns; "
          f"per job: ringmaster's median step ms / its throughput vs no-comm's in the same job / no-comm's step ms")
    for (model, plan), entry in results.items():
        for side in ("off", "on"):
            runs = entry[side]
            print(f"{model} plan {plan} autotune {side:<3}: "
                  + "; ".join(f"{a:.1f} / {b:.2f} / {c:.1f}" for a, b, c in runs)
                  + f"  -> medians {statistics.median(r[0] for r in runs):.1f} ms / "
                    f"{statistics.median(r[1] for r in runs):.2f} / {statistics.median(r[2] for r in runs):.1f} ms")
        off, on = entry["off"], entry["on"]
        print(f"{model} plan {plan}: autotune / defaults, median step ms "
              f"{statistics.median(r[0] for r in on) / statistics.median(r[0] for r in off):.3f}, "
              f"median vs-no-comm ratio "
              f"{statistics.median(r[1] for r in on) / statistics.median(r[1] for r in off):.3f}")
        for choice in entry["chosen"]:
            print(f"    chose: {choice}")


if __name__ == "__main__":
    main()
