"""``ringmaster.ops.adasum_allreduce`` on NumPy buffers, against the reference of
``adasum_checks_reference.tree``, per tensor of fused buffers, in float32, float64 and with a
float16 wire; every rank must end with bit-identical buffers. Then Adasum's two defining
properties at this rank count: orthogonal gradients give their sum, parallel ones their mean
(exactly parallel ones in float64; Horovod's own four cases, fp32 and fp16, as
test_adasum_pytorch.py checks them), and mixed ones the reference. Prints FAIL lines, then
DONE."""

import numpy as np
from mpi4py import MPI

from adasum_checks_reference import HOROVOD_TESTS, expected_mean, expected_sum, horovod_cases, horovod_close, tree
from job_report import Tally
from ringmaster.ops import adasum_allreduce

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
tally = Tally(rank)


def relative_error(got, expected) -> float:
    return float(np.max(np.abs(got - expected)) / np.max(np.abs(expected)))


CASES = [(10, [0, 10]), (1000, [0, 300, 301, 1000]), (7, [0, 3, 7]), (1, [0, 1]), (3, [0, 0, 3, 3]),
         (4096, [0, 1, 2, 4000, 4096])]
for n, edges in CASES:
    inputs = [np.random.default_rng(r * 7919 + n).standard_normal(n) for r in range(size)]
    expected = np.concatenate([tree([x[edges[t]:edges[t + 1]] for x in inputs]) if edges[t + 1] > edges[t]
                               else np.zeros(0) for t in range(len(edges) - 1)])
    for dtype, wire, tolerance in ((np.float32, None, 1e-5), (np.float64, None, 1e-12), (np.float32, np.float16, 5e-3)):
        buffer = inputs[rank].astype(dtype)
        adasum_allreduce(comm, buffer, edges, wire)
        error = relative_error(buffer, expected)
        case = f"n={n} edges={edges} {np.dtype(dtype).name} wire={None if wire is None else np.dtype(wire).name}"
        tally.report(f"{case} matches the reference", error <= tolerance, f"relative error {error:.3g}")
        identical = len(set(comm.allgather(buffer.tobytes()))) == 1
        tally.report(f"{case} is bit-identical on every rank", identical, "")

# The defining properties, in float64: orthogonal (disjoint supports, and a QR basis),
# parallel (one vector times coefficients of both signs), and mixed (a shared direction plus
# orthogonal parts, and a random mix), two tensors fused in one buffer (each on its own).
rng = np.random.default_rng(17)
n = 64 * size
disjoint = [np.where(np.arange(n) % size == r, rng.standard_normal(n), 0.0) for r in range(size)]
basis = np.linalg.qr(rng.standard_normal((n, size)))[0]
direction = rng.standard_normal(n)
coefficients = rng.choice([-1.0, 1.0], size) * rng.uniform(0.25, 4, size)  # no part of the tree cancels to 0
parallel = [coefficients[r] * direction for r in range(size)]
shared = [0.5 * direction + basis[:, r] for r in range(size)]
mixed = [rng.standard_normal(n) * (1 + r) + (r % 3) * direction for r in range(size)]
properties = [("orthogonal (disjoint)", disjoint, expected_sum(disjoint)),
              ("orthogonal (QR basis)", [basis[:, r] for r in range(size)], basis.sum(axis=1)),
              ("parallel", parallel, expected_mean(parallel)),
              ("mixed: shared direction and orthogonal parts", shared, None),
              ("mixed: random", mixed, None)]
for index, (case, vectors, expected) in enumerate(properties):
    beside = properties[(index + 1) % len(properties)][1]  # fused after it
    buffer = np.concatenate([vectors[rank], beside[rank]])
    adasum_allreduce(comm, buffer, [0, n, 2 * n])
    reference = tree(vectors)
    error = relative_error(buffer[:n], reference)
    tally.report(f"{size} ranks, {case}: matches the reference", error <= 1e-12, f"relative error {error:.3g}")
    if expected is not None:
        error = relative_error(buffer[:n], expected)
        what = "the sum" if case.startswith("orthogonal") else "the mean"
        tally.report(f"{size} ranks, {case}: gives {what}", error <= 1e-10, f"relative error {error:.3g}")

# Horovod's four tests (orthogonal, parallel, stability, stability 2), fp32 and fp16, on this
# op as ringmaster's allreduce runs them: float32 buffers, float16 travelling as float16
# (without the cases of 2^19 values: tests/jobs/adasum_checks.py runs those at 2 to 4 ranks).
for test in HOROVOD_TESTS:
    for dtype, vectors, expected in horovod_cases(test, size, largest=False):
        buffer = vectors[rank].astype(np.float32)
        adasum_allreduce(comm, buffer, [0, buffer.size], np.float16 if dtype == np.float16 else None)
        got = buffer.astype(dtype).astype(np.float64)
        ok, detail = horovod_close(dtype, expected, got)
        tally.report(f"Horovod's {test} test, {np.dtype(dtype).name}, {buffer.size} values", ok, detail)

for bad, words in ((np.ones(4, np.int32), "float32 or float64"), (np.ones((2, 2), np.float32), "1-D")):
    try:
        adasum_allreduce(comm, bad, [0, bad.size])
        tally.report(f"refuses {bad.dtype} {bad.shape}", False, "no error")
    except TypeError as error:
        tally.report(f"refuses {bad.dtype} {bad.shape}", words in str(error), str(error))
try:
    adasum_allreduce(comm, np.ones(4, np.float32), [0, 5])
    tally.report("refuses edges beyond the buffer", False, "no error")
except ValueError as error:
    tally.report("refuses edges beyond the buffer", "edges" in str(error), str(error))
tally.done()
