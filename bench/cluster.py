"""Benchmarks across hosts whose links are capped, on a namespace cluster built on this machine.

    python bench/cluster.py                    # 2 hosts x 1 rank, 1 Gbit/s links (as root)
    python bench/cluster.py --rate 10gbit --skip-training

Builds the test cluster of tests/cluster/ (network namespaces with their own hostname,
address and sshd, joined by a bridge; each host's link capped with tc's token bucket), then,
from host 1, in one run:

1. the link's capacity as raw TCP measures it (one stream each way, receiver-timed);
2. ``bench/link_allreduce.py``: allreduce bus bandwidth of ringmaster's ring, of the ring
   moving 8-bit codes, and of raw MPI, against the line rate;
3. ``bench/compression.py``: step time and bytes per step of dense, fp16, int8, linear8,
   rgc and topk training of a 14.4 M-parameter MLP, one rank per host;
4. with ``--hybrid``, ``bench/hybrid.py``: HybridParallel's schemes against data parallelism
   on the AlexNet-shaped model, one rank per host;
5. with ``--hierarchical L``, ``bench/hierarchical.py``: L ranks per host, the in-place
   allreduce flat and with ``--hierarchical-allreduce``, jobs alternating;
6. with ``--powersgd``, ``bench/powersgd.py``: ``Compression.powersgd`` against DDP's
   ``powerSGD_hook`` at the same rank on the same model (digits), one rank per host.

Prints each table as it comes. Needs root, ``ip netns``, tc and sshd
(``bash tests/cluster/setup.sh`` installs what is missing); the cluster is torn down at the
end, also after a failure or Ctrl-C.
"""

import argparse
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "cluster"))
import netns_cluster as ncl  # tests/cluster/netns_cluster.py


def run_on_first_host(cluster, command, timeout):
    """Run ``command`` on host 1 (as a user would after logging into a node); return stdout."""
    started = time.perf_counter()
    done = subprocess.run(cluster.hosts[0].command(command), capture_output=True, text=True, timeout=timeout,
                          cwd=str(ROOT), stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise SystemExit(f"failed ({done.returncode}) after {time.perf_counter() - started:.0f} s: "
                         f"{' '.join(command)}\n{done.stdout[-3000:]}\n{cluster.hosts[0].explain(done.stderr)[-3000:]}")
    return done.stdout


def ringrun(cluster, script, *args):
    return [sys.executable, "-m", "ringmaster.launch", "-np", str(len(cluster.hosts)), "-H", cluster.hosts_arg(1),
            "--ssh-identity-file", cluster.key, "--network-interface", cluster.interface,
            sys.executable, str(ROOT / "bench" / script), *map(str, args)]


def table(stdout: str) -> str:
    """Rank 0's lines, without ringrun's ``[0]: `` tag."""
    return "\n".join(line.removeprefix("[0]: ") for line in stdout.splitlines() if line.startswith("[0]: "))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--rate", default="1gbit", help="cap on every host link (tc rate syntax)")
    parser.add_argument("--sizes", default="16M,64M")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--skip-training", action="store_true", help="only the link and allreduce tables")
    parser.add_argument("--rounds", type=int, default=2, help="bench/compression.py rounds")
    parser.add_argument("--hybrid", action="store_true", help="also bench/hybrid.py (AlexNet-shaped model)")
    parser.add_argument("--hierarchical", type=int, default=0, metavar="L",
                        help="also flat vs hierarchical allreduce with L ranks per host (bench/hierarchical.py)")
    parser.add_argument("--pairs", type=int, default=2, help="flat/hierarchical job pairs with --hierarchical")
    parser.add_argument("--powersgd", action="store_true",
                        help="also bench/powersgd.py (PowerSGD against DDP's powerSGD_hook, digits)")
    parser.add_argument("--powersgd-hidden", type=int, default=1024, help="bench/powersgd.py --hidden")
    parser.add_argument("--skip-link", action="store_true", help="skip the link_allreduce table")
    args = parser.parse_args()
    reason = ncl.unavailable_reason()
    if reason:
        raise SystemExit(f"cannot build the cluster: {reason}")
    line_mbit = ncl._rate_bits(args.rate) / 1e6
    with ncl.NetnsCluster(args.hosts, rate=args.rate) as cluster:
        first, second = cluster.hosts[:2]
        there = cluster.throughput_mbit(first, second, nbytes=50_000_000, timeout=120)
        back = cluster.throughput_mbit(second, first, nbytes=50_000_000, timeout=120)
        print(f"{args.hosts} hosts, links capped at {args.rate} ({line_mbit / 8:.0f} MB/s); raw TCP, one stream: "
              f"{there / 8:.1f} MB/s {first.name} -> {second.name}, {back / 8:.1f} MB/s back\n", flush=True)
        if not args.skip_link:
            out = run_on_first_host(cluster, ringrun(cluster, "link_allreduce.py", "--sizes", args.sizes, "--reps",
                                                     args.reps, "--line-rate-mbit", line_mbit), timeout=1200)
            print(table(out) + "\n", flush=True)
        if not args.skip_training:
            out = run_on_first_host(cluster, ringrun(cluster, "compression.py", "--rounds", args.rounds, "--steps", 2,
                                                     "--warmup", 1), timeout=1800)
            print(table(out), flush=True)
        if args.hybrid:
            out = run_on_first_host(cluster, ringrun(cluster, "hybrid.py", "--rounds", args.rounds, "--steps", 2,
                                                     "--warmup", 1), timeout=1800)
            print(table(out), flush=True)
        if args.powersgd:
            out = run_on_first_host(cluster, ringrun(cluster, "powersgd.py", "--hidden", args.powersgd_hidden),
                                    timeout=1800)
            print(table(out), flush=True)
        for _ in range(args.pairs if args.hierarchical else 0):
            for flags in ([], ["--hierarchical-allreduce"]):
                command = ringrun(cluster, "hierarchical.py", "--sizes", args.sizes, "--reps", args.reps)
                command[3:7] = ["-np", str(args.hierarchical * len(cluster.hosts)), "-H",
                                cluster.hosts_arg(args.hierarchical), *flags]
                print(table(run_on_first_host(cluster, command, timeout=1200)), flush=True)


if __name__ == "__main__":
    main()
