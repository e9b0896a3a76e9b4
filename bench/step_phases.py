"""Where a training step's time goes, phase by phase, in the synchronous modes of bench/train.py.

    ringrun -np 2 python bench/step_phases.py                # the cnn
    ringrun -np 2 python bench/step_phases.py --model mlp

bench/train.py measures whole steps. This splits each step into its phases: ``forward``
(with zero_grad), ``backward``, ``communicate`` (what the mode does between backward and the
optimizer's step: a barrier for sync-only, the blocking allreduces for naive-mpi,
``synchronize()`` for ringmaster) and ``update`` (the optimizer's step).

The modes take turns step by step, in a rotating order with a barrier before each step, so
that the machine's drift hits all of them alike. Each mode is then compared with sync-only
in pairs: for every turn, the mode's phase minus sync-only's phase in the same turn, and the
median of those differences. sync-only pays for keeping the ranks in step and for nothing
else, so what a mode costs beyond it is what its communication costs, wherever in the step
that cost lands (ringmaster's hooks run inside backward).

Also printed: how far apart the ranks' backward passes ended (median over steps), from the
host's monotonic clock, which every rank of a one-host job shares.
"""

import argparse
import statistics
import sys
import time

import torch

import ringmaster as rm
import train  # bench/train.py: the trainers, so that both scripts measure the same steps

MODES = ("sync-only", "naive-mpi", "ringmaster")
PHASES = ("forward", "backward", "communicate", "update", "step")


def timed_step(trainer):
    """One step of ``trainer``: (seconds of each of PHASES, the moment backward ended)."""
    started = time.perf_counter()
    loss = trainer.forward()
    forward_end = time.perf_counter()
    loss.backward()
    backward_end = time.perf_counter()
    trainer.communicate()
    communicate_end = time.perf_counter()
    trainer.update()
    ended = time.perf_counter()
    phases = (forward_end - started, backward_end - forward_end, communicate_end - backward_end,
              ended - communicate_end, ended - started)
    return phases, backward_end


def measure(trainers, turns, warmup):
    """{mode: [(phases, backward end) per turn]} on this rank."""
    for trainer in trainers.values():
        for _ in range(warmup):
            trainer.step()
    records = {mode: [] for mode in trainers}
    modes = list(trainers)
    for turn in range(turns):
        if turn % 10 == 0:
            train.progress(f"turn {turn + 1}/{turns}")
        shift = turn % len(modes)
        for mode in modes[shift:] + modes[:shift]:
            rm.barrier()
            records[mode].append(timed_step(trainers[mode]))
    return records


def ms(seconds):
    return f"{seconds * 1e3:>11.2f}"


def signed_ms(seconds):
    return f"{seconds * 1e3:>+11.2f}"


def report(records_of_ranks, one_host):
    """The tables, from every rank's records (a list indexed by rank)."""
    header = f"{'mode':<11} {'rank':>7} " + " ".join(f"{phase:>11}" for phase in PHASES)
    lines = [header]
    for mode in MODES:
        for rank, records in enumerate(records_of_ranks):
            medians = [statistics.median(phases[i] for phases, _ in records[mode]) for i in range(len(PHASES))]
            lines.append(f"{mode:<11} {rank:>7} " + " ".join(ms(value) for value in medians))

    lines += ["", "difference from sync-only in the same turn, median over turns (ms)", header]
    for mode in MODES[1:]:
        for rank, records in enumerate(records_of_ranks):
            pairs = list(zip(records[mode], records["sync-only"]))
            differences = [statistics.median(own[0][i] - reference[0][i] for own, reference in pairs)
                           for i in range(len(PHASES))]
            lines.append(f"{mode:<11} {rank:>7} " + " ".join(signed_ms(value) for value in differences))
        # The job's step is its slowest rank's.
        slowest = [max(records[mode][turn][0][-1] for records in records_of_ranks) -
                   max(records["sync-only"][turn][0][-1] for records in records_of_ranks)
                   for turn in range(len(records_of_ranks[0][mode]))]
        lines.append(f"{mode:<11} {'slowest':>7} " + " " * (12 * (len(PHASES) - 1))
                     + signed_ms(statistics.median(slowest)))

    if one_host and len(records_of_ranks) > 1:
        apart = []
        for mode in MODES:
            spreads = [max(ends) - min(ends) for ends in
                       zip(*([end for _, end in records[mode]] for records in records_of_ranks))]
            apart.append(f"{mode} {statistics.median(spreads) * 1e3:.2f} ms")
        lines += ["", "backward passes ended apart, median over turns: " + ", ".join(apart)]
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="cnn", help="from examples/benchmark_models.py")
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--turns", type=int, default=60, help="timed steps per mode (one per turn)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per mode first")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = parser.parse_args()

    rm.init()
    torch.set_num_threads(args.threads)
    from mpi4py import MPI

    naive_comm = MPI.COMM_WORLD.Dup()  # the naive loop's and the barrier's traffic, apart from ringmaster's
    trainers = train.make_trainers(args.model, args.batch_size, naive_comm, modes=MODES)
    records = measure(trainers, args.turns, args.warmup)
    records_of_ranks = rm.allgather_object(records)
    if rm.rank() == 0:
        print(f"\n{args.model}, {rm.size()} ranks, batch {args.batch_size} per rank, {args.threads} torch "
              f"thread(s) per rank; median ms over {args.turns} steps per mode, modes taking turns step by step")
        print(report(records_of_ranks, one_host=rm.local_size() == rm.size()))
    del trainers
    naive_comm.Free()
    rm.shutdown()


if __name__ == "__main__":
    sys.exit(main())
