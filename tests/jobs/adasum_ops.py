"""``ringmaster.ops.adasum_allreduce`` on NumPy buffers, against the reference of
``adasum_checks.tree``, per tensor of fused buffers, in float32, float64 and with a float16
wire; every rank must end with bit-identical buffers. Prints FAIL lines, then DONE."""

import numpy as np
from mpi4py import MPI

from adasum_checks_reference import tree
from job_report import Tally
from ringmaster.ops import adasum_allreduce

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
tally = Tally(rank)
CASES = [(10, [0, 10]), (1000, [0, 300, 301, 1000]), (7, [0, 3, 7]), (1, [0, 1]), (3, [0, 0, 3, 3]),
         (4096, [0, 1, 2, 4000, 4096])]
for n, edges in CASES:
    inputs = [np.random.default_rng(r * 7919 + n).standard_normal(n) for r in range(size)]
    expected = np.concatenate([tree([x[edges[t]:edges[t + 1]] for x in inputs]) if edges[t + 1] > edges[t]
                               else np.zeros(0) for t in range(len(edges) - 1)])
    for dtype, wire, tolerance in ((np.float32, None, 1e-5), (np.float64, None, 1e-12), (np.float32, np.float16, 5e-3)):
        buffer = inputs[rank].astype(dtype)
        adasum_allreduce(comm, buffer, edges, wire)
        error = float(np.max(np.abs(buffer - expected)) / np.max(np.abs(expected)))
        case = f"n={n} edges={edges} {np.dtype(dtype).name} wire={None if wire is None else np.dtype(wire).name}"
        tally.report(f"{case} matches the reference", error <= tolerance, f"relative error {error:.3g}")
        identical = len(set(comm.allgather(buffer.tobytes()))) == 1
        tally.report(f"{case} is bit-identical on every rank", identical, "")
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
