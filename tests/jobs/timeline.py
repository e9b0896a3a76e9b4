"""start_timeline/stop_timeline record every tensor's negotiation, queue and run.

Run under mpirun with the output directory as argv[1]; prints FAIL lines, then DONE.
"""

import json
import sys

import torch

import ringmaster as rm

rm.init()
RANK = rm.rank()
path = f"{sys.argv[1]}/timeline.{RANK}.json"
failures = []
rm.start_timeline(path, mark_cycles=True)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(10, 50), torch.nn.Tanh(), torch.nn.Linear(50, 5))
optimizer = rm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
for _ in range(3):
    optimizer.zero_grad()
    model(torch.randn(4, 10)).sum().backward()
    optimizer.step()
rm.allgather(torch.ones(2), name="gathered")
rm.broadcast(torch.ones(2), 0, name="broadcasted")
rm.stop_timeline()

events = json.load(open(path))  # must be valid JSON
rows = {event["pid"]: event["args"]["name"] for event in events if event.get("name") == "process_name"}
spans = {}
for event in events:
    if event["ph"] in "BE":
        spans.setdefault(rows[event["pid"]], []).append(event["ph"] + (event.get("name") or ""))
gradients = {f"DistributedOptimizer.{name}" for name, _ in model.named_parameters()}
# From the second step on, the optimizer's fixed gradient plan: one negotiated request per step.
plan_row = optimizer._plan.request_name if optimizer._plan is not None else "(no gradient plan)"
# (its ".agree" row is the vote of the first step on whether to use it)
expected_rows = gradients | {"gathered", "broadcasted", plan_row, plan_row + ".agree"}
if set(spans) != expected_rows:
    failures.append(f"rows {sorted(spans)} != {sorted(expected_rows)}")
for row, sequence in spans.items():
    if sequence.count("E") != len(sequence) - sequence.count("E"):
        failures.append(f"{row}: unbalanced spans {sequence}")
    # Gradients: negotiated in the first step; handed to the plan (READY) and reduced after.
    for phase in ("BNEGOTIATE_", "BQUEUE") + (("BREADY", "BALLREDUCE") if row in gradients else ()):
        if not any(step.startswith(phase) for step in sequence):
            failures.append(f"{row}: no {phase[1:]} span in {sequence}")
if spans.get("gathered", [None])[0] != "BNEGOTIATE_ALLGATHER" or "BALLGATHER" not in spans.get("gathered", []):
    failures.append(f"allgather spans: {spans.get('gathered')}")
if not any(step.endswith("_ALLREDUCE") and step.startswith(("BRING", "BMPI")) for step in
           spans.get("DistributedOptimizer.0.weight", [])):
    failures.append(f"no algorithm span in {spans.get('DistributedOptimizer.0.weight')}")
if not any(event["ph"] == "i" and event["name"] == "CYCLE_START" for event in events):
    failures.append("mark_cycles=True recorded no CYCLE_START")
rm.stop_timeline()  # a second stop does nothing
for failure in failures:
    print(f"FAIL rank {RANK}: {failure}", flush=True)
print(f"DONE {len(failures)} failures", flush=True)
rm.shutdown()
