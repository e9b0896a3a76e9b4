"""README's quick start: the five lines a single-process script adds
(run: ringrun -np 2 python examples/quickstart.py)."""
import torch
import ringmaster as rm

rm.init()                                                            # 1. join the job
model = torch.nn.Linear(10, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01 * rm.size())       # 2. scale the learning rate
opt = rm.DistributedOptimizer(opt, model.named_parameters())         # 3. average gradients
rm.broadcast_parameters(model.state_dict(), root_rank=0)             # 4. start from rank 0's
rm.broadcast_optimizer_state(opt, root_rank=0)                       #    weights and state
data = torch.randn(1024, 10, generator=torch.Generator().manual_seed(0))
for x in data[rm.rank()::rm.size()].split(32):                       # 5. each rank its own shard
    loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
print(rm.rank(), "final loss", rm.allreduce(loss.detach()).item())
