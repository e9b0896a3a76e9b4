"""Top-k selection speed: ringmaster.worker.compression.selection's methods vs torch.topk on |V|.

    python bench/selection.py                                  # 1, 16 and 64 Mi float32
    python bench/selection.py --sizes 256K,1M,2M,4M,8M --threads 1
    python bench/selection.py --dist uniform --ratio 0.01
    python bench/selection.py --device cuda                    # on a machine with a GPU

For each size n the values are seeded samples (standard normal by default, as residuals
roughly are; ``--dist uniform`` as in the paper's Figure 1) and k = ratio * n. The methods
take turns within every repetition, so load from other processes on a shared machine hits
all of them alike, and the table shows medians. ``torch.topk`` is timed as
``torch.topk(values.abs(), k, sorted=False)``, abs included, since every method takes the
magnitude itself. "threshold, search" is a call with a fresh state (it always searches);
"threshold, reuse" a call that reuses the searched threshold (4 of 5 calls in training).
"selected/k" is the median number of indices returned over k. Progress goes to stderr.

The size cut-offs of ``select(method="auto")`` (``EXACT_BELOW``, ``SAMPLED_FROM`` in
``worker/compression/selection.py``) come from ``--sizes 64K,128K,256K,512K,1M,2M,4M,8M --threads 1``:
torch.topk keeps up with trimmed top-k while |V| fits in cache (to about 128 Ki elements
it is as fast, to 1 Mi at most ~1.4x slower) and falls 4-5x behind from 2 Mi; the sampled
search is 2x faster than trimmed top-k from 4 Mi on.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from ringmaster.worker.compression import selection

UNITS = {"K": 1024, "M": 1024 ** 2, "G": 1024 ** 3}


def parse_size(text: str) -> int:
    text = text.strip().upper()
    if text and text[-1] in UNITS:
        return int(float(text[:-1]) * UNITS[text[-1]])
    return int(text)


def format_size(n: int) -> str:
    for unit in ("G", "M", "K"):
        if n >= UNITS[unit] and n % UNITS[unit] == 0:
            return f"{n // UNITS[unit]} {unit}i"
    return str(n)


def progress(text: str) -> None:
    print(f"[bench] {text}", file=sys.stderr, flush=True)


def make_values(n: int, dist: str, device: str) -> torch.Tensor:
    generator = torch.Generator().manual_seed(n)
    values = torch.randn(n, generator=generator) if dist == "normal" else torch.rand(n, generator=generator)
    return values.to(device)


def methods(values: torch.Tensor, k: int) -> dict:
    """name -> a call returning the selected indices (setup that is not timed goes before)."""
    state = selection.ThresholdState()
    selection.threshold_binary_search(values, k, state)
    generator = torch.Generator(device=values.device).manual_seed(0)

    def reuse():
        state.reuses_left = selection.REUSE_INTERVAL
        return lambda: selection.threshold_binary_search(values, k, state)[0]

    return {
        "torch.topk": lambda: lambda: torch.topk(values.abs(), k, sorted=False).indices,
        "trimmed top-k": lambda: lambda: selection.trimmed_topk(values, k),
        "threshold, search": lambda: lambda: selection.threshold_binary_search(values, k)[0],
        "threshold, reuse": reuse,
        "sampled search": lambda: lambda: selection.sampled_threshold_search(values, k, generator=generator),
    }


def time_interleaved(calls: dict, reps: int, device: str, label: str) -> dict:
    """name -> (median seconds, median count selected), the calls taking turns."""
    times = {name: [] for name in calls}
    counts = {name: [] for name in calls}
    for rep in range(reps + 1):  # the first round warms up and is not counted
        progress(f"{label}: repetition {rep}/{reps}")
        for name, prepare in calls.items():
            call = prepare()
            if device != "cpu":
                torch.cuda.synchronize()
            start = time.perf_counter()
            indices = call()
            if device != "cpu":
                torch.cuda.synchronize()
            if rep:
                times[name].append(time.perf_counter() - start)
                counts[name].append(indices.numel())
    return {name: (statistics.median(times[name]), statistics.median(counts[name])) for name in calls}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1M,16M,64M", help="comma-separated element counts (K/M suffixes)")
    parser.add_argument("--ratio", type=float, default=0.001, help="k = ratio * n")
    parser.add_argument("--reps", type=int, default=5, help="timed calls per method and size")
    parser.add_argument("--threads", default="1,all", help="comma-separated torch thread counts ('all': every core)")
    parser.add_argument("--dist", choices=("normal", "uniform"), default="normal")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)

    sizes = [parse_size(s) for s in args.sizes.split(",")]
    cores = os.cpu_count() or 1
    thread_counts = [cores if t == "all" else int(t) for t in args.threads.split(",")]
    print(f"# torch {torch.__version__}, device {args.device}, {cores} cores, {args.dist} float32, "
          f"k = {args.ratio:g} * n, median of {args.reps}")
    header = f"{'size':>7} | {'threads':>7} | {'method':<17} | {'median ms':>10} | {'vs topk':>7} | {'selected/k':>10}"
    print(header)
    print("-" * len(header))
    for threads in thread_counts:
        torch.set_num_threads(threads)
        for n in sizes:
            k = max(1, int(args.ratio * n))
            values = make_values(n, args.dist, args.device)
            results = time_interleaved(methods(values, k), args.reps, args.device,
                                       f"{format_size(n)}, {threads} thread(s)")
            baseline = results["torch.topk"][0]
            for name, (seconds, count) in results.items():
                print(f"{format_size(n):>7} | {threads:>7} | {name:<17} | {seconds * 1e3:10.2f} | "
                      f"{baseline / seconds:6.1f}x | {count / k:10.2f}", flush=True)
            del values
    return 0


if __name__ == "__main__":
    sys.exit(main())
