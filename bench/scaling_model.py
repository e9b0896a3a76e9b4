"""A cost model of one data-parallel training step at 64 to 1,024 ranks (docs/scaling.md).

    python bench/scaling_model.py                                  # the defaults of docs/scaling.md
    python bench/scaling_model.py --control-plane out.json         # with bench/control_plane.py's figures
    python bench/scaling_model.py --alpha-us 5 --link-gbits 100    # another network

A step computes for ``compute_ms`` (forward and backward at the batch per GPU; backward is
``backward_share`` of it) and reduces ``gradient_mb`` of float32 gradients, fused into
buffers of ``fusion_mb``. Per buffer of M bytes over N ranks, with α the latency of one
message and β the time per byte on the link (the classic model, as in Gibiansky's post):

    ring  (scatter-reduce + allgather, 2 (N-1) steps):   2 (N-1) α + 2 (N-1)/N M β
    tree  (recursive halving + doubling, 2 log2 N steps): 2 log2(N) α + 2 (N-1)/N M β
    hierarchical ring (G GPUs per host share a fast bus; the ring runs between hosts):
          2 (N/G - 1) α + 2 (N/G - 1)/(N/G) M β  (+ the bus's reduce and broadcast, not counted)

The control plane adds, per step, either the coordinator's negotiation (no response cache:
``bench/control_plane.py``'s measured p50 at N, interpolated on a log scale, else an
assumed figure) or, with the response cache in steady state, one allreduce of the cache's
bit vector per cycle (a 4-byte-per-slot MPI allreduce: 2 log2(N) α, since it is tiny).

Communication overlaps the backward pass: the fused buffers become ready one after the
other, evenly spread over backward (buffer i of B at (i + 1)/B of it), and are reduced one
at a time in that order; what is exposed is how far the last reduction ends after backward.
The last buffer can never be hidden, so fewer, larger buffers expose more. Scaling
efficiency = compute / (compute + exposed communication + control plane).
"""

from __future__ import annotations

import argparse
import json
import math


def ring_ms(size: int, megabytes: float, alpha_us: float, beta_ns: float) -> float:
    return (2 * (size - 1) * alpha_us * 1e-3) + (2 * (size - 1) / size * megabytes * 1e6 * beta_ns * 1e-6)


def tree_ms(size: int, megabytes: float, alpha_us: float, beta_ns: float) -> float:
    return (2 * math.log2(size) * alpha_us * 1e-3) + (2 * (size - 1) / size * megabytes * 1e6 * beta_ns * 1e-6)


def interpolated(points: dict, size: int) -> float:
    """A measured figure at ``size``: log-log interpolation between measured sizes, the
    slope of the last two beyond them."""
    sizes = sorted(points)
    if size in points:
        return points[size]
    if len(sizes) == 1:
        return points[sizes[0]]
    lower = max([s for s in sizes if s < size], default=sizes[0])
    upper = min([s for s in sizes if s > size], default=sizes[-1])
    if lower == upper:
        lower, upper = sizes[-2], sizes[-1]
    slope = math.log(points[upper] / points[lower]) / math.log(upper / lower)
    return points[lower] * (size / lower) ** slope


def model(args, size: int, negotiation: dict) -> dict:
    buffers = max(1, math.ceil(args.gradient_mb / args.fusion_mb))
    per_buffer = args.gradient_mb / buffers
    beta_ns = 8 / args.link_gbits  # ns per byte
    ring = buffers * ring_ms(size, per_buffer, args.alpha_us, beta_ns)
    tree = buffers * tree_ms(size, per_buffer, args.alpha_us, beta_ns)
    hosts = max(1, size // args.gpus_per_host)
    hierarchical = buffers * ring_ms(hosts, per_buffer, args.alpha_us, beta_ns) if hosts > 1 else 0.0
    uncached = interpolated(negotiation, size) if negotiation else args.negotiation_ms
    cached = 2 * math.log2(size) * args.alpha_us * 1e-3
    backward = args.backward_share * args.compute_ms

    def efficiency(comm: float, control: float) -> float:
        per_buffer_ms, end = comm / buffers, 0.0
        for index in range(buffers):
            end = max(end, (index + 1) / buffers * backward) + per_buffer_ms
        return args.compute_ms / (args.compute_ms + max(0.0, end - backward) + control)

    return {"ranks": size, "ring_ms": ring, "tree_ms": tree, "hierarchical_ms": hierarchical,
            "negotiation_ms": uncached, "cache_cycle_ms": cached,
            "eff_ring_cached": efficiency(ring, cached), "eff_tree_cached": efficiency(tree, cached),
            "eff_hier_cached": efficiency(hierarchical, cached), "eff_ring_negotiated": efficiency(ring, uncached)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", default="64,128,256,512,1024")
    parser.add_argument("--gradient-mb", type=float, default=102.2, help="ResNet-50: 25.56 M float32 parameters")
    parser.add_argument("--fusion-mb", type=float, default=64.0, help="RINGMASTER_FUSION_THRESHOLD")
    parser.add_argument("--compute-ms", type=float, default=290.0,
                        help="forward + backward per step and GPU (ResNet-50, batch 64, a P100: ~220 images/s)")
    parser.add_argument("--backward-share", type=float, default=2 / 3, help="backward's share of compute")
    parser.add_argument("--link-gbits", type=float, default=25.0, help="the network of Horovod's 512-GPU benchmark")
    parser.add_argument("--alpha-us", type=float, default=15.0, help="latency of one message over that network")
    parser.add_argument("--gpus-per-host", type=int, default=8)
    parser.add_argument("--negotiation-ms", type=float, default=50.0,
                        help="negotiation per step without the cache, where --control-plane gives none")
    parser.add_argument("--control-plane", metavar="JSON", help="bench/control_plane.py --json output")
    args = parser.parse_args(argv)
    negotiation = {}
    if args.control_plane:
        with open(args.control_plane) as handle:
            negotiation = {row["ranks"]: row["negotiation_p50_ms"] for row in json.load(handle)}
    print(f"# {args.gradient_mb:g} MB of gradients in {max(1, math.ceil(args.gradient_mb / args.fusion_mb))} fused "
          f"buffers, {args.compute_ms:g} ms compute, {args.link_gbits:g} Gbit/s links, alpha {args.alpha_us:g} us, "
          f"{args.gpus_per_host} GPUs per host, buffers ready evenly over backward")
    header = (f"{'ranks':>6} {'ring ms':>8} {'tree ms':>8} {'hier ms':>8} {'negot ms':>9} {'cache ms':>9} "
              f"{'eff ring':>9} {'eff tree':>9} {'eff hier':>9} {'eff ring, negotiated':>21}")
    print(header)
    print("-" * len(header))
    for size in (int(text) for text in args.ranks.split(",")):
        row = model(args, size, negotiation)
        print(f"{size:>6} {row['ring_ms']:>8.1f} {row['tree_ms']:>8.1f} {row['hierarchical_ms']:>8.1f} "
              f"{row['negotiation_ms']:>9.1f} {row['cache_cycle_ms']:>9.2f} {row['eff_ring_cached']:>9.2f} "
              f"{row['eff_tree_cached']:>9.2f} {row['eff_hier_cached']:>9.2f} {row['eff_ring_negotiated']:>21.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
