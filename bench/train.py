"""Training step speed: no communication vs ringmaster's DistributedOptimizer vs torch DDP (gloo), in one job.

    ringrun -np 2 python bench/train.py
    ringrun -np 2 python bench/train.py --trace     # then one traced ringmaster step per model

The models are those of examples/benchmark_models.py: ``mlp`` (≈ 4.2 M parameters, little
compute: communication-heavy) and ``cnn`` (≈ 3.1 M parameters, ≈ 10 × the compute). Each
rank trains on its own random batch with one torch thread, in three modes that take turns
round by round in the same processes, so that load on a shared machine hits all of them:

- ``no-comm``: every rank trains on its own, with no communication at all (the ceiling);
- ``sync-only``: the same, plus one barrier per step after backward and nothing else: what
  keeping the ranks in step costs alone (each step waits for the slowest rank's backward),
  the ceiling of any synchronous data-parallel training on the machine;
- ``ringmaster``: ``rm.DistributedOptimizer`` (gradients allreduced from hooks during backward);
- ``rm-one-step``: the same with ``update_per_bucket=False``: the optimizer steps once after
  every bucket is reduced, instead of on each bucket as soon as it is (the default);
- ``rm-no-cache``: the same with the response cache switched off (as ``RINGMASTER_CACHE_CAPACITY=0``),
  so that what the cache costs or saves in training shows in the same run;
- ``rm-adasum``: ``rm.DistributedOptimizer(op=rm.Adasum)``: each rank steps on its own
  gradients and the parameters' changes are combined with Adasum in ``step()`` (no overlap
  with backward; its cost against ``ringmaster``'s Average is what this mode shows);
- ``ddp-gloo``: ``torch.nn.parallel.DistributedDataParallel`` on a gloo process group;
- ``naive-mpi``: after backward, one blocking mpi4py ``Allreduce`` per gradient (no overlap,
  no fusion, no negotiation): the simplest correct loop, for reference.

A step is zero_grad, forward, backward and optimizer step; its time is the slowest rank's.
Prints the median step time, the throughput (images/s over all ranks) and its ratio to
no-comm's. Progress goes to stderr.

--trace records one ringmaster step per model with ringmaster's timeline (rm.start_timeline)
and prints, for every rank, when each gradient was submitted from its hook during backward,
when its allreduce started and finished, and whether the first one started before backward
ended (communication overlapping computation).
"""

import argparse
import json
import os
import pathlib
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import ringmaster as rm
from ringmaster.worker.runtime import current

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))
import benchmark_models  # examples/benchmark_models.py

MODES = ("no-comm", "sync-only", "ringmaster", "rm-one-step", "rm-no-cache", "rm-adasum", "ddp-gloo", "naive-mpi")


def progress(text):
    """What rank 0 is measuring now (whole lines: MPI forwards output line by line)."""
    if rm.rank() == 0:
        print(f"[bench] {text}", file=sys.stderr, flush=True)


def init_gloo():
    """A gloo process group over the ranks of this job, on a port rank 0 picked."""
    port = None
    if rm.rank() == 0:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(rm.broadcast_object(port, root_rank=0))
    dist.init_process_group("gloo", rank=rm.rank(), world_size=rm.size())


class Trainer:
    """A model, its optimizer and one batch: what one mode trains.

    A step runs in four phases, which ``bench/step_phases.py`` times apart: :meth:`forward`
    (with zero_grad), the backward pass, :meth:`communicate` (what the mode does between
    backward and the optimizer's step) and :meth:`update` (the optimizer's step).
    """

    def __init__(self, model, optimizer, batch):
        self.model, self.optimizer = model, optimizer
        self.images, self.labels = batch

    def forward(self):
        self.optimizer.zero_grad()
        return F.cross_entropy(self.model(self.images), self.labels)

    def communicate(self):
        """Nothing: no communication (DDP's happens inside backward)."""

    def update(self):
        self.optimizer.step()

    def step(self):
        self.forward().backward()
        self.communicate()
        self.update()


class SyncOnlyTrainer(Trainer):
    """No communication but a barrier after backward: the ranks wait for each other every step."""

    def __init__(self, model, optimizer, batch, comm):
        super().__init__(model, optimizer, batch)
        self.comm = comm

    def communicate(self):
        self.comm.Barrier()


class NaiveMpiTrainer(Trainer):
    """Blocking MPI allreduces of every gradient after backward, then the optimizer step."""

    def __init__(self, model, optimizer, batch, comm):
        super().__init__(model, optimizer, batch)
        self.comm = comm
        self.parameters = [p for p in model.parameters() if p.requires_grad]

    def communicate(self):
        from mpi4py import MPI

        for parameter in reversed(self.parameters):  # the order backward produced them in
            self.comm.Allreduce(MPI.IN_PLACE, parameter.grad.numpy())
            parameter.grad.div_(self.comm.Get_size())


class RingmasterTrainer(Trainer):
    """rm.DistributedOptimizer: its hooks start allreduces during backward; step() waits for them.

    bench/step_phases.py times its phases apart: ``synchronize()`` then ``step()`` under
    ``skip_synchronize()`` (Horovod's documented split; with one optimizer step after all
    buckets). A whole step here is a plain ``step()``.
    """

    def communicate(self):
        self.optimizer.synchronize()

    def update(self):
        with self.optimizer.skip_synchronize():
            self.optimizer.step()

    def step(self):
        # A plain step(), as users write it: it waits for the buckets itself, and updates each
        # bucket's parameters as it is reduced (update_per_bucket; rm-one-step: after all).
        self.forward().backward()
        self.optimizer.step()


def make_trainers(model_name, batch_size, comm, modes=MODES):
    """One trainer per mode, each with its own copy of the model (the same initial weights)."""
    batch = benchmark_models.synthetic_batch(batch_size, seed=rm.rank())
    trainers = {}
    for mode in modes:
        torch.manual_seed(0)
        model = benchmark_models.create(model_name)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        if mode in ("ringmaster", "rm-one-step", "rm-no-cache", "rm-adasum"):
            optimizer = rm.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                                op=rm.Adasum if mode == "rm-adasum" else rm.Average,
                                                update_per_bucket=False if mode == "rm-one-step" else None)
            rm.broadcast_parameters(model.state_dict(), root_rank=0)
            trainers[mode] = RingmasterTrainer(model, optimizer, batch)
        elif mode == "ddp-gloo":
            model = DistributedDataParallel(model)  # broadcasts rank 0's weights itself
            trainers[mode] = Trainer(model, optimizer, batch)
        elif mode == "naive-mpi":
            trainers[mode] = NaiveMpiTrainer(model, optimizer, batch, comm)
        elif mode == "sync-only":
            trainers[mode] = SyncOnlyTrainer(model, optimizer, batch, comm)
        else:
            trainers[mode] = Trainer(model, optimizer, batch)
    return trainers


def use_cache(on):
    """Switch the response cache on or off on this rank (every rank does, right after a barrier)."""
    cache = current.runtime().cache
    if cache is not None:
        cache.enabled = on


def measure(trainers, rounds, steps, warmup, model_name):
    """Median seconds per step of each mode, over ``rounds`` turns of ``steps`` steps."""
    for mode, trainer in trainers.items():
        rm.barrier()
        use_cache(mode != "rm-no-cache")
        for _ in range(warmup):
            trainer.step()
    modes = list(trainers)
    times = {mode: [] for mode in modes}
    for round_index in range(rounds):
        progress(f"{model_name}: round {round_index + 1}/{rounds}")
        shift = round_index % len(modes)  # no mode always runs right after the same other one
        for mode in modes[shift:] + modes[:shift]:
            rm.barrier()
            use_cache(mode != "rm-no-cache")
            local = []
            for _ in range(steps):
                started = time.perf_counter()
                trainers[mode].step()
                local.append(time.perf_counter() - started)
            slowest = rm.allreduce(torch.tensor(local, dtype=torch.float64), op=rm.Max, name=f"times.{mode}")
            times[mode].extend(slowest.tolist())
    return {mode: statistics.median(values) for mode, values in times.items()}


def read_timeline(path):
    """{tensor name: [(activity, begin µs, end µs), ...]} from a ringmaster timeline file (Chrome tracing JSON)."""
    with open(path, encoding="utf-8") as file:
        events = json.load(file)
    names = {event["pid"]: event["args"]["name"] for event in events if event.get("name") == "process_name"}
    spans = {name: [] for name in names.values()}
    open_spans = {pid: [] for pid in names}
    for event in events:
        if event["ph"] == "B":
            open_spans[event["pid"]].append((event["name"], event["ts"]))
        elif event["ph"] == "E" and open_spans.get(event["pid"]):
            activity, begin = open_spans[event["pid"]].pop()
            spans[names[event["pid"]]].append((activity, begin, event["ts"]))
    return spans


def record_step(trainer):
    """Run one ringmaster step with the timeline on.

    Returns (backward end, step end, {parameter: (shape, submitted, started, finished)}), in
    ms since backward started. "submitted" is when the parameter's hook handed its gradient
    over (to negotiation, or to the fixed gradient plan from the second step on), "started"
    when its allreduce began to run.
    """
    optimizer, model = trainer.optimizer, trainer.model
    shapes = {f"DistributedOptimizer.{name}": tuple(p.shape) for name, p in model.named_parameters()}
    rm.barrier()
    loss = trainer.forward()
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "timeline.json")
        origin = time.perf_counter()  # the timeline's clock starts within a fraction of a ms of this
        rm.start_timeline(path)
        backward_start = time.perf_counter()
        loss.backward()
        backward_end = time.perf_counter()
        optimizer.step()
        step_end = time.perf_counter()
        rm.stop_timeline()
        spans = read_timeline(path)

    def ms(timeline_us):
        return timeline_us / 1e3 - (backward_start - origin) * 1e3

    gradients = {}
    for name, shape in shapes.items():
        first = {}
        for activity, begin, end in spans.get(name, []):
            first.setdefault(activity, (begin, end))
        # Handed over by its hook: to the coordinator (negotiated alone), or to the step's fixed plan.
        submitted = first.get("NEGOTIATE_ALLREDUCE", first.get("READY", (None,)))[0]
        started, finished = first.get("ALLREDUCE", (None, None))
        gradients[name.removeprefix("DistributedOptimizer.")] = (
            shape, *(ms(moment) if moment is not None else None for moment in (submitted, started, finished)))
    return (backward_end - backward_start) * 1e3, (step_end - backward_start) * 1e3, gradients


def format_trace(model_name, backward_end, step_end, gradients):
    """A table of the recorded step, and whether communication overlapped backward."""

    def cell(moment):
        return f"{moment:9.2f}" if moment is not None else "        ?"

    lines = [f"\ntrace of one ringmaster step on rank {rm.rank()}, {model_name} (ms since backward started)",
             f"{'parameter':<12} {'shape':>12} {'submitted':>9} {'started':>9} {'finished':>9}"]
    order = sorted(gradients, key=lambda name: gradients[name][1] if gradients[name][1] is not None else 1e12)
    for name in order:
        shape, *moments = gradients[name]
        lines.append(f"{name:<12} {'x'.join(map(str, shape)):>12} " + " ".join(cell(m) for m in moments))
    lines.append(f"backward ended at {backward_end:.2f} ms, step() returned at {step_end:.2f} ms")
    first = order[0]
    started = gradients[first][2]
    overlapped = started is not None and started < backward_end
    lines.append(f"first allreduce ({first}) started at {cell(started).strip()} ms: "
                 + ("before backward ended" if overlapped else "NOT before backward ended"))
    started_during = sum(1 for *_, begin, _ in gradients.values() if begin is not None and begin < backward_end)
    lines.append(f"{started_during} of {len(gradients)} allreduces started before backward ended")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="mlp,cnn", help="comma-separated, from examples/benchmark_models.py")
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--rounds", type=int, default=10, help="turns of each mode")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per mode and round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per mode first")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--trace", action="store_true", help="also trace one ringmaster step per model")
    parser.add_argument("--modes", default=",".join(MODES),
                        help=f"comma-separated, from {', '.join(MODES)} (no-comm is always run: the baseline)")
    args = parser.parse_args()
    modes = ["no-comm"] + [mode for mode in args.modes.split(",") if mode != "no-comm"]
    unknown = [mode for mode in modes if mode not in MODES]
    if unknown:
        parser.error(f"unknown modes {unknown}; choose from {', '.join(MODES)}")

    rm.init()
    torch.set_num_threads(args.threads)
    init_gloo()
    from mpi4py import MPI

    naive_comm = MPI.COMM_WORLD.Dup()  # the naive loop's own traffic, apart from ringmaster's
    rows, traces = [], []
    for model_name in args.models.split(","):
        trainers = make_trainers(model_name, args.batch_size, naive_comm, modes)
        medians = measure(trainers, args.rounds, args.steps, args.warmup, model_name)
        parameters = benchmark_models.parameter_count(trainers["no-comm"].model)
        rows.extend((model_name, parameters, mode, seconds) for mode, seconds in medians.items())
        if args.trace and "ringmaster" in trainers:
            progress(f"{model_name}: tracing one ringmaster step")
            traces.append(format_trace(model_name, *record_step(trainers["ringmaster"])))
        del trainers

    if rm.rank() == 0:
        images = args.batch_size * rm.size()
        print(f"\ntraining step, {rm.size()} ranks, batch {args.batch_size} per rank, {args.threads} torch "
              f"thread(s) per rank; median of {args.rounds} x {args.steps} steps, slowest rank; torch's "
              f"huge pages {'on' if os.environ.get('THP_MEM_ALLOC_ENABLE') == '1' else 'off'} "
              f"(THP_MEM_ALLOC_ENABLE)")
        print(f"{'model':<6} {'params':>7} {'mode':<11} {'step ms':>9} {'images/s':>9} {'vs no-comm':>10}")
        baseline = {name: seconds for name, _, mode, seconds in rows if mode == "no-comm"}
        for name, parameters, mode, seconds in rows:
            print(f"{name:<6} {parameters / 1e6:>6.1f}M {mode:<11} {seconds * 1e3:>9.2f} {images / seconds:>9.0f} "
                  f"{baseline[name] / seconds:>10.2f}")
    traces_of_ranks = rm.allgather_object(traces)
    if rm.rank() == 0:
        for rank_traces in zip(*traces_of_ranks):  # model by model, rank by rank
            print("\n".join(rank_traces))
    dist.destroy_process_group()
    naive_comm.Free()
    rm.shutdown()


if __name__ == "__main__":
    main()
