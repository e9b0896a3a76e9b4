"""An elastic training job whose every committed step can be replayed in one process.

``python elastic_train.py OUT [--epochs E] [--examples N] [--batch B] [--commit-every C]
[--step-sleep S] [--die-at-step K --die-rank R --die-how exit|kill|raise] [--fail-at-end R]``: a tiny MLP
trained with momentum SGD under ``@rm.elastic.run`` on an
``ElasticSampler``; the state carries ``history``, one entry per optimizer step
``(world size, [each rank's dataset indices])``, so that it holds exactly the steps the
final parameters went through (steps after the last commit before a failure are rolled
back with the state). Each rank prints ``STEP g s rank r host h pid p`` after each step (``g`` the
generation); the reset callback prints ``RESET size n``; at the end rank 0 saves
``{"history", "state_dict", "resets"}`` to OUT and prints ``DONE``. With ``--die-at-step K``,
rank R of the job as first started ends itself just before its K-th step (``os._exit(1)``,
SIGKILL, or an exception out of the training function), as a rank lost mid-job. With
``--fail-at-end R``, rank R raises an exception once training is done (a survivor that fails).

:func:`replay` is the single-process reference: the same model from the same seed, and for
each history entry the average of the per-rank gradients of each rank's mean loss.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import time

import torch

EXAMPLES = 36
FEATURES = 6


def make_model() -> torch.nn.Module:
    torch.manual_seed(1234)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def make_data(examples: int):
    generator = torch.Generator().manual_seed(99)
    x = torch.randn(examples, FEATURES, generator=generator)
    y = torch.sin(x.sum(1, keepdim=True))
    return x, y


def make_optimizer(model: torch.nn.Module, size: int) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def loss_of(model, x, y):
    return (model(x) - y).pow(2).mean()


def replay(history, examples: int):
    """The reference: the committed history applied in one process; returns the state_dict."""
    model = make_model()
    optimizer = make_optimizer(model, 1)
    x, y = make_data(examples)
    for size, shards in history:
        assert len(shards) == size
        grads = [torch.zeros_like(p) for p in model.parameters()]
        for shard in shards:
            model.zero_grad()
            index = torch.tensor(shard, dtype=torch.long)
            loss_of(model, x[index], y[index]).backward()
            for total, p in zip(grads, model.parameters()):
                total += p.grad
        for total, p in zip(grads, model.parameters()):
            p.grad = total / size
        optimizer.step()
    return model.state_dict()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--examples", type=int, default=EXAMPLES)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--commit-every", type=int, default=2)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--die-at-step", type=int, default=0)
    parser.add_argument("--die-rank", type=int, default=0)
    parser.add_argument("--die-how", choices=["exit", "kill", "raise"], default="exit")
    parser.add_argument("--fail-at-end", type=int, default=-1)
    args = parser.parse_args()

    import ringmaster as rm

    rm.init()
    generation = int(os.environ.get("RINGMASTER_ELASTIC_GENERATION", "0"))
    first_size = rm.size()

    def maybe_die():
        if (args.die_at_step and generation == 0 and rm.size() == first_size and rm.rank() == args.die_rank
                and len(state.history) + 1 == args.die_at_step):
            print(f"DYING rank {rm.rank()} by {args.die_how} before step {args.die_at_step}", flush=True)
            if args.die_how == "exit":
                os._exit(1)
            if args.die_how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"rank {rm.rank()} fails on purpose before step {args.die_at_step}")
    host = socket.gethostname()
    model = make_model()
    x, y = make_data(args.examples)
    optimizer = rm.DistributedOptimizer(make_optimizer(model, rm.size()), model.named_parameters())
    sampler = rm.elastic.ElasticSampler(range(args.examples), shuffle=True, seed=7)
    state = rm.elastic.TorchState(model=model, optimizer=optimizer, sampler=sampler, epoch=0, history=[],
                                  resets=0)

    def on_reset():
        state.resets += 1
        print(f"RESET size {rm.size()}", flush=True)

    state.register_reset_callbacks([on_reset])

    @rm.elastic.run
    def train(state):
        while state.epoch < args.epochs:
            indices = list(iter(sampler))
            batches = [indices[i:i + args.batch] for i in range(0, len(indices), args.batch)]
            for number, batch in enumerate(batches):
                index = torch.tensor(batch, dtype=torch.long)
                optimizer.zero_grad()
                loss_of(model, x[index], y[index]).backward()
                maybe_die()
                optimizer.step()
                sampler.record_batch(number, args.batch)
                state.history.append((rm.size(), rm.allgather_object(batch)))
                print(f"STEP {generation} {len(state.history)} rank {rm.rank()} host {host} pid {os.getpid()}",
                      flush=True)
                if args.step_sleep:
                    time.sleep(args.step_sleep)
                if (number + 1) % args.commit_every == 0:
                    state.commit()
            state.epoch += 1
            sampler.set_epoch(state.epoch)
            state.commit()

    train(state)
    if rm.rank() == args.fail_at_end:
        raise RuntimeError(f"rank {rm.rank()} fails on purpose after training")
    if rm.rank() == 0:
        torch.save({"history": state.history, "state_dict": model.state_dict(), "resets": state.resets,
                    "size": rm.size()}, args.out)
        print(f"DONE steps {len(state.history)} size {rm.size()}", flush=True)
    rm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
