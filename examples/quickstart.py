"""README's quick start: the five lines a single-process script adds (run: ringrun -np 2 python examples/quickstart.py)."""
import torch
import ringmaster as rm

rm.init()                                                        # 1. join the job
model = torch.nn.Linear(10, 1)
for p in model.parameters():                                     # 2. start from rank 0's weights
    rm.broadcast_(p.data, root_rank=0)
opt = torch.optim.SGD(model.parameters(), lr=0.01 * rm.size())   # 3. scale the learning rate
data = torch.randn(1024, 10, generator=torch.Generator().manual_seed(0))
for x in data[rm.rank()::rm.size()].split(32):                   # 4. each rank its own shard
    loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    rm.grouped_allreduce_([p.grad for p in model.parameters()])  # 5. average the gradients
    opt.step()
print(rm.rank(), "final loss", rm.allreduce(loss.detach()).item())
