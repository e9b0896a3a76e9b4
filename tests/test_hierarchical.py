"""ringmaster.ops.hierarchical_allreduce on real mpirun jobs, the world cut into pretend hosts.

The job splits MPI_COMM_WORLD into "hosts" of ``L`` consecutive ranks (its argument) and the
communicators of one local rank across them, as the runtime does from MPI's shared-memory
nodes, and checks every dtype, op and length against NumPy (with the helpers of
test_ops_collectives.py), every rank holding the same bytes.
"""

import pytest
from mpijob import mpirun
from test_ops_collectives import PRELUDE, assert_job_ok

from ringmaster.ops.hierarchical import chunk_counts

HIERARCHICAL_CASES = PRELUDE + r'''
from ringmaster.ops import hierarchical_allreduce

local_size = int(sys.argv[1])
local = comm.Split(color=rank // local_size, key=rank)
cross = comm.Split(color=rank % local_size, key=rank)
for dtype in DTYPES:
    for op in OPS:
        for n in (0, 1, 3, 7, 1023, 100_003):
            seed = (DTYPES.index(dtype), OPS.index(op), n, 7)
            inputs = [make(seed + (k,), dtype, op, n) for k in range(size)]
            want = reduce_all(inputs, op)
            for algorithm in ("ring", "mpi"):
                label = f"hierarchical {algorithm} {dtype} {op} n={n}"
                buffer = inputs[rank].copy()
                if hierarchical_allreduce(local, cross, buffer, op, algorithm=algorithm, segment_bytes=4096) \
                        is not buffer:
                    failures.append(f"{label}: did not return the buffer it reduced in place")
                check(label, buffer, want)
                check_identical(label, buffer)

# An average: the sum scaled once, between the hosts.
inputs = [make((5, k), "float32", "sum", 10_001) for k in range(size)]
buffer = inputs[rank].copy()
hierarchical_allreduce(local, cross, buffer, "sum", scale=1.0 / size)
check("hierarchical average", buffer, (reduce_all(inputs, "sum") / np.float32(size)).astype(np.float32))
check_identical("hierarchical average", buffer)
try:
    hierarchical_allreduce(local, cross, np.ones(4, np.int32), "sum", scale=0.5)
    failures.append("an integer buffer with scale= was accepted")
except ValueError as error:
    checks += 1
    if "floating-point" not in str(error):
        failures.append(f"unclear error: {error}")
report()
'''


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("np_, local_size", [(4, 2), (6, 3), (3, 1)],
                         ids=["2 hosts x 2", "2 hosts x 3", "3 hosts x 1"])  # (3 hosts x 2 adds nothing these lack)
def test_hierarchical_allreduce_equals_the_reduction(np_, local_size):
    assert_job_ok(mpirun(np_, HIERARCHICAL_CASES, timeout=110, args=[str(local_size)]), "hierarchical cases")


def test_chunks_split_as_numpy_does():
    assert chunk_counts(10, 3).tolist() == [4, 3, 3]
    assert chunk_counts(2, 4).tolist() == [1, 1, 0, 0]
    assert chunk_counts(0, 2).tolist() == [0, 0]
