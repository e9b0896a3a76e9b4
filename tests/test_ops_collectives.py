"""ringmaster.ops collectives: real mpirun jobs at 2 and 4 ranks, plus local input checks.

Each multi-rank test is ONE mpirun job that runs many cases (starting a job costs ~2 s
and the CI machine has 2 cores). Every rank regenerates every rank's input from a seed,
computes the expected result with NumPy, and prints ``FAIL ...`` per mismatch; rank 0
prints ``OK <count>`` when all ranks passed.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from mpijob import mpirun

import ringmaster.ops as ops
from ringmaster.ops import (allgatherv, allreduce, alltoallv, broadcast, choose_algorithm,
                            mpi_allreduce, reducescatter, ring_allreduce)

# Shared by the job scripts: seeded inputs any rank can regenerate, and comparisons.
PRELUDE = r'''
import sys, zlib
import numpy as np
from mpi4py import MPI
from ringmaster.ops import (allgatherv, allreduce, alltoallv, broadcast, mpi_allreduce,
                            reducescatter, ring_allreduce, ring_reducescatter)

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
DTYPES = ["float16", "float32", "float64", "int32", "int64", "uint8", "bool"]
OPS = ["sum", "min", "max", "prod"]
TOLERANCE = {"float16": 1e-2, "float32": 1e-5, "float64": 1e-12}
failures = []
checks = 0


def make(seed, dtype, op, n):
    """Rank-independent seeded input: small values, so that prod neither overflows nor
    underflows and integer sums stay exact (wrap-around would too, but is not the point)."""
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.random(n) < (0.7 if op in ("prod", "min") else 0.3)
    if dtype.kind == "f":
        if op == "prod":
            return (rng.uniform(0.5, 2.0, n) * rng.choice([-1.0, 1.0], n)).astype(dtype)
        return rng.standard_normal(n).astype(dtype)
    if op == "prod":
        return rng.integers(-3 if dtype.kind == "i" else 0, 4, n).astype(dtype)
    low = 0 if dtype.kind == "u" else -1000
    return rng.integers(low, 256 if dtype.kind == "u" else 1000, n).astype(dtype)


REFERENCE = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}
BOOL_REFERENCE = {"sum": np.logical_or, "max": np.logical_or,
                  "prod": np.logical_and, "min": np.logical_and}


def reduce_all(inputs, op):
    ufunc = (BOOL_REFERENCE if inputs[0].dtype == np.bool_ else REFERENCE)[op]
    result = inputs[0].copy()
    for other in inputs[1:]:
        ufunc(result, other, out=result)
    return result


def check(label, got, want):
    global checks
    checks += 1
    if got.dtype != want.dtype or got.shape != want.shape:
        failures.append(f"{label}: got {got.dtype}{got.shape}, want {want.dtype}{want.shape}")
        return
    name = str(want.dtype)
    if name in TOLERANCE:
        tol = TOLERANCE[name]
        ok = np.allclose(got.astype(np.float64), want.astype(np.float64), rtol=tol, atol=tol,
                         equal_nan=True)
    else:
        ok = np.array_equal(got, want)
    if not ok:
        bad = np.flatnonzero(~np.isclose(got.astype(np.float64), want.astype(np.float64),
                                         rtol=TOLERANCE.get(name, 0), atol=TOLERANCE.get(name, 0)))
        failures.append(f"{label}: {bad.size} elements differ, first at {bad[:3].tolist()}: "
                        f"got {got[bad[:3]].tolist()} want {want[bad[:3]].tolist()}")


def check_identical(label, array):
    """Every rank holds the same bytes (the ring's allgather guarantees it)."""
    global checks
    checks += 1
    digests = comm.allgather(zlib.crc32(array.tobytes()))
    if len(set(digests)) != 1:
        failures.append(f"{label}: ranks disagree (crc32 {digests})")


def report():
    every = comm.gather(failures, root=0)
    total = comm.reduce(checks, root=0)
    if rank == 0:
        for r, failed in enumerate(every):
            for line in failed:
                print(f"FAIL rank {r}: {line}")
        if not any(every):
            print(f"OK {total}")
    sys.stdout.flush()
'''

ALLREDUCE_CASES = PRELUDE + r'''
LENGTHS = [0, 1, 3, 7, 1023, 1_000_003]
for dtype in DTYPES:
    for op in OPS:
        for n in LENGTHS:
            seed = (DTYPES.index(dtype), OPS.index(op), n)
            inputs = [make(seed + (k,), dtype, op, n) for k in range(size)]
            want = reduce_all(inputs, op)
            for algorithm in ("ring", "mpi"):
                label = f"allreduce {algorithm} {dtype} {op} n={n}"
                buffer = inputs[rank].copy()
                result = allreduce(comm, buffer, op, algorithm=algorithm)
                if result is not buffer:
                    failures.append(f"{label}: did not return the buffer it reduced in place")
                check(label, buffer, want)
                if algorithm == "ring":
                    check_identical(label, buffer)

# Segments of one element, of sizes that are not a multiple of the element, and a
# segment larger than a chunk: the pipeline at its edges.
for dtype, op, n, segment_bytes in [("float64", "sum", 1023, 1), ("int32", "max", 1023, 100),
                                    ("uint8", "sum", 4099, 7), ("bool", "min", 1023, 64),
                                    ("float16", "prod", 2001, 30), ("int64", "sum", 100_003, 4096),
                                    ("float32", "sum", 5, 1 << 30)]:
    inputs = [make((99, n, segment_bytes, k), dtype, op, n) for k in range(size)]
    buffer = inputs[rank].copy()
    label = f"ring {dtype} {op} n={n} segment_bytes={segment_bytes}"
    ring_allreduce(comm, buffer, op, segment_bytes=segment_bytes)
    check(label, buffer, reduce_all(inputs, op))
    check_identical(label, buffer)

# "auto" on both sides of every crossover; the same buffer reduced twice in a row.
for n in [1, 1000, 300_000, 2_000_000]:
    for dtype in ("float32", "float16"):
        inputs = [make((7, n, k), dtype, "sum", n) for k in range(size)]
        buffer = inputs[rank].copy()
        allreduce(comm, buffer, "sum")
        check(f"auto {dtype} sum n={n}", buffer, reduce_all(inputs, "sum"))
# Out of place (source=): the input is left alone and the result lands in buffer.
for dtype in DTYPES:
    for op in OPS:
        for n in (0, 1, 3, 7, 4099):
            seed = (55, DTYPES.index(dtype), OPS.index(op), n)
            inputs = [make(seed + (k,), dtype, op, n) for k in range(size)]
            for algorithm in ("ring", "mpi"):
                label = f"allreduce source= {algorithm} {dtype} {op} n={n}"
                source = inputs[rank].copy()
                buffer = np.full(n, 1, dtype=dtype)  # garbage that must be overwritten
                allreduce(comm, buffer, op, algorithm=algorithm, source=source)
                check(label, buffer, reduce_all(inputs, op))
                check(label + " leaves source", source, inputs[rank])
inputs = [make((56, k), "float32", "sum", 10_007) for k in range(size)]
source, buffer = inputs[rank].copy(), np.empty(10_007, np.float32)
ring_allreduce(comm, buffer, "sum", segment_bytes=64, source=source)
check("ring source= small segments", buffer, reduce_all(inputs, "sum"))
check_identical("ring source= small segments", buffer)

# scale=: the result multiplied once (each chunk by the rank that finishes it), bit-identical everywhere.
for algorithm in ("ring", "mpi"):
    for dtype in ("float32", "float64", "float16"):
        for n in (0, 1, 5, 10_007):
            inputs = [make((57, k, n), dtype, "sum", n) for k in range(size)]
            buffer = inputs[rank].copy()
            allreduce(comm, buffer, "sum", algorithm=algorithm, scale=1.0 / size)
            expected = (reduce_all(inputs, "sum").astype(np.float64) / size).astype(dtype)
            check(f"allreduce scale=1/size {algorithm} {dtype} n={n}", buffer, expected)
            check_identical(f"allreduce scale=1/size {algorithm} {dtype} n={n}", buffer)
inputs = [make((58, k), "float32", "sum", 10_007) for k in range(size)]
buffer = inputs[rank].copy()
ring_allreduce(comm, buffer, "sum", segment_bytes=64, scale=0.5)
check("ring scale=0.5 small segments", buffer, reduce_all(inputs, "sum") * np.float32(0.5))

buffer = np.arange(10, dtype=np.int64)
ring_allreduce(comm, buffer)
ring_allreduce(comm, buffer)
check("ring twice", buffer, np.arange(10, dtype=np.int64) * size * size)
report()
'''

OTHER_CASES = PRELUDE + r'''
for dtype in DTYPES:
    d = DTYPES.index(dtype)
    # allgatherv: uneven counts with zeros, everything on one rank, nothing at all.
    for counts in ([(3 * k + 1) % 5 for k in range(size)], [0] * (size - 1) + [1000],
                   [0] * size, [10_000 + k for k in range(size)]):
        parts = [make((d, 1, k, counts[k]), dtype, "sum", counts[k]) for k in range(size)]
        got = allgatherv(comm, parts[rank].copy(), counts)
        check(f"allgatherv {dtype} counts={counts}", got, np.concatenate(parts))

    # broadcast from a non-zero root.
    for root, n in [(size - 1, 0), (size - 1, 5), (1, 100_003)]:
        source = make((d, 2, root, n), dtype, "sum", n)
        buffer = source.copy() if rank == root else np.zeros(n, dtype)
        result = broadcast(comm, buffer, root)
        if result is not buffer:
            failures.append(f"broadcast {dtype}: did not return its buffer")
        check(f"broadcast {dtype} root={root} n={n}", buffer, source)

    # alltoallv: rank r sends (r + 2i) % 3 elements to rank i (some zero).
    def part(sender, receiver):
        n = (sender + 2 * receiver) % 3 + (50 if (sender + receiver) % 2 else 0)
        return make((d, 3, sender, receiver), dtype, "sum", n)
    sendbuf = np.concatenate([part(rank, i) for i in range(size)])
    sendcounts = [part(rank, i).size for i in range(size)]
    recvcounts = [part(i, rank).size for i in range(size)]
    got = alltoallv(comm, sendbuf, sendcounts, recvcounts)
    check(f"alltoallv {dtype}", got, np.concatenate([part(i, rank) for i in range(size)]))

    # reducescatter: uneven counts with a zero, every op; and the default split.
    for op in OPS:
        for counts in ([(3 * k) % 7 for k in range(size)], None):
            n = 1001 if counts is None else sum(counts)
            inputs = [make((d, 4, OPS.index(op), n, k), dtype, op, n) for k in range(size)]
            want = reduce_all(inputs, op)
            bounds = np.cumsum([0] + (counts or [len(c) for c in np.array_split(want, size)]))
            source = inputs[rank].copy()
            got = reducescatter(comm, source, op, counts)
            check(f"reducescatter {dtype} {op} counts={counts}", got,
                  want[bounds[rank]:bounds[rank + 1]])
            check(f"reducescatter {dtype} {op} leaves its input alone", source, inputs[rank])
            # The ring's scatter-reduce, called directly: every dtype and op, a rank with nothing.
            ring_counts = counts or [len(c) for c in np.array_split(want, size)]
            got = ring_reducescatter(comm, source, op, ring_counts)
            check(f"ring_reducescatter {dtype} {op} counts={ring_counts}", got,
                  want[bounds[rank]:bounds[rank + 1]])
            check(f"ring_reducescatter {dtype} {op} leaves its input alone", source, inputs[rank])

# reducescatter above the ring's crossover (4 MiB at 4 ranks) runs the ring: uneven parts.
n = 1_100_001
inputs = [make((9, k), "float32", "sum", n) for k in range(size)]
want = reduce_all(inputs, "sum")
counts = [n - 1000 * (size - 1)] + [1000] * (size - 1)
bounds = np.cumsum([0] + counts)
check("reducescatter 4.4 MB float32 (the ring)", reducescatter(comm, inputs[rank], "sum", counts),
      want[bounds[rank]:bounds[rank + 1]])
report()
'''


def assert_job_ok(result, script_name):
    assert result.returncode == 0, f"{script_name} failed:\n{result.output[-6000:]}"
    failures = [line for line in result.stdout.splitlines() if line.startswith("FAIL")]
    assert not failures, "\n".join(failures[:40])
    assert result.lines_starting("OK"), f"{script_name} printed no OK:\n{result.output[-6000:]}"


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("np_", [2, 4])
def test_allreduce_every_op_dtype_length(np_):
    assert_job_ok(mpirun(np_, ALLREDUCE_CASES, timeout=80), "allreduce cases")


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("np_", [2, 4])
def test_allgatherv_broadcast_alltoallv_reducescatter(np_):
    assert_job_ok(mpirun(np_, OTHER_CASES, timeout=50), "collective cases")


# ---- in-process: one rank (MPI.COMM_SELF) ----------------------------------------------

SELF = MPI.COMM_SELF
CALLS = {
    "allreduce": lambda buffer: allreduce(SELF, buffer),
    "ring_allreduce": lambda buffer: ring_allreduce(SELF, buffer),
    "mpi_allreduce": lambda buffer: mpi_allreduce(SELF, buffer),
    "broadcast": lambda buffer: broadcast(SELF, buffer, 0),
    "allgatherv": lambda buffer: allgatherv(SELF, buffer, [getattr(buffer, "size", 0)]),
    "alltoallv": lambda buffer: alltoallv(SELF, buffer, [getattr(buffer, "size", 0)], [0]),
    "reducescatter": lambda buffer: reducescatter(SELF, buffer, "sum"),
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("function", sorted(CALLS))
def test_rejects_bad_buffers(function):
    call = CALLS[function]
    with pytest.raises(ValueError, match="contiguous"):
        call(np.arange(10.0)[::2])
    with pytest.raises(ValueError, match="1-D.*reshape"):
        call(np.zeros((2, 3)))
    with pytest.raises(TypeError, match="numpy.ndarray"):
        call([1.0, 2.0])
    for dtype in (np.complex64, np.int16, np.dtype(">f4")):
        with pytest.raises(TypeError, match="unsupported dtype.*float32"):
            call(np.zeros(4, dtype))
    with pytest.raises(TypeError, match="byte order"):
        call(np.zeros(4, np.dtype(">f8")))


@pytest.mark.timeout(30)
def test_rejects_bad_arguments():
    buffer = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match="read-only"):
        frozen = buffer.copy()
        frozen.flags.writeable = False
        allreduce(SELF, frozen)
    with pytest.raises(TypeError, match="MPI.Comm"):
        allreduce("world", buffer)
    with pytest.raises(ValueError, match="COMM_NULL"):
        ring_allreduce(MPI.COMM_NULL, buffer)
    for function in (allreduce, ring_allreduce, mpi_allreduce):
        with pytest.raises(ValueError, match="op must be one of"):
            function(SELF, buffer, "avg")
    with pytest.raises(ValueError, match="op must be one of"):
        reducescatter(SELF, buffer, "mean")
    with pytest.raises(ValueError, match="algorithm must be one of"):
        allreduce(SELF, buffer, algorithm="tree")
    with pytest.raises(ValueError, match="segment_bytes must be > 0"):
        ring_allreduce(SELF, buffer, segment_bytes=0)
    with pytest.raises(TypeError, match="segment_bytes must be an int"):
        ring_allreduce(SELF, buffer, segment_bytes=1.5)
    with pytest.raises(ValueError, match="root=1 is not a rank"):
        broadcast(SELF, buffer, root=1)
    with pytest.raises(TypeError, match="root must be an int"):
        broadcast(SELF, buffer, root="0")
    with pytest.raises(ValueError, match="counts has 2 entries but the communicator has 1"):
        allgatherv(SELF, buffer, [4, 0])
    with pytest.raises(ValueError, match=r"counts\[0\] \(this rank\) is 3"):
        allgatherv(SELF, buffer, [3])
    with pytest.raises(ValueError, match="negative count"):
        allgatherv(SELF, buffer, [-4])
    with pytest.raises(TypeError, match="sequence of one int per rank"):
        allgatherv(SELF, buffer, 4)
    with pytest.raises(TypeError, match="flat sequence of ints"):
        allgatherv(SELF, buffer, [4.0])
    with pytest.raises(ValueError, match="sendcounts sum to 3 but sendbuf has 4"):
        alltoallv(SELF, buffer, [3], [3])
    with pytest.raises(ValueError, match="counts sum to 5 but buffer has 4"):
        reducescatter(SELF, buffer, "sum", [5])


@pytest.mark.timeout(30)
@pytest.mark.parametrize("dtype", [str(d) for d in ops.SUPPORTED_DTYPES])
def test_single_rank_is_identity(dtype):
    source = (np.arange(7) % 2).astype(dtype)
    for function in (allreduce, ring_allreduce, mpi_allreduce):
        for op in ops.SUPPORTED_OPS:
            buffer = source.copy()
            assert function(SELF, buffer, op) is buffer
            np.testing.assert_array_equal(buffer, source)
    np.testing.assert_array_equal(allgatherv(SELF, source, [7]), source)
    np.testing.assert_array_equal(alltoallv(SELF, source, [7], [7]), source)
    np.testing.assert_array_equal(reducescatter(SELF, source, "max", [7]), source)
    assert ring_allreduce(SELF, np.zeros(0, dtype)).size == 0


@pytest.mark.timeout(30)
def test_source_must_match_and_not_overlap_the_buffer():
    buffer = np.zeros(8, np.float32)
    with pytest.raises(ValueError, match="dtype and shape"):
        allreduce(MPI.COMM_SELF, buffer, source=np.zeros(8, np.float64))
    with pytest.raises(ValueError, match="overlap"):
        allreduce(MPI.COMM_SELF, buffer[:4], source=buffer[2:6])
    source = np.arange(8, dtype=np.float32)
    allreduce(MPI.COMM_SELF, buffer, source=source)
    assert np.array_equal(buffer, source)


@pytest.mark.timeout(30)
def test_choose_algorithm_is_a_pure_size_rule():
    for size in (2, 3, 4, 8):
        for dtype in ops.SUPPORTED_DTYPES:
            for op in ops.SUPPORTED_OPS:
                assert choose_algorithm(4 * 1024, size, dtype, op) == "mpi"
                assert choose_algorithm(64 << 20, size, dtype, op) == "ring"
                assert choose_algorithm(0, size, dtype, op) == "mpi"
    assert choose_algorithm(64 << 20, 1, np.float32, "sum") == "mpi"
    # Same answer for equal inputs, however the dtype is spelled.
    assert {choose_algorithm(32 << 20, 2, d, "sum")
            for d in ("float32", np.float32, np.dtype("float32"))} == {"ring"}
    # uint8 sums go through MPI as uint32, so the ring takes over sooner than for max.
    assert choose_algorithm(512 << 10, 2, np.uint8, "sum") == "ring"
    assert choose_algorithm(512 << 10, 2, np.uint8, "max") == "mpi"
