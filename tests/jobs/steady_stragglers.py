"""A straggler in steady training: rank SLOW sleeps 50 ms a step after the first two steps.

Run under mpirun as ``steady_stragglers.py STEPS SLOW``. Each step is a DistributedOptimizer
step (its gradient plan from the second step on: no negotiation) and a metric allreduced
through the response cache. Nothing else is negotiated, so the coordinator's straggler
report (logged at the end of the job) sees the slow rank only through the lateness probes
(``worker/frontend/lateness_probes.py``). Prints ``PLAN <rank> <bool>`` (the plan ran) and
``DONE``; the test reads the report.
"""

import sys
import time

import torch

import ringmaster as rm

rm.init()
RANK = rm.rank()
torch.set_num_threads(1)
STEPS, SLOW = int(sys.argv[1]), int(sys.argv[2])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
opt = rm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters())
for step in range(STEPS):
    if RANK == SLOW and step >= 2:
        time.sleep(0.05)
    x = torch.randn(8, 16)
    opt.zero_grad()
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    rm.allreduce(loss.detach(), name="loss")
print(f"PLAN {RANK} {opt._plan is not None and opt._plan.runs_ahead()}", flush=True)
print("DONE", flush=True)
rm.shutdown()
