"""Data-parallel training of a small classifier with ringmaster's collectives.

    ringrun -np 2 python examples/train_mlp.py --epochs 5

Every rank trains on its own shard of a synthetic, seeded classification problem
(no download). After each backward pass the gradients are averaged over all ranks with
one grouped allreduce, so every rank takes the same step: the same result as one process
training on the whole batch. Rank 0 prints the loss, accuracy and throughput per epoch.
"""

import argparse
import sys
import time

import torch
import torch.nn as nn
from tqdm import tqdm

import ringmaster as rm


def make_data(samples: int, features: int, classes: int, seed: int = 0):
    """A seeded problem with a learnable structure: labels come from a hidden random network."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(samples, features, generator=generator)
    teacher = nn.Sequential(nn.Linear(features, 64), nn.Tanh(), nn.Linear(64, classes))
    with torch.no_grad():
        for parameter in teacher.parameters():
            fan_in = parameter.shape[-1] if parameter.dim() > 1 else 1
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 2 / fan_in ** 0.5)
        labels = teacher(inputs).argmax(dim=1)
    return inputs, labels


class LineProgress:
    """tqdm output for a pipe: one line per update instead of carriage-return redraws.

    Under ringrun/mpirun, output reaches the terminal through MPI's forwarding, which passes
    it on a whole line at a time, so a redrawn bar would only show up at the end.
    """

    def __init__(self, stream):
        self.stream = stream

    def write(self, text):
        for line in text.replace("\r", "\n").split("\n"):
            if line.strip():
                self.stream.write(line.rstrip() + "\n")

    def flush(self):
        self.stream.flush()


def progress_bar(iterable, description):
    """A progress bar on rank 0: redrawn in a terminal, a line a second through a pipe."""
    if sys.stderr.isatty():
        return tqdm(iterable, desc=description, disable=rm.rank() != 0, leave=False)
    return tqdm(iterable, desc=description, disable=rm.rank() != 0, leave=False,
                file=LineProgress(sys.stderr), mininterval=1.0, ascii=True, ncols=80)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05, help="for one rank; scaled by the number of ranks")
    parser.add_argument("--samples", type=int, default=16384)
    args = parser.parse_args()

    rm.init()
    torch.manual_seed(1234 + rm.rank())  # different on purpose: the broadcast below aligns the ranks
    torch.set_num_threads(1)

    features, classes = 32, 4
    inputs, labels = make_data(args.samples, features, classes)
    test_inputs, test_labels = inputs[-2048:], labels[-2048:]
    train_inputs, train_labels = inputs[:-2048], labels[:-2048]
    shard = slice(rm.rank(), None, rm.size())  # every rank its own part of the data
    train_inputs, train_labels = train_inputs[shard], train_labels[shard]

    model = nn.Sequential(nn.Linear(features, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                          nn.Linear(128, classes))
    for parameter in model.parameters():  # start every rank from rank 0's weights
        rm.broadcast_(parameter.data, root_rank=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * rm.size(), momentum=0.9)
    loss_function = nn.CrossEntropyLoss()

    steps = len(train_inputs) // args.batch_size
    for epoch in range(1, args.epochs + 1):
        model.train()
        started = time.perf_counter()
        order = torch.randperm(len(train_inputs), generator=torch.Generator().manual_seed(epoch + 100 * rm.rank()))
        total_loss = torch.zeros(1)
        progress = progress_bar(range(steps), f"epoch {epoch}")
        for step in progress:
            batch = order[step * args.batch_size:(step + 1) * args.batch_size]
            optimizer.zero_grad()
            loss = loss_function(model(train_inputs[batch]), train_labels[batch])
            loss.backward()
            gradients = [p.grad for p in model.parameters()]
            rm.grouped_allreduce_(gradients, op=rm.Average)  # the same averaged gradient on every rank
            optimizer.step()
            total_loss += loss.detach()
        seconds = time.perf_counter() - started
        mean_loss = rm.allreduce(total_loss / steps, op=rm.Average).item()
        model.eval()
        with torch.no_grad():
            accuracy = (model(test_inputs).argmax(dim=1) == test_labels).float().mean().item()
        samples_per_second = rm.allreduce(torch.tensor([steps * args.batch_size / seconds]), op=rm.Sum).item()
        if rm.rank() == 0:
            print(f"epoch {epoch}: loss {mean_loss:.4f}  test accuracy {accuracy:.3f}  "
                  f"{samples_per_second:,.0f} samples/s on {rm.size()} ranks", flush=True)

    # Every rank must hold the same model: check it, as a user would want to be sure.
    flat = torch.cat([p.data.flatten() for p in model.parameters()])
    largest_difference = rm.allreduce(flat, op=rm.Max) - rm.allreduce(flat, op=rm.Min)
    if rm.rank() == 0:
        print(f"final test accuracy {accuracy:.3f}; ranks agree on the weights "
              f"(max difference {largest_difference.abs().max().item():.1e})")
    rm.shutdown()


if __name__ == "__main__":
    main()
