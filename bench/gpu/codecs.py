"""Compression on a GPU: the 8-bit codecs against a float16 cast, and RGC's selections
against torch.topk, on one tensor, in one run.

    python bench/gpu/codecs.py                                  # 64 Mi float32 on cuda
    python bench/gpu/codecs.py --numel 16M --ratio 0.01 --reps 15
    python bench/gpu/codecs.py --device cpu --numel 1000000     # a smoke run without a GPU

Codecs: ``Compression.int8`` (dynamic tree) and ``Compression.linear8``, i.e.
``quantization.encode_blocks`` / ``decode_blocks`` with one absmax per 4096 elements, on
seeded N(0, 1) float32. "GB/s" is float32 data per second (4 bytes per element, for the cast
too); "moved GB/s" counts every byte read and written (cast 4 + 2 per element, encode 4 + 1,
decode 1 + 4), to set against the device's copy bandwidth; "x cast" is the time of a
float32 -> float16 cast (``x.to(torch.float16)``) of the same tensor, measured in the same
run, over the codec's time (1.0: as fast as the cast).

Selection: k = ceil(ratio * n) entries of the same values, against
``torch.topk(values.abs(), k, sorted=False)``. "threshold search" is a call with a fresh
state (it searches), "threshold reuse" one that reuses the searched threshold (5 of every 6
calls in training), "threshold, 1 search + 5 reuses" their mean over a reuse cycle, then
"trimmed top-k" and "sampled search" (``compression/selection.py``; on a GPU its device path,
``device_selection.py``). "x topk" is torch.topk's time over the method's (the goal on an
H100 is >= 3); "selected/k" the median number of indices returned over k.

Each table is printed twice (``--kernels fused,torch``): with the Triton kernels of
``fused_scan`` / ``fused_codecs`` where they run, and with torch operations only, the path
a machine without Triton takes.

Every figure is a median over ``--reps`` timed calls after two untimed ones, the calls taking
turns within every repetition. On CUDA a call starts after a synchronize and is timed with
CUDA events up to its end (the device path's one read back to the host is inside the time).
Under 60 s on an H100 with the defaults. Progress goes to stderr, the tables to stdout.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import torch

from ringmaster.worker.compression import fused_scan
from ringmaster.worker.compression import quantization as q
from ringmaster.worker.compression import selection

UNITS = {"K": 1024, "M": 1024 ** 2, "G": 1024 ** 3}


def parse_count(text: str) -> int:
    text = text.strip().upper()
    return int(float(text[:-1]) * UNITS[text[-1]]) if text[-1:] in UNITS else int(text)


def progress(text: str) -> None:
    print(f"[bench] {text}", file=sys.stderr, flush=True)


def call_timer(device: torch.device):
    """``seconds(function)``: the time of one call of ``function`` on ``device``."""
    if device.type != "cuda":
        def seconds(function) -> float:
            start = time.perf_counter()
            function()
            return time.perf_counter() - start
        return seconds

    def seconds(function) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        function()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    return seconds


def medians(functions: dict, reps: int, device: torch.device) -> tuple[dict, dict]:
    """Median seconds of each of ``functions`` and the median size of what it returned,
    over ``reps`` calls after two untimed ones; the functions take turns every repetition."""
    seconds = call_timer(device)
    times = {name: [] for name in functions}
    sizes = {name: [] for name in functions}
    for rep in range(reps + 2):
        for name, function in functions.items():
            result = []
            elapsed = seconds(lambda function=function: result.append(function()))
            if rep >= 2:
                times[name].append(elapsed)
                sizes[name].append(_size(result[0]))
    return ({name: statistics.median(t) for name, t in times.items()},
            {name: statistics.median(s) for name, s in sizes.items()})


def _size(result) -> int:
    if isinstance(result, tuple):
        result = result[0]
    return result.numel() if isinstance(result, torch.Tensor) else 0


def codec_rows(values: torch.Tensor, reps: int):
    """(name, seconds, bytes moved per element) for the cast and both codecs' directions."""
    functions = {"fp32->fp16 cast": lambda: values.to(torch.float16)}
    moved = {"fp32->fp16 cast": 6}
    for name, kind in (("int8", "dynamic tree"), ("linear8", "linear8")):
        codes, absmax = q.encode_blocks(values, kind)
        functions[f"{name} encode"] = lambda kind=kind: q.encode_blocks(values, kind)
        functions[f"{name} decode"] = lambda kind=kind, codes=codes, absmax=absmax: q.decode_blocks(
            codes, absmax, torch.float32, kind)
        moved[f"{name} encode"] = moved[f"{name} decode"] = 5
    seconds, _ = medians(functions, reps, values.device)
    return [(name, seconds[name], moved[name]) for name in functions]


def selection_rows(values: torch.Tensor, k: int, reps: int):
    """(name, seconds, selected) for torch.topk and each selection method."""
    searched = selection.ThresholdState()
    selection.threshold_binary_search(values, k, searched)
    generator = torch.Generator(device=values.device).manual_seed(0)

    def reuse():
        searched.reuses_left = selection.REUSE_INTERVAL
        return selection.threshold_binary_search(values, k, searched)

    functions = {
        "torch.topk": lambda: torch.topk(values.abs(), k, sorted=False).indices,
        "threshold search": lambda: selection.threshold_binary_search(values, k),
        "threshold reuse": reuse,
        "trimmed top-k": lambda: selection.trimmed_topk(values, k),
        "sampled search": lambda: selection.sampled_threshold_search(values, k, generator=generator),
    }
    seconds, sizes = medians(functions, reps, values.device)
    cycle = (seconds["threshold search"] + selection.REUSE_INTERVAL * seconds["threshold reuse"]) \
        / (1 + selection.REUSE_INTERVAL)
    rows = [(name, seconds[name], sizes[name]) for name in functions]
    rows.insert(3, (f"threshold, 1 search + {selection.REUSE_INTERVAL} reuses", cycle, None))
    return rows


def print_codecs(rows, numel: int) -> None:
    cast = rows[0][1]
    header = f"{'codec':<34} {'ms':>9} {'GB/s':>9} {'moved GB/s':>11} {'x cast':>7}"
    print(header)
    print("-" * len(header))
    for name, seconds, moved in rows:
        print(f"{name:<34} {seconds * 1e3:9.3f} {4 * numel / seconds / 1e9:9.1f} "
              f"{moved * numel / seconds / 1e9:11.1f} {cast / seconds:7.2f}")


def print_selection(rows, k: int) -> None:
    topk = rows[0][1]
    header = f"{'selection':<34} {'ms':>9} {'x topk':>9} {'selected/k':>11}"
    print(header)
    print("-" * len(header))
    for name, seconds, selected in rows:
        share = f"{selected / k:11.2f}" if selected is not None else f"{'-':>11}"
        print(f"{name:<34} {seconds * 1e3:9.3f} {topk / seconds:9.2f} {share}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu (a smoke run)")
    parser.add_argument("--numel", default="64M", help="float32 elements (K/M suffixes are powers of 1024)")
    parser.add_argument("--ratio", type=float, default=0.001, help="selection ratio, k = ceil(ratio * numel)")
    parser.add_argument("--reps", type=int, default=9, help="timed calls per row")
    parser.add_argument("--kernels", default="fused,torch",
                        help="comma-separated: fused (Triton kernels where they run), torch (torch operations)")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"codecs.py: --device {args.device} asked for, but no CUDA device is visible to torch "
              f"{torch.__version__} (CUDA build: {torch.version.cuda}); use --device cpu for a smoke run",
              file=sys.stderr)
        return 2
    numel = parse_count(args.numel)
    k = math.ceil(args.ratio * numel)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "host"
    generator = torch.Generator(device=device).manual_seed(0)
    values = torch.randn(numel, generator=generator, device=device)
    print(f"# torch {torch.__version__} on {device} ({name}); {numel:,} float32 ({4 * numel / 2**20:,.0f} MiB) "
          f"of N(0,1); median of {args.reps}")

    for kernels in args.kernels.split(","):
        fused_scan.ENABLED = kernels == "fused"
        print(f"## {kernels}: " + ("Triton kernels where they run (fused_scan, fused_codecs)" if fused_scan.ENABLED
                                   else "torch operations only"))
        progress(f"codecs on {numel:,} elements, {kernels}")
        print_codecs(codec_rows(values, args.reps), numel)
        print()
        progress(f"selection of k = {k:,}, {kernels}")
        print(f"# k = {k:,} (ratio {args.ratio:g})")
        print_selection(selection_rows(values, k, args.reps), k)
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
