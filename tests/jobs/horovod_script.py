"""A training script written against horovod.torch's API, as its users write them.

tests/test_horovod_compat.py runs it with the first import line changed to ringmaster and
nothing else.
"""
import horovod.torch as hvd

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--fp16-allreduce", action="store_true")
parser.add_argument("--use-adasum", action="store_true")
args = parser.parse_args()

hvd.init()
torch.manual_seed(42)
torch.set_num_threads(1)

# A synthetic, learnable classification problem.
generator = torch.Generator().manual_seed(0)
features = torch.randn(2048, 20, generator=generator)
labels = (features[:, :5].sum(dim=1) > 0).long()
train_set = TensorDataset(features[:1536], labels[:1536])
test_set = TensorDataset(features[1536:], labels[1536:])
train_sampler = DistributedSampler(train_set, num_replicas=hvd.size(), rank=hvd.rank())
train_loader = DataLoader(train_set, batch_size=32, sampler=train_sampler)
test_sampler = DistributedSampler(test_set, num_replicas=hvd.size(), rank=hvd.rank())
test_loader = DataLoader(test_set, batch_size=64, sampler=test_sampler)

model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 2))
lr_scaler = hvd.size() if not args.use_adasum else 1
optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * lr_scaler, momentum=0.9)

hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)

compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                     compression=compression,
                                     op=hvd.Adasum if args.use_adasum else hvd.Average)


def metric_average(val, name):
    tensor = torch.tensor(val)
    avg_tensor = hvd.allreduce(tensor, name=name)
    return avg_tensor.item()


for epoch in range(1, args.epochs + 1):
    model.train()
    train_sampler.set_epoch(epoch)
    for batch_idx, (data, target) in enumerate(train_loader):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(data), target)
        loss.backward()
        optimizer.step()
    model.eval()
    test_loss, correct = 0.0, 0.0
    with torch.no_grad():
        for data, target in test_loader:
            output = model(data)
            test_loss += F.cross_entropy(output, target, reduction="sum").item()
            correct += output.argmax(dim=1).eq(target).float().sum().item()
    test_loss = metric_average(test_loss / len(test_sampler), "avg_loss")
    test_accuracy = metric_average(correct / len(test_sampler), "avg_accuracy")
    if hvd.rank() == 0:
        print(f"epoch {epoch}: test loss {test_loss:.4f}, accuracy {100.0 * test_accuracy:.1f}%", flush=True)

hosts = hvd.allgather_object({"rank": hvd.rank(), "local_rank": hvd.local_rank()})
weights = hvd.allgather(torch.cat([p.detach().flatten() for p in model.parameters()]).unsqueeze(0))
print(f"rank {hvd.rank()} of {hvd.size()}: saw {len(hosts)} ranks, "
      f"weights identical: {all(torch.equal(weights[0], w) for w in weights)}", flush=True)
hvd.join()
hvd.shutdown()
