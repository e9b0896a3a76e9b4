"""Adasum on a real job (issue 34), checked against a NumPy reference of the pairwise tree.

Run under ``mpirun`` on any number of ranks (the tests use 2, 3 and 4). Every rank rebuilds
every rank's inputs from seeds and computes the expected result with :func:`tree`: the
result of ranks [lo, hi) is ``pair(result of the lower half, result of the upper half)``
over the largest power of two P <= N ranks, after each rank r >= P was first combined into
rank r - P (``pair(g[r - P], g[r])``), each pair weighted by the ranks its two parts hold,
per tensor, in float64.

Sections: ``values`` (orthogonal vectors add, equal ones stay, opposite ones cancel, random
ones match the reference in float32, float64, float16 and bfloat16; allreduce, allreduce_,
the async forms, grouped = fused equal to unfused, prescale/postscale, a process set,
Compression.fp16 on the wire), ``horovod`` (Horovod's own four Adasum tests, float32 and
float16, with its criterion), ``errors`` (the refusals, as Horovod's error types where its
tests check them, and the job goes on),
``optimizer`` (DistributedOptimizer(op=Adasum) equal to the reference of Horovod's rule:
each rank steps alone, the parameters' changes are combined, for SGD with momentum and Adam,
and with fp16 on the wire). Prints ``FAIL ...`` lines, ``CASES <section> <n>``, then ``DONE``.
"""

import sys
import zlib

import numpy as np
import torch

import ringmaster as rm
from adasum_checks_reference import HOROVOD_TESTS, horovod_cases, horovod_close, tree
from job_report import Tally

rm.init()
RANK, SIZE = rm.rank(), rm.size()
tally = Tally(RANK)
SECTIONS = sys.argv[1:] or ["values", "horovod", "errors", "optimizer"]


def seed(*parts) -> int:
    return zlib.crc32("|".join(str(p) for p in parts).encode())


def normal(n, *parts) -> np.ndarray:
    return np.random.default_rng(seed(*parts)).standard_normal(n)


def close(got: torch.Tensor, expected: np.ndarray, tolerance: float) -> tuple:
    """(ok, detail): the largest difference, relative to the largest expected magnitude."""
    got = got.detach().double().numpy().reshape(-1)
    expected = np.asarray(expected, dtype=np.float64).reshape(-1)
    scale = max(np.max(np.abs(expected)), 1e-30) if expected.size else 1.0
    error = float(np.max(np.abs(got - expected)) / scale) if expected.size else 0.0
    return error <= tolerance, f"relative error {error:.3g} > {tolerance:g}"


def check(case: str, got: torch.Tensor, expected, tolerance: float) -> None:
    ok, detail = close(got, expected, tolerance)
    tally.report(f"{section}: {case}", ok, detail)


TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-12, torch.float16: 5e-3, torch.bfloat16: 3e-2}


# ------------------------------------------------------------------ values
def values_section():
    members = list(range(SIZE))
    # orthogonal vectors add up: rank r holds (r + 1) e_r
    basis = torch.zeros(SIZE + 1)
    basis[RANK] = RANK + 1.0
    check("orthogonal vectors add", rm.allreduce(basis, op=rm.Adasum, name="orthogonal"),
          np.array([r + 1.0 for r in range(SIZE)] + [0.0]), 1e-6)
    # equal vectors stay (their average)
    same = torch.from_numpy(normal(33, "same")).float()
    check("equal vectors stay", rm.allreduce(same, op=rm.Adasum, name="equal"), same.numpy(), 1e-6)
    # opposite vectors cancel (in pairs: ranks 2i and 2i+1; an odd rank count leaves one alone)
    v = normal(17, "opposite")
    mine = v if RANK % 2 == 0 else -v
    expected = tree([v if r % 2 == 0 else -v for r in members])
    got = rm.allreduce(torch.from_numpy(mine).float(), op=rm.Adasum, name="opposite")
    check("opposite vectors cancel", got, expected, 1e-6)
    if SIZE % 2 == 0:
        tally.report("values: opposite vectors give zero", bool(torch.all(got.abs() < 1e-6)), str(got[:4]))

    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        inputs = [normal(1000, "random", str(dtype), r) for r in members]
        mine = torch.from_numpy(inputs[RANK]).to(dtype)
        reference = tree([torch.from_numpy(x).to(dtype).double().numpy() for x in inputs])
        got = rm.allreduce(mine, op=rm.Adasum, name=f"random.{dtype}")
        tally.report(f"values: {dtype} result keeps its dtype", got.dtype == dtype, str(got.dtype))
        check(f"random {dtype} matches the reference", got, reference, TOLERANCE[dtype])

    # in place, async, scaling
    inputs = [normal(257, "forms", r) for r in members]
    reference = tree(inputs)
    t = torch.from_numpy(inputs[RANK]).float()
    rm.allreduce_(t, op=rm.Adasum, name="in place")
    check("allreduce_ in place", t, reference, 1e-5)
    handle = rm.allreduce_async(torch.from_numpy(inputs[RANK]).float(), op=rm.Adasum, name="async")
    check("allreduce_async", rm.synchronize(handle), reference, 1e-5)
    scaled = rm.allreduce(torch.from_numpy(inputs[RANK]).float(), op=rm.Adasum, name="scaled",
                          prescale_factor=2.0, postscale_factor=0.25)
    check("prescale 2 and postscale 0.25", scaled, 0.25 * tree([2.0 * x for x in inputs]), 1e-5)

    # grouped (fused into one buffer) equals each tensor on its own
    shapes = [(40,), (3, 7), (1,), (129,)]
    grouped_inputs = [[normal(int(np.prod(s)), "grouped", i, r).reshape(s) for i, s in enumerate(shapes)]
                      for r in members]
    mine = [torch.from_numpy(x).float() for x in grouped_inputs[RANK]]
    fused = rm.grouped_allreduce(mine, op=rm.Adasum, name="grouped")
    alone = [rm.allreduce(t, op=rm.Adasum, name=f"alone.{i}") for i, t in enumerate(mine)]
    for i, shape in enumerate(shapes):
        expected = tree([grouped_inputs[r][i].reshape(-1) for r in members])
        check(f"grouped tensor {i} matches the reference", fused[i], expected, 1e-5)
        check(f"grouped tensor {i} equals the unfused one", fused[i], alone[i].double().numpy(), 1e-6)
        tally.report(f"values: grouped tensor {i} keeps its shape", tuple(fused[i].shape) == shape, "")

    # a process set: the even ranks
    evens = list(range(0, SIZE, 2))
    subset = rm.add_process_set(evens) if SIZE > 2 else None
    if subset is not None and RANK in evens:
        set_inputs = [normal(50, "subset", r) for r in evens]
        got = rm.allreduce(torch.from_numpy(set_inputs[evens.index(RANK)]).float(), op=rm.Adasum,
                           name="subset", process_set=subset)
        check("a process set of the even ranks", got, tree(set_inputs), 1e-5)

    # Compression.fp16: float16 on the wire, combined in float32
    inputs = [normal(300, "fp16 wire", r) for r in members]
    got = rm.allreduce(torch.from_numpy(inputs[RANK]).float(), op=rm.Adasum, name="fp16 wire",
                       compression=rm.Compression.fp16)
    tally.report("values: fp16 wire hands back float32", got.dtype == torch.float32, str(got.dtype))
    check("Compression.fp16 on the wire", got, tree([x.astype(np.float16).astype(np.float64) for x in inputs]), 5e-3)


# ------------------------------------------------------------------ horovod
def horovod_section():
    """Horovod's own Adasum tests (test/parallel/test_adasum_pytorch.py: orthogonal, parallel,
    stability, stability 2; float32 and float16 tensors), through the API on CPU tensors, with
    Horovod's criterion."""
    for test in HOROVOD_TESTS:
        cases = horovod_cases(test, SIZE)
        dtypes = {np.float32: torch.float32, np.float16: torch.float16}
        mine = [torch.from_numpy(vectors[RANK]).to(dtypes[dtype]) for dtype, vectors, _ in cases]
        if test in ("orthogonal", "parallel"):  # as Horovod: every tensor asynchronously, then wait
            handles = [rm.allreduce_async(t, op=rm.Adasum, name=f"horovod {test} {i}") for i, t in enumerate(mine)]
            results = [rm.synchronize(h) for h in handles]
        else:
            results = [rm.allreduce_(t, op=rm.Adasum, name=f"horovod {test} {i}") for i, t in enumerate(mine)]
        for (dtype, vectors, expected), got in zip(cases, results):
            ok, detail = horovod_close(dtype, expected, got.double().numpy())
            tally.report(f"horovod: {test} {np.dtype(dtype).name} n={expected.size}", ok, detail)


# ------------------------------------------------------------------ errors
def expect_error(case: str, error_type, words, call) -> None:
    try:
        call()
    except error_type as error:
        missing = [w for w in words if w not in str(error)]
        tally.report(f"errors: {case}", not missing, f"{error} lacks {missing}")
    except Exception as error:  # noqa: BLE001
        tally.report(f"errors: {case}", False, f"raised {type(error).__name__}: {error}")
    else:
        tally.report(f"errors: {case}", False, "no error")


def errors_section():
    x = torch.ones(4 * SIZE)
    # Horovod raises a RuntimeError (HorovodInternalError) here, and its test_torch.py expects one.
    expect_error("reducescatter refuses Adasum", rm.HorovodInternalError, ["reducescatter", "Adasum", "allreduce only"],
                 lambda: rm.reducescatter(x, op=rm.Adasum))
    expect_error("grouped_reducescatter refuses Adasum", rm.HorovodInternalError, ["Adasum", "allreduce only"],
                 lambda: rm.grouped_reducescatter([x], op=rm.Adasum))
    expect_error("reducescatter's refusal is a ValueError too", ValueError, ["Adasum"],
                 lambda: rm.reducescatter(x, op=rm.Adasum))
    expect_error("integers refuse Adasum", TypeError, ["Adasum", "floating-point", "torch.int32"],
                 lambda: rm.allreduce(torch.ones(3, dtype=torch.int32), op=rm.Adasum))
    expect_error("8-bit wire refuses Adasum", ValueError, ["int8", "Adasum"],
                 lambda: rm.allreduce(x, op=rm.Adasum, compression=rm.Compression.int8))
    expect_error("sparse refuses Adasum", ValueError, ["Average or op=Sum"],
                 lambda: rm.sparse_allreduce_async(torch.ones(3).to_sparse(), op=rm.Adasum))
    model = torch.nn.Linear(3, 2)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    expect_error("DistributedOptimizer Adasum with int8", ValueError, ["8-bit", "Adasum"],
                 lambda: rm.DistributedOptimizer(sgd, model.named_parameters(), op=rm.Adasum,
                                                 compression=rm.Compression.int8))
    expect_error("DistributedOptimizer Adasum with rgc", ValueError, ["Adasum"],
                 lambda: rm.DistributedOptimizer(sgd, model.named_parameters(), op=rm.Adasum,
                                                 compression=rm.Compression.rgc(ratio=0.01)))
    expect_error("DistributedOptimizer Adasum with groups", ValueError, ["groups", "Adasum"],
                 lambda: rm.DistributedOptimizer(sgd, model.named_parameters(), op=rm.Adasum, groups=2))
    # the job goes on
    check("after the refusals", rm.allreduce(torch.ones(2), op=rm.Sum, name="after"), np.full(2, SIZE), 0)


# ------------------------------------------------------------------ optimizer
def make_model(seed_value: int) -> torch.nn.Module:
    torch.manual_seed(seed_value)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))


def batch(rank: int, step: int):
    generator = torch.Generator().manual_seed(seed("batch", rank, step))
    return torch.randn(8, 6, generator=generator), torch.randn(8, 2, generator=generator)


def reference_run(make_optimizer, steps: int, wire16: bool):
    """Horovod's Adasum optimizer simulated for every rank in this process."""
    models = [make_model(1) for _ in range(SIZE)]
    optimizers = [make_optimizer(m.parameters()) for m in models]
    for step in range(steps):
        deltas = []
        starts = [[p.detach().clone() for p in m.parameters()] for m in models]
        for r, (m, opt) in enumerate(zip(models, optimizers)):
            x, y = batch(r, step)
            opt.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            opt.step()
            deltas.append([(p.detach() - s) for p, s in zip(m.parameters(), starts[r])])
        with torch.no_grad():
            for i in range(len(starts[0])):
                per_rank = [d[i].reshape(-1) for d in deltas]
                if wire16:
                    per_rank = [d.half().float() for d in per_rank]
                combined = torch.from_numpy(tree([d.double().numpy() for d in per_rank])).float()
                for m, s in zip(models, starts):
                    list(m.parameters())[i].copy_(s[i] + combined.view_as(s[i]))
    return [p.detach().clone() for p in models[0].parameters()]


def optimizer_section():
    steps = 3
    cases = {
        "SGD momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
        "Adam": lambda params: torch.optim.Adam(params, lr=0.01),
    }
    for name, make_optimizer in cases.items():
        for wire16 in (False, True):
            model = make_model(1)
            optimizer = rm.DistributedOptimizer(make_optimizer(model.parameters()), model.named_parameters(),
                                                op=rm.Adasum,
                                                compression=rm.Compression.fp16 if wire16 else rm.Compression.none)
            for step in range(steps):
                x, y = batch(RANK, step)
                optimizer.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                optimizer.step()
            expected = reference_run(make_optimizer, steps, wire16)
            for (pname, p), e in zip(model.named_parameters(), expected):
                tolerance = 5e-3 if wire16 else 1e-5
                ok, detail = close(p, e.double().numpy(), tolerance)
                tally.report(f"optimizer: {name} fp16 wire={wire16} {pname} equals the reference", ok, detail)
            # every rank holds the same parameters
            flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            gathered = rm.allgather(flat.unsqueeze(0), name=f"same params {name} {wire16}")
            tally.report(f"optimizer: {name} fp16 wire={wire16} ranks agree",
                         bool(torch.all(gathered == gathered[0])), "")


for section in SECTIONS:
    before = tally.cases
    {"values": values_section, "horovod": horovod_section, "errors": errors_section,
     "optimizer": optimizer_section}[section]()
    print(f"CASES {section} {tally.cases - before}", flush=True)
tally.done()
rm.shutdown()
