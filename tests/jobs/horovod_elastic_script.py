"""An elastic training script written against horovod.torch's elastic API, as its users write them.

tests/test_elastic.py runs it with the first import line changed to ringmaster and nothing
else (one process, outside an elastic launcher); tests/test_elastic_cluster.py runs the same
under an elastic ``ringrun`` on three hosts. Each epoch it prints how many examples the
ranks processed together (the sampler's ``processed_num``): ``EPOCH e processed n of N``.
"""
import horovod.torch as hvd

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--batch-size", type=int, default=8)
parser.add_argument("--batches-per-commit", type=int, default=2)
parser.add_argument("--step-sleep", type=float, default=0.0)
args = parser.parse_args()

hvd.init()
torch.manual_seed(42)
torch.set_num_threads(1)

generator = torch.Generator().manual_seed(0)
features = torch.randn(192, 10, generator=generator)
labels = (features[:, :3].sum(dim=1) > 0).long()
train_set = TensorDataset(features, labels)

model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 2))
lr_scaler = hvd.size()
optimizer = torch.optim.SGD(model.parameters(), lr=0.05 * lr_scaler, momentum=0.9)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

train_sampler = hvd.elastic.ElasticSampler(train_set, shuffle=True, seed=3)
train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler)


def on_state_reset():
    # the learning rate follows the number of ranks, as in Horovod's examples
    for param_group in optimizer.param_groups:
        param_group["lr"] = 0.05 * hvd.size()
    print(f"RESET to {hvd.size()} ranks", flush=True)


state = hvd.elastic.TorchState(model, optimizer, train_sampler=train_sampler, epoch=0, batch=0)
state.register_reset_callbacks([on_state_reset])


@hvd.elastic.run
def train(state):
    for state.epoch in range(state.epoch, args.epochs):
        model.train()
        for state.batch, (data, target) in enumerate(train_loader):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(data), target)
            loss.backward()
            optimizer.step()
            state.train_sampler.record_batch(state.batch, args.batch_size)
            if args.step_sleep:
                time.sleep(args.step_sleep)
            if state.batch % args.batches_per_commit == 0:
                state.commit()
        processed = state.train_sampler.processed_num
        if hvd.rank() == 0:
            print(f"EPOCH {state.epoch} processed {processed} of {len(train_set)}", flush=True)
        state.batch = 0
        state.train_sampler.set_epoch(state.epoch + 1)
        state.commit()
    return loss.item()


final_loss = train(state)
if hvd.rank() == 0:
    print(f"FINISHED on {hvd.size()} ranks, loss {final_loss:.4f}", flush=True)
