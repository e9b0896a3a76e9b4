"""Train a handwritten-digit classifier on several processes with ringmaster's DistributedOptimizer.

    ringrun -np 2 python examples/pytorch_digits.py
    ringrun -np 2 python examples/pytorch_digits.py --epochs 5 --checkpoint digits.pt
    ringrun -np 2 python examples/pytorch_digits.py --epochs 10 --checkpoint digits.pt --resume
    ringrun -np 2 python examples/pytorch_digits.py --compression int8     # or fp16, bf16, linear8, rgc, topk
    ringrun -np 2 python examples/pytorch_digits.py --compression powersgd --powersgd-rank 4
    ringrun -np 4 python examples/pytorch_digits.py --use-adasum           # Adasum, single-rank learning rate

The 1 797 8×8 digit images that ship with scikit-learn (no download) are split once, with a
fixed seed, into a training and a test set. Every rank trains on its own shard of the
training set, reshuffled each epoch; DistributedOptimizer averages the gradients over the
ranks while backward runs, so all ranks take the same step, and the learning rate is scaled
by the number of ranks because the global batch is that many times larger. Rank 0 writes
the checkpoints; with --resume, training continues after the checkpoint's epoch.

--compression picks how gradients travel: fp16 or bf16 (half the bytes; bf16 keeps float32's
range), 8-bit codes (int8: Dettmers' dynamic tree, linear8), only the largest --ratio of each
gradient's entries (rgc: RedSync's residual gradient compression, which keeps what it did not
send for later steps and applies the momentum itself, with momentum correction; topk: the
same without residuals), or rank---powersgd-rank factors of each weight matrix (powersgd:
PowerSGD, with error feedback, after --powersgd-start steps of plain averaging).

--use-adasum combines the ranks' updates with Adasum (``op=rm.Adasum``) instead of averaging
their gradients, at the single-rank learning rate unless --lr-scaler says otherwise.

On a machine with GPUs each rank trains on GPU ``local_rank()`` (ranks beyond the number of
GPUs share them), as Horovod scripts pin theirs; without GPUs, on the CPU.
"""

import argparse
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import ringmaster as rm
from progress import progress_bar  # examples/progress.py

SPLIT_SEED = 0  # the train/test split never changes, whatever --seed says


def load_data():
    """The digits as standardized (train, test) datasets, identical on every rank."""
    digits = load_digits()
    images = torch.tensor(digits.data, dtype=torch.float32)
    labels = torch.tensor(digits.target)
    train_images, test_images, train_labels, test_labels = train_test_split(
        images, labels, test_size=0.25, random_state=SPLIT_SEED, stratify=labels)
    mean, std = train_images.mean(0), train_images.std(0).clamp_min(1.0)  # some border pixels are always 0
    return (TensorDataset((train_images - mean) / std, train_labels),
            TensorDataset((test_images - mean) / std, test_labels))


MOMENTUM = 0.9
COMPRESSIONS = ("none", "fp16", "bf16", "int8", "linear8", "rgc", "topk", "powersgd")


def make_compression(name: str, ratio: float, momentum: float, powersgd_rank: int = 4, powersgd_start: int = 20):
    """(compression, momentum left to the optimizer) for --compression.

    rgc applies the momentum itself (momentum correction: every entry accumulates its
    momentum while it waits to be sent), so the optimizer then runs without.
    """
    if name == "rgc":
        return rm.Compression.rgc(ratio=ratio, momentum=momentum, min_size=1024, warmup_steps=20), 0.0
    if name == "topk":
        return rm.Compression.topk(ratio=ratio, min_size=1024), momentum
    if name == "powersgd":
        return rm.Compression.powersgd(rank=powersgd_rank, start_iter=powersgd_start), momentum
    return getattr(rm.Compression, name), momentum


def create_model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))


def save_checkpoint(path, model, optimizer, epoch):
    """Write the model, the optimizer state and the finished epoch; a crash mid-write keeps the previous file."""
    temporary = f"{path}.tmp"
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch}, temporary)
    os.replace(temporary, path)


def load_checkpoint(path, model, optimizer) -> int:
    """Restore the model and the optimizer from ``path``; return the epoch it finished (0 without a file)."""
    if not os.path.exists(path):
        print(f"no checkpoint at {path}: starting from scratch", flush=True)
        return 0
    checkpoint = torch.load(path, map_location="cpu")  # load_state_dict moves it to the model's device
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    return checkpoint["epoch"]


def train_epoch(model, optimizer, loader, description, device):
    """One pass over this rank's shard: (loss averaged over all ranks, total samples/s, bytes this rank sent
    per step)."""
    model.train()
    started = time.perf_counter()
    loss_sum, samples, steps = 0.0, 0, 0
    rm.bytes_sent(reset=True)
    for images, labels in progress_bar(loader, description):
        images, labels = images.to(device), labels.to(device)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(images), labels)
        loss.backward()  # starts averaging each gradient as soon as it is computed
        optimizer.step()  # waits for the averaged gradients, then updates
        loss_sum += loss.item() * len(labels)
        samples += len(labels)
        steps += 1
    bytes_per_step = rm.bytes_sent()["total"] / max(steps, 1)
    seconds = time.perf_counter() - started
    mean_loss = rm.allreduce(torch.tensor(loss_sum / samples), op=rm.Average).item()
    samples_per_second = rm.allreduce(torch.tensor(samples / seconds), op=rm.Sum).item()
    return mean_loss, samples_per_second, bytes_per_step


@torch.no_grad()
def evaluate(model, dataset, device) -> float:
    """Accuracy on the whole of ``dataset`` (every rank evaluates the same, small test set)."""
    model.eval()
    images, labels = (tensor.to(device) for tensor in dataset.tensors)
    return (model(images).argmax(dim=1) == labels).float().mean().item()


def largest_weight_difference(model) -> float:
    """The largest difference of any weight between any two ranks (0 when they agree)."""
    weights = torch.cat([parameter.detach().flatten() for parameter in model.parameters()])
    return (rm.allreduce(weights, op=rm.Max) - rm.allreduce(weights, op=rm.Min)).max().item()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=10, help="train until this epoch (also when resuming)")
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.02,
                        help="for one rank; scaled by --lr-scaler (default: the number of ranks, 1 with --use-adasum)")
    parser.add_argument("--use-adasum", action="store_true",
                        help="combine the ranks' updates with Adasum instead of averaging gradients")
    parser.add_argument("--lr-scaler", type=float, help="multiply --lr by this (see --lr)")
    parser.add_argument("--seed", type=int, default=42, help="rank 0's initial weights and the shuffling of each epoch")
    parser.add_argument("--checkpoint", metavar="PATH", help="rank 0 saves model and optimizer here after each epoch")
    parser.add_argument("--resume", action="store_true", help="continue from --checkpoint, if it exists")
    parser.add_argument("--compression", choices=sorted(COMPRESSIONS), default="none",
                        help="how gradients travel (default: as they are)")
    parser.add_argument("--ratio", type=float, default=0.01,
                        help="rgc/topk: the fraction of each gradient's entries sent per step")
    parser.add_argument("--powersgd-rank", type=int, default=4, help="powersgd: the rank of the factors")
    parser.add_argument("--powersgd-start", type=int, default=20,
                        help="powersgd: steps of plain averaging before compression starts")
    args = parser.parse_args()
    if args.resume and not args.checkpoint:
        parser.error("--resume needs --checkpoint PATH")

    rm.init()
    torch.set_num_threads(1)  # the ranks share the machine's cores
    torch.manual_seed(args.seed + rm.rank())  # different weights on purpose: broadcast_parameters aligns them
    device = torch.device("cpu")
    if torch.cuda.is_available():  # one GPU per rank
        device = torch.device("cuda", rm.local_rank() % torch.cuda.device_count())
        torch.cuda.set_device(device)

    train_set, test_set = load_data()
    # Each rank a disjoint shard of the training set, reshuffled by set_epoch() with the same seed on all ranks.
    sampler = DistributedSampler(train_set, num_replicas=rm.size(), rank=rm.rank(), shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)

    model = create_model().to(device)
    compression, optimizer_momentum = make_compression(args.compression, args.ratio, MOMENTUM, args.powersgd_rank,
                                                       args.powersgd_start)
    # Average: the batch is size() times larger, and so is the learning rate. Adasum adapts the
    # step itself (docs/api.md): the single-rank learning rate, as in Horovod's examples.
    lr_scaler = args.lr_scaler if args.lr_scaler is not None else (1.0 if args.use_adasum else rm.size())
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * lr_scaler, momentum=optimizer_momentum)
    optimizer = rm.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                        compression=compression, op=rm.Adasum if args.use_adasum else rm.Average)

    # Rank 0 restores the checkpoint and hands its epoch, weights and optimizer state to the others.
    finished_epoch = 0
    if args.resume and rm.rank() == 0:
        finished_epoch = load_checkpoint(args.checkpoint, model, optimizer)
    finished_epoch = rm.broadcast_object(finished_epoch, root_rank=0)
    rm.broadcast_parameters(model.state_dict(), root_rank=0)
    rm.broadcast_optimizer_state(optimizer, root_rank=0)
    if rm.rank() == 0:
        print(f"training on {rm.size()} ranks ({'Adasum' if args.use_adasum else 'Average'}, learning rate "
              f"{args.lr} x {lr_scaler:g}), {len(sampler)} samples each per epoch, "
              f"from epoch {finished_epoch + 1} to {args.epochs}", flush=True)

    for epoch in range(finished_epoch + 1, args.epochs + 1):
        sampler.set_epoch(epoch)
        loss, samples_per_second, bytes_per_step = train_epoch(model, optimizer, loader, f"epoch {epoch}/{args.epochs}",
                                                               device)
        accuracy = evaluate(model, test_set, device)
        if rm.rank() == 0:
            print(f"epoch {epoch}: loss {loss:.4f}  test accuracy {accuracy:.3f}  "
                  f"{samples_per_second:,.0f} samples/s on {rm.size()} ranks  "
                  f"{bytes_per_step / 1024:,.1f} KiB sent per step", flush=True)
            if args.checkpoint:
                save_checkpoint(args.checkpoint, model, optimizer, epoch)

    accuracy = evaluate(model, test_set, device)
    difference = largest_weight_difference(model)
    if rm.rank() == 0:
        print(f"final test accuracy {accuracy:.3f}; ranks agree on the weights (max difference {difference:.1e})")
    rm.shutdown()


if __name__ == "__main__":
    main()
