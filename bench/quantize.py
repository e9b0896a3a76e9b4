"""Throughput of the 8-bit codecs (ringmaster.worker.compression.quantization) against a float32 copy.

Run it directly, no MPI::

    python bench/quantize.py                          # 1M and 16M elements, 1 and all threads
    python bench/quantize.py --sizes 4M --threads 1,4 --reps 9
    python bench/quantize.py --device cuda

Each cell is a median over ``--reps`` timed calls (after one untimed call; the calls of
all cells of a size and thread count take turns) in GB/s of float32 input, 4 bytes per
element: encode (tensor -> codes and absmax), decode (codes -> float32 tensor) and both
in a row. The baseline, shown in all three columns, is ``torch.Tensor.copy_`` of the
same float32 tensor into a preallocated one. The row "dynamic tree, bucketize" times the
per-element binary search (``nearest_codes``) that the encoder's table lookup replaces.
Progress goes to stderr, the table to stdout.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from ringmaster.worker.compression import quantization as q

UNITS = {"K": 1024, "M": 1024 ** 2, "G": 1024 ** 3}


def parse_count(text: str) -> int:
    text = text.strip().upper()
    return int(float(text[:-1]) * UNITS[text[-1]]) if text[-1:] in UNITS else int(text)


def format_count(count: int) -> str:
    for unit in ("G", "M", "K"):
        if count >= UNITS[unit] and count % UNITS[unit] == 0:
            return f"{count // UNITS[unit]}{unit}"
    return str(count)


def median_seconds(functions: dict, reps: int, device: torch.device) -> dict:
    """Median wall time of each of ``functions`` over ``reps`` calls, after one untimed call.

    The functions take turns within every repetition, so that load from other processes
    on the machine falls on all of them alike.
    """
    def timed(function) -> float:
        start = time.perf_counter()
        function()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    times = {name: [] for name in functions}
    for rep in range(reps + 1):
        for name, function in functions.items():
            elapsed = timed(function)
            if rep:
                times[name].append(elapsed)
    return {name: statistics.median(t) for name, t in times.items()}


def bucketize_encode(x: torch.Tensor):
    """Dynamic tree codes by one binary search per element (the reference definition)."""
    absmax = x.abs().amax()
    magnitude = q.nearest_codes(x.abs() / absmax, q.dynamic_tree_values()).to(torch.uint8)
    return magnitude | (torch.signbit(x).to(torch.uint8) << 7), absmax


def rows_for(x: torch.Tensor, reps: int):
    """(codec, encode s, decode s, round trip s) for the copy, both codecs and the reference."""
    target = torch.empty_like(x)
    functions = {("float32 copy_", "copy"): lambda: target.copy_(x),
                 ("dynamic tree, bucketize", "encode"): lambda: bucketize_encode(x)}
    for name, encode, decode in (("dynamic tree", q.encode_dynamic_tree, q.decode_dynamic_tree),
                                 ("linear8", q.encode_linear8, q.decode_linear8)):
        codes, absmax = encode(x)
        functions[name, "encode"] = lambda encode=encode: encode(x)
        functions[name, "decode"] = lambda decode=decode, codes=codes, absmax=absmax: decode(codes, absmax)
        functions[name, "enc+dec"] = lambda encode=encode, decode=decode: decode(*encode(x))
    seconds = median_seconds(functions, reps, x.device)
    yield ("float32 copy_", *[seconds["float32 copy_", "copy"]] * 3)
    for name in ("dynamic tree", "linear8", "dynamic tree, bucketize"):
        yield (name, *(seconds.get((name, column)) for column in ("encode", "decode", "enc+dec")))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1M,16M", help="comma-separated element counts (K/M suffixes)")
    parser.add_argument("--threads", default="1,all", help="comma-separated torch thread counts ('all': the default)")
    parser.add_argument("--reps", type=int, default=9, help="timed calls per cell")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    all_threads = torch.get_num_threads()
    threads = [all_threads if t.strip() == "all" else int(t) for t in args.threads.split(",")]
    print(f"# torch {torch.__version__} on {device}; all = {all_threads} threads; "
          f"GB/s of float32 input, median of {args.reps}")
    header = f"{'elements':>8} {'threads':>7}  {'codec':<24} {'encode':>8} {'decode':>8} {'enc+dec':>8}"
    print(header)
    print("-" * len(header), flush=True)

    def cell(seconds, nbytes):
        return f"{'-':>8}" if seconds is None else f"{nbytes / seconds / 1e9:8.3f}"

    for count in (parse_count(s) for s in args.sizes.split(",")):
        x = torch.randn(count, generator=torch.Generator().manual_seed(0)).to(device)
        for thread_count in threads:
            torch.set_num_threads(thread_count)
            print(f"timing {format_count(count)} elements, {thread_count} thread(s)...", file=sys.stderr, flush=True)
            for name, *seconds in rows_for(x, args.reps):
                cells = " ".join(cell(s, 4 * count) for s in seconds)
                print(f"{format_count(count):>8} {thread_count:>7}  {name:<24} {cells}", flush=True)
    torch.set_num_threads(all_threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
