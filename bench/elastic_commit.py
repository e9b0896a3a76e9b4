"""What elastic training's ``commit()`` and restore cost, against model size.

    ringrun -np 2 --min-np 1 -H localhost:2 python bench/elastic_commit.py
    ringrun -np 2 --min-np 1 -H localhost:2 python bench/elastic_commit.py --sizes 1 --dataset 0,1280000

Run under an elastic ``ringrun`` (any of ``--min-np``/``--max-np``/``--host-discovery-script``),
so that rank 0 stores each commit with the driver's state service on this host, as in a
real elastic job. For MLPs of growing size (``--sizes``, millions of parameters; momentum
SGD, so the optimizer state is as large as the model) it times, ``--repeats`` times each,
and prints the medians (rank 0's times; every rank runs the collectives):

- ``save``: the in-memory copy of model, optimizer, sampler and attributes (every rank);
- ``commit``: ``state.commit()`` as the training loop calls it: ``save``, then rank 0
  serializes the state and stores it with the driver, then the host-update check (one
  request and one broadcast);
- ``restore``: ``state.restore()`` from the in-memory copy;
- ``resume``: what a re-formed generation does before training again: rank 0 fetches the
  snapshot from the driver and loads it, then ``state.sync()`` broadcasts it to every rank;
- ``snapshot MB``: the size of what rank 0 stores.

With ``--dataset`` (sample counts, comma-separated; 0: none) the state also holds an
``ElasticSampler`` over that many samples, half-way through its epoch (each rank has
recorded its batches of ``--batch`` up to the middle), as a job that commits mid-epoch:
its share of every column is the difference from the row with 0 samples.
"""

import argparse
import statistics
import sys
import time

import torch

import ringmaster as rm
from ringmaster.worker.frontend import elastic_run


def mlp(millions: float) -> torch.nn.Module:
    width = int((millions * 1e6 / 2) ** 0.5)  # two square layers
    return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width))


def half_way_sampler(samples: int, batch: int):
    """An ElasticSampler over ``samples`` whose ranks have recorded their batches up to the middle of the epoch."""
    sampler = rm.elastic.ElasticSampler(range(samples), shuffle=True, seed=0)
    for batch_idx in range(len(sampler) // batch // 2):
        sampler.record_batch(batch_idx, batch)
    return sampler


def timed(function, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        rm.barrier()
        started = time.perf_counter()
        function()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="1,4,16,64", help="millions of parameters, comma-separated")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dataset", default="0",
                        help="samples of an ElasticSampler in the state, comma-separated (0: no sampler)")
    parser.add_argument("--batch", type=int, default=256, help="the sampler's batch size per rank")
    args = parser.parse_args()
    rm.init()
    service = elastic_run.service_client()
    if service is None:
        print("run this under an elastic ringrun (see the docstring)", file=sys.stderr)
        return 2
    if rm.rank() == 0:
        print(f"{rm.size()} ranks; median of {args.repeats}; times in ms")
        print(f"{'parameters':>11} {'samples':>9} {'snapshot MB':>12} {'save':>8} {'commit':>8} {'restore':>8} "
              f"{'resume':>8}")
    runs = [(float(size), int(samples)) for size in args.sizes.split(",") for samples in args.dataset.split(",")]
    for millions, samples in runs:
        model = mlp(millions)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        model(torch.randn(2, model[0].in_features)).sum().backward()
        optimizer.step()  # the momentum buffers exist
        extra = {}
        if samples:
            extra["sampler"] = half_way_sampler(samples, args.batch)
        state = rm.elastic.TorchState(model=model, optimizer=optimizer, epoch=0, batch=0, **extra)
        save = timed(state.save, args.repeats)
        commit = timed(state.commit, args.repeats)
        restore = timed(state.restore, args.repeats)

        def resume():
            elastic_run._resume(state, service)
            state.sync()

        resume_time = timed(resume, args.repeats)
        if rm.rank() == 0:
            parameters = sum(p.numel() for p in model.parameters())
            size_mb = len(state.snapshot()) / 2 ** 20
            print(f"{parameters / 1e6:>10.1f}M {samples:>9} {size_mb:>12.1f} {save * 1e3:>8.1f} "
                  f"{commit * 1e3:>8.1f} {restore * 1e3:>8.1f} {resume_time * 1e3:>8.1f}", flush=True)
    rm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
