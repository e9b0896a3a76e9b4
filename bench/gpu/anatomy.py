"""Where a GPU collective's and a GPU training step's time go, part by part.

    mpirun -np 1 python bench/gpu/anatomy.py      # one rank: nothing has to move
    mpirun -np 2 python bench/gpu/anatomy.py      # two ranks sharing a GPU (ipc)

Two tables, for rank 0, each part's median (microseconds) and its calls per collective or step:

* **allreduce**: ``rm.allreduce_`` of a CUDA float32 tensor, in place, named (after a warmup
  every call is a response-cache hit), followed by ``torch.cuda.synchronize()`` as a user's
  next read would need, at each of ``--sizes``. A timer wraps each part of the path:
  submission, the cache's cycle (vector, MPI round trip, apply), the executor, the device's
  event and stream waits, the transport's own allreduce, and the handle's wait. Beside it the
  transport called directly on the same buffer with a stream synchronize: what the runtime
  adds is the difference. At one rank the same call also runs with the one-rank shortcut
  switched off (``full path``), which shows what the shortcut saves.
* **step**: one ``DistributedOptimizer`` step of ``--model`` on a random batch: forward,
  backward (the gradient hooks inside it), ``synchronize`` (waiting for the reductions), the
  optimizer's update, each phase timed with a device synchronize at its end, and the runtime's
  parts inside them.

Each timer costs about half a microsecond of its own, so the parts add up to more than the
untimed call. Parts that a run never calls are left out of its table.
"""

import argparse
import collections
import pathlib
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from mpi4py import MPI

import ringmaster as rm
from ringmaster.worker.frontend import collectives
from ringmaster.worker.runtime import (allreduce_paths, current, device, entries, executor, handles, lifecycle,
                                       response_cache)

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "examples")]  # bench/ first: its anatomy.py, not this file
import benchmark_models  # noqa: E402
from anatomy import timed  # noqa: E402  (bench/anatomy.py: the host's anatomy, whose timer this shares)

#: (owner, attribute, label) of the parts of one collective, outermost first.
COLLECTIVE_PARTS = [
    (collectives, "submit_allreduce", "submit (validate, entry, handle, cache hit)"),
    (entries, "ready_event", "  record the input's ready event"),
    (lifecycle.Runtime, "submit", "  the tensor table and the hit"),
    (lifecycle.Runtime, "flush", "flush (the caller drives the cycles)"),
    (response_cache.ResponseCache, "_cycle", "  cycle"),
    (response_cache.ResponseCache, "_wait", "    MPI round trip (and the peer)"),
    (response_cache.ResponseCache, "_run_slots", "    run what is ready"),
    (executor.Executor, "execute", "      execute"),
    (device.CudaDevice, "ready", "        background stream waits on the input"),
    (allreduce_paths.AllreducePaths, "_reduce_in_place", "        the transfer and its scaling"),
    ("transport", "allreduce", "          the transport's allreduce"),
    (device.CudaDevice, "completion", "        record the completion event"),
    (handles.Handle, "wait", "handle wait"),
    (device, "caller_waits", "  caller's stream waits on the result"),
]

#: The parts of a DistributedOptimizer step on CUDA (hooks run inside backward).
STEP_PARTS = [
    ("optimizer", "_gradient_ready", "gradient hook"),
    ("optimizer", "_allreduce_gradient_async", "  submit the gradient's allreduce"),
    (entries, "ready_event", "    record the input's ready event"),
    (lifecycle.Runtime, "submit", "    the tensor table and the hit"),
    (lifecycle.Runtime, "flush", "flush (the caller drives the cycles)"),
    (response_cache.ResponseCache, "_cycle", "cycle (either thread)"),
    (response_cache.ResponseCache, "_wait", "  MPI round trip (and the peer)"),
    (executor.Executor, "execute", "  execute"),
    (device.CudaDevice, "ready", "    background stream waits on the input"),
    (allreduce_paths.AllreducePaths, "_reduce_in_place", "    the transfer and its scaling"),
    ("transport", "allreduce", "      the transport's allreduce"),
    (handles.Handle, "wait", "handle wait"),
    (device, "caller_waits", "  caller's stream waits on the result"),
]


class Parts:
    """Timers around the parts: ``with Parts(parts, transport) as times: ...``."""

    def __init__(self, parts, transport=None, optimizer=None):
        """``transport``, ``optimizer``: the objects whose classes the parts "transport" and
        "optimizer" name (DistributedOptimizer makes a class per wrapped optimizer class)."""
        objects = {"transport": transport, "optimizer": optimizer}
        self.parts = [(type(objects[owner]) if owner in objects else owner, attribute, label)
                      for owner, attribute, label in parts if objects.get(owner, True) is not None]
        self.times = collections.defaultdict(list)

    def __enter__(self):
        self.originals = []
        for owner, attribute, label in self.parts:
            original = getattr(owner, attribute)
            self.originals.append((owner, attribute, original))
            setattr(owner, attribute, timed(original, self.times[label]))
        return self.times

    def __exit__(self, *exc):
        for owner, attribute, original in reversed(self.originals):
            setattr(owner, attribute, original)

    def rows(self, per):
        """(label, median us, calls per unit) for the parts that ran."""
        return [(label, statistics.median(self.times[label]) / 1e3, len(self.times[label]) / per)
                for _, _, label in self.parts if self.times[label]]


def _medians(comm, function, count):
    """Median microseconds of ``function()`` (the slowest rank's per call), a barrier before each."""
    samples = []
    for _ in range(count):
        comm.Barrier()
        start = time.perf_counter_ns()
        function()
        samples.append(comm.allreduce(time.perf_counter_ns() - start, op=MPI.MAX))
    return statistics.median(samples) / 1e3


def _cuda_transport():
    cuda = current.runtime().executor._devices._cuda
    return None if cuda is None or not cuda._transports else next(iter(cuda._transports.values()))


def allreduce_table(comm, nbytes, calls):
    tensor = torch.ones(max(1, nbytes // 4), device="cuda")
    name = f"gpu.anatomy.{nbytes}"

    def call():
        rm.allreduce_(tensor, op=rm.Sum, name=name)
        torch.cuda.synchronize()

    for _ in range(20):
        call()
    rows = {"rm.allreduce_ + synchronize, untimed": _medians(comm, call, calls)}
    transport = _cuda_transport()
    if transport is not None:
        array = current.runtime().executor._devices._cuda.array(tensor)
        stream = torch.cuda.current_stream()

        def alone():
            transport.allreduce(array, "sum")
            stream.synchronize()
        rows[f"the {transport.name} transport alone + synchronize"] = _medians(comm, alone, calls)
    if comm.Get_size() == 1 and hasattr(collectives, "_nothing_to_move"):
        shortcut = collectives._nothing_to_move
        collectives._nothing_to_move = lambda *args, **kwargs: False
        try:
            for _ in range(20):
                call()
            rows["full path (one-rank shortcut off), untimed"] = _medians(comm, call, calls)
            parts = Parts(COLLECTIVE_PARTS, _cuda_transport())
            with parts:
                _medians(comm, call, calls)
        finally:
            collectives._nothing_to_move = shortcut
    else:
        parts = Parts(COLLECTIVE_PARTS, transport)
        with parts:
            _medians(comm, call, calls)
    return rows, parts.rows(calls)


def step_table(comm, model_name, batch_size, steps):
    torch.manual_seed(0)
    model = benchmark_models.create(model_name).cuda()
    optimizer = rm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                        named_parameters=model.named_parameters())
    rm.broadcast_parameters(model.state_dict(), root_rank=0)
    images, labels = benchmark_models.synthetic_batch(batch_size, seed=rm.rank())
    images, labels = images.cuda(), labels.cuda()
    phases = collections.defaultdict(list)

    def step():
        comm.Barrier()
        marks = [time.perf_counter_ns()]
        optimizer.zero_grad()
        loss = F.cross_entropy(model(images), labels)
        torch.cuda.synchronize()
        marks.append(time.perf_counter_ns())
        loss.backward()
        torch.cuda.synchronize()
        marks.append(time.perf_counter_ns())
        optimizer.synchronize()
        torch.cuda.synchronize()
        marks.append(time.perf_counter_ns())
        with optimizer.skip_synchronize():
            optimizer.step()
        torch.cuda.synchronize()
        marks.append(time.perf_counter_ns())
        return marks

    for _ in range(5):
        step()
    parts = Parts(STEP_PARTS, _cuda_transport(), optimizer)
    with parts:
        for _ in range(steps):
            marks = step()
            for label, start, end in zip(("forward", "backward (hooks inside)", "synchronize", "update"),
                                         marks, marks[1:]):
                phases[label].append(comm.allreduce(end - start, op=MPI.MAX))
            phases["whole step"].append(comm.allreduce(marks[-1] - marks[0], op=MPI.MAX))
    phase_rows = [(label, statistics.median(values) / 1e3) for label, values in phases.items()]
    return phase_rows, parts.rows(steps), sum(p.numel() for p in model.parameters())


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="4,4194304", help="bytes of float32 per allreduce (default 4 B, 4 MiB)")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/gpu/anatomy.py needs a CUDA GPU")
    rm.init()
    torch.cuda.set_device(rm.local_rank() % torch.cuda.device_count())
    comm = MPI.COMM_WORLD
    lead = rm.rank() == 0
    for nbytes in [int(size) for size in args.sizes.split(",")]:
        wholes, parts = allreduce_table(comm, nbytes, args.calls)
        if lead:
            print(f"\n## rm.allreduce_ of a CUDA tensor, {nbytes} bytes, {rm.size()} rank(s): microseconds")
            for label, value in wholes.items():
                print(f"{label:58} {value:9.1f}")
            print(f"{'part (timed pass)':58} {'median':>9} {'calls/op':>9}")
            for label, value, per in parts:
                print(f"{label:58} {value:9.1f} {per:9.2f}")
    if rm.size() > 1:
        phases, parts, count = step_table(comm, args.model, args.batch_size, args.steps)
        if lead:
            print(f"\n## DistributedOptimizer step, {args.model} ({count / 1e6:.1f} M parameters), batch "
                  f"{args.batch_size}, {rm.size()} ranks: microseconds")
            for label, value in phases:
                print(f"{label:58} {value:9.1f}")
            print(f"{'part':58} {'median':>9} {'calls/step':>9}")
            for label, value, per in parts:
                print(f"{label:58} {value:9.1f} {per:9.2f}")
    rm.shutdown()


if __name__ == "__main__":
    main()
