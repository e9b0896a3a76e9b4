"""grouped_allgather and grouped_reducescatter against a single-process reference.

Run under mpirun; prints FAIL lines, then ``DONE <cases> cases, <failures> failures``.
"""

import torch

import ringmaster as rm
from ringmaster.worker.runtime.executor import reducescatter_rows

rm.init()
RANK, SIZE = rm.rank(), rm.size()
cases = failures = 0


def check(case, got, expected, tolerance=1e-6):
    global cases, failures
    cases += 1
    ok = got.shape == expected.shape and torch.allclose(got.double(), expected.double(), atol=tolerance)
    if not ok:
        failures += 1
        print(f"FAIL {case} (rank {RANK}): got {got.flatten()[:6].tolist()} shape {tuple(got.shape)}, "
              f"expected {expected.flatten()[:6].tolist()} shape {tuple(expected.shape)}", flush=True)


def inputs(rank, seed):
    """Rank ``rank``'s tensors: their first dimensions differ per rank."""
    generator = torch.Generator().manual_seed(seed * 100 + rank)
    return [torch.randn(rank + 1, 3, generator=generator),
            torch.randint(0, 100, (2 * rank + 1,), generator=generator, dtype=torch.int64),
            torch.randn((), generator=generator).to(torch.float64)]


for round_ in range(3):
    got = rm.grouped_allgather(inputs(RANK, round_))
    for index, tensor in enumerate(got):
        expected = torch.cat([inputs(rank, round_)[index].reshape(-1, *inputs(rank, round_)[index].shape[1:])
                              if inputs(rank, round_)[index].dim() else inputs(rank, round_)[index].reshape(1)
                              for rank in range(SIZE)])
        check(f"grouped_allgather round {round_} tensor {index}", tensor, expected)


def rs_inputs(rank):
    generator = torch.Generator().manual_seed(rank)
    return [torch.randn(7, 2, generator=generator), torch.randn(SIZE * 2 + 1, generator=generator)]


for op, label in [(rm.Sum, "Sum"), (rm.Average, "Average")]:
    handle = rm.grouped_reducescatter_async(rs_inputs(RANK), op=op, postscale_factor=2.0)
    for index, tensor in enumerate(rm.synchronize(handle)):
        total = sum(rs_inputs(rank)[index] for rank in range(SIZE)) * 2.0
        if op == rm.Average:
            total = total / SIZE
        rows = reducescatter_rows(total.shape[0], SIZE)
        check(f"grouped_reducescatter {label} tensor {index}", tensor, total.split(rows)[RANK], 1e-5)

try:
    rm.grouped_reducescatter([torch.ones(4), torch.tensor(1.0)])
except ValueError as error:
    cases += 1
    if "at least one dimension" not in str(error):
        failures += 1
        print(f"FAIL grouped_reducescatter of a 0-d tensor: {error}")
print(f"DONE {cases} cases, {failures} failures", flush=True)
rm.shutdown()
