"""Train a digit classifier with data-parallel features and a model-parallel classifier (rm.parallel.HybridParallel).

    ringrun -np 2 python examples/hybrid_digits.py
    ringrun -np 2 python examples/hybrid_digits.py --scheme c --compression int8
    ringrun -np 2 python examples/hybrid_digits.py --variable-batch

The convolutional features (few weights) are replicated and trained data-parallel: each
rank runs them on its own batch and DistributedOptimizer averages their gradients. The fully
connected classifier (most of the weights) is split over the ranks by output features: what
travels is activations, not its weights. --scheme picks how the ranks' batches meet in the
classifier (a: one gathered batch; b: ranks take turns broadcasting theirs; c: each round
takes a slice of every rank's batch); --compression sends activations and their gradients
as fp16 or 8-bit codes; --variable-batch updates the classifier after every round (batch b
there, K·b in the features).

The 1 797 8×8 digits of scikit-learn are split once, with a fixed seed, into training and
test sets; each rank trains on its own shard of the training set and evaluates its shard of
the test set.
"""

import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import ringmaster as rm

SPLIT_SEED = 0
#: What the classifier's exchanges use (HybridParallel's collectives), apart from the
#: features' gradient allreduce.
EXCHANGES = ("allgather", "broadcast", "alltoall")


def load_data():
    """The digits as standardized (train, test) datasets of 1×8×8 images, identical on every rank."""
    digits = load_digits()
    images = torch.tensor(digits.data, dtype=torch.float32)
    labels = torch.tensor(digits.target)
    train_images, test_images, train_labels, test_labels = train_test_split(
        images, labels, test_size=0.25, random_state=SPLIT_SEED, stratify=labels)
    mean, std = train_images.mean(0), train_images.std(0).clamp_min(1.0)
    shape = (-1, 1, 8, 8)
    return (TensorDataset(((train_images - mean) / std).reshape(shape), train_labels),
            TensorDataset(((test_images - mean) / std).reshape(shape), test_labels))


def create_model():
    """(features, classifier): a small conv stack (160 weights), then 2 Linear layers (136 714 weights)."""
    features = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten())
    classifier = nn.Sequential(nn.Linear(16 * 4 * 4, 512), nn.ReLU(), nn.Linear(512, 10))
    return features, classifier


def train_epoch(model, optimizer, loader, variable_batch):
    """One pass over this rank's shard: (mean loss over all ranks, bytes this rank sent per step:
    the classifier's exchanges, everything)."""
    model.train()
    loss_sum, samples, steps = 0.0, 0, 0
    rm.bytes_sent(reset=True)
    for images, labels in loader:
        optimizer.zero_grad()
        if variable_batch:
            loss = model.train_step(images, labels, F.cross_entropy, optimizer)  # steps the classifier per round
        else:
            loss = F.cross_entropy(model(images), labels)
            loss.backward()
        optimizer.step()
        loss_sum += loss.item() * len(labels)
        samples += len(labels)
        steps += 1
    sent = rm.bytes_sent()
    exchanged = sum(sent.get(kind, 0) for kind in EXCHANGES)
    mean_loss = rm.allreduce(torch.tensor(loss_sum / samples), op=rm.Average).item()
    return mean_loss, exchanged / max(steps, 1), sent["total"] / max(steps, 1)


@torch.no_grad()
def evaluate(model, dataset) -> float:
    """Accuracy on the whole test set, each rank classifying its shard of it."""
    model.eval()
    images, labels = dataset.tensors
    mine = slice(rm.rank(), None, rm.size())
    correct = (model(images[mine]).argmax(dim=1) == labels[mine]).sum()
    return rm.allreduce(correct, op=rm.Sum).item() / len(labels)


def largest_difference(state) -> float:
    """The largest difference of any value of the full model between any two ranks."""
    values = torch.cat([value.detach().double().flatten() for _, value in sorted(state.items())])
    return (rm.allreduce(values, op=rm.Max) - rm.allreduce(values, op=rm.Min)).max().item()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.01, help="for one rank; scaled linearly by the number of ranks")
    parser.add_argument("--seed", type=int, default=42, help="the first rank's initial weights and the shuffling")
    parser.add_argument("--scheme", choices=("a", "b", "c"), default="b")
    parser.add_argument("--compression", choices=("none", "fp16", "int8", "linear8"), default="none",
                        help="how activations and their gradients travel")
    parser.add_argument("--variable-batch", action="store_true",
                        help="update the classifier after each of the K rounds (schemes b and c)")
    args = parser.parse_args()

    rm.init()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    train_set, test_set = load_data()
    sampler = DistributedSampler(train_set, num_replicas=rm.size(), rank=rm.rank(), shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)

    features, classifier = create_model()
    compression = None if args.compression == "none" else getattr(rm.Compression, args.compression)
    model = rm.parallel.HybridParallel(features, classifier, scheme=args.scheme, compression=compression,
                                       variable_batch=args.variable_batch)
    # The features see K·b examples per step: the learning rate grows linearly with K (the
    # paper's heuristic). With --variable-batch the classifier steps on b examples at a time.
    lr = rm.parallel.scale_learning_rate(args.lr, rm.size(), rule="linear")
    optimizer = rm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9),
                                        named_parameters=model.named_parameters())
    if rm.rank() == 0:
        print(f"training on {rm.size()} ranks, scheme {args.scheme}, activations as {args.compression}"
              f"{', variable batch' if args.variable_batch else ''}; {model}", flush=True)

    started = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)
        loss, exchanged, total = train_epoch(model, optimizer, loader, args.variable_batch)
        accuracy = evaluate(model, test_set)
        if rm.rank() == 0:
            print(f"epoch {epoch}: loss {loss:.4f}  test accuracy {accuracy:.3f}  "
                  f"{exchanged / 1024:,.1f} KiB of activations and {total / 1024:,.1f} KiB in all sent per step",
                  flush=True)
    accuracy = evaluate(model, test_set)
    difference = largest_difference(model.full_state_dict())
    if rm.rank() == 0:
        print(f"final test accuracy {accuracy:.3f} after {time.perf_counter() - started:.1f} s; "
              f"ranks agree on the full model (max difference {difference:.1e})")
    rm.shutdown()


if __name__ == "__main__":
    main()
