"""Horovod's semantics on a real job: gradients through the collectives, integer scaling, process sets.

Run under ``mpirun`` on any number of ranks (the tests use 2, 3 and 4). Every rank rebuilds every
rank's inputs (and every rank's upstream gradient) from seeds, computes the expected results
and the expected gradients locally with NumPy, and reports each check through
:class:`job_report.Tally` (``FAIL ...`` lines, then ``DONE <cases> cases, <failures> failures``).

The backward rules checked (Horovod's, see ``worker/frontend/differentiable.py``), for a loss
``sum(result * W_rank)`` on every rank, whose gradient with respect to the result is ``W_rank``:

* allreduce(op, pre, post): allreduce(W, op, pre, post)
* allgather: (mean of the members' W)[this rank's rows]
* broadcast(root): the members' mean W on the root, zeros elsewhere
* alltoall(splits): the rows of the members' W that came from this rank, sent back
* reducescatter(op, pre, post): the members' W concatenated, times size for Sum (not for
  Average), times pre*post
* the grouped forms: the same per tensor

Sections (``sys.argv[1:]``, default all): ``gradients``, ``graph``, ``integers``, ``model``.
Each case name starts with its section (``FAIL gradients: ...``), and each section ends with
``CASES <section> <count>`` on every rank.
Each collective runs in the global set, and in the set of even ranks or of odd ranks (at
2 ranks, sets of one rank; at 3 ranks, one set of two and one of one), whichever this rank
belongs to. ``horovod_examples`` also checks the literal values issue 29 reported.
"""

import sys
import time
import zlib

import numpy as np
import torch

import ringmaster as rm
from job_report import Tally

rm.init()
RANK, SIZE = rm.rank(), rm.size()


class SectionTally(Tally):
    """A Tally whose case names start with the section being run."""

    section = ""

    def report(self, case: str, ok: bool, detail: str = "") -> None:
        super().report(f"{self.section}: {case}", ok, detail)


tally = SectionTally(RANK)
SECTIONS = sys.argv[1:] or ["gradients", "graph", "integers", "model"]

EVEN = rm.add_process_set(list(range(0, SIZE, 2)))
ODD = rm.add_process_set(list(range(1, SIZE, 2)))
SETS = [("global", rm.global_process_set, list(range(SIZE))),
        ("even", EVEN, list(range(0, SIZE, 2))),
        ("odd", ODD, list(range(1, SIZE, 2)))]
#: (name, process set, members) of the sets this rank belongs to, global first
MY_SETS = [(name, ps, members) for name, ps, members in SETS if RANK in members]

NUMPY = {torch.float16: np.float16, torch.bfloat16: np.float32, torch.float32: np.float32, torch.float64: np.float64,
         torch.int32: np.int32, torch.int64: np.int64, torch.uint8: np.uint8}
TOLERANCE = {torch.float16: (1e-2, 2e-2), torch.bfloat16: (2e-2, 5e-2), torch.float32: (1e-5, 1e-5),
             torch.float64: (1e-12, 1e-12)}
SHAPES = {"1d": (), "2d": (3,), "3d": (2, 3)}  # the dimensions after the first one


# ------------------------------------------------------------------ helpers
def seed(*parts) -> int:
    return zlib.crc32("|".join(str(p) for p in parts).encode())


def normal(shape, dtype, *parts) -> np.ndarray:
    """Standard normal values in ``dtype``, the same on every rank for the same ``parts``
    (bfloat16: float32 values that bfloat16 holds exactly)."""
    values = np.random.default_rng(seed(*parts)).standard_normal(shape).astype(NUMPY[dtype])
    if dtype == torch.bfloat16:
        values = torch.from_numpy(values).to(torch.bfloat16).float().numpy()
    return values


def integers(shape, dtype, *parts) -> np.ndarray:
    """Integers in -50..50 (0..20 for uint8, small enough that no scaled sum wraps)."""
    low, high = (0, 21) if dtype == torch.uint8 else (-50, 51)
    return np.random.default_rng(seed(*parts)).integers(low, high, shape).astype(NUMPY[dtype])


def leaf(array: np.ndarray, dtype=None) -> torch.Tensor:
    """A leaf tensor that requires grad, of ``array``'s values (in ``dtype`` if given)."""
    tensor = torch.from_numpy(array.copy())
    return (tensor if dtype is None else tensor.to(dtype)).requires_grad_()


def f64(array) -> np.ndarray:
    return np.asarray(array, dtype=np.float64)


def check(case: str, got, expected: np.ndarray, dtype) -> None:
    """``got`` (a tensor) has ``expected``'s shape, ``dtype``, and its values (within the dtype's tolerance)."""
    if not isinstance(got, torch.Tensor):
        tally.report(case, False, f"got {type(got).__name__}, not a tensor")
        return
    expected = np.asarray(expected)
    if tuple(got.shape) != expected.shape or got.dtype != dtype:
        tally.report(case, False, f"shape/dtype {tuple(got.shape)} {got.dtype}, expected {expected.shape} {dtype}")
        return
    values = got.detach().to(torch.float64).numpy()
    if dtype in TOLERANCE:
        rtol, atol = TOLERANCE[dtype]
        ok = np.allclose(values, f64(expected), rtol=rtol, atol=atol)
    else:
        ok = np.array_equal(values, f64(expected))
    detail = ""
    if not ok:
        difference = np.abs(values - f64(expected))
        at = np.unravel_index(np.argmax(difference), difference.shape) if difference.size else ()
        detail = (f"max diff {difference.max() if difference.size else 0:.3g} at {tuple(int(i) for i in at)}: "
                  f"got {values.ravel()[:8].tolist()} expected {f64(expected).ravel()[:8].tolist()}")
    tally.report(case, ok, detail)


def check_true(case: str, ok: bool, detail: str = "") -> None:
    tally.report(case, bool(ok), detail)


def run(case: str, body) -> None:
    """Run one case; an exception is a failure of that case (and the job goes on)."""
    try:
        body()
    except Exception as error:  # noqa: BLE001 - reported, not hidden
        tally.report(case, False, f"raised {type(error).__name__}: {error}")


def reduce_np(arrays, op: str, pre: float = 1.0, post: float = 1.0) -> np.ndarray:
    """The float64 reduction of the members' arrays with Horovod's scaling."""
    scaled = np.stack([f64(a) * pre for a in arrays])
    result = {"Sum": scaled.sum(0), "Average": scaled.sum(0) / len(arrays),
              "Min": scaled.min(0), "Max": scaled.max(0)}[op]
    return result * post


OPS = {"Sum": rm.Sum, "Average": rm.Average, "Min": rm.Min, "Max": rm.Max}


def blocks(rows: int, size: int):
    """reducescatter's row counts: as even as possible, the first ranks one more."""
    base, extra = divmod(rows, size)
    return [base + (1 if r < extra else 0) for r in range(size)]


def offsets(counts):
    return [int(x) for x in np.concatenate([[0], np.cumsum(counts)])]


def upstream(result: torch.Tensor, *parts) -> torch.Tensor:
    """This rank's loss: sum(result * W), W from a seed (per rank, in the result's dtype)."""
    weight = torch.from_numpy(normal(tuple(result.shape), result.dtype, *parts, "W", RANK)).to(result.dtype)
    return (result * weight).sum()


def weights_of(members, shapes, dtype, *parts):
    """Every member's W (as :func:`upstream` builds it), by global rank."""
    return {r: normal(shapes[r], dtype, *parts, "W", r) for r in members}


# ================================================================ gradients
def allreduce_case(set_name, ps, members, dtype, dims, op_name, pre, post):
    case = f"allreduce {op_name} pre={pre} post={post} {dtype} {dims} set={set_name}"
    shape = (4, *SHAPES[dims])
    xs = {r: normal(shape, dtype, case, "x", r) for r in members}
    x = leaf(xs[RANK], dtype)
    result = rm.allreduce(x, op=OPS[op_name], prescale_factor=pre, postscale_factor=post, process_set=ps)
    check(f"{case}: result", result, reduce_np(xs.values(), op_name, pre, post), dtype)
    check_true(f"{case}: has grad_fn", result.grad_fn is not None)
    upstream(result, case).backward()
    ws = weights_of(members, {r: shape for r in members}, dtype, case)
    check(f"{case}: grad", x.grad, reduce_np(ws.values(), op_name, pre, post), dtype)


def grouped_allreduce_case(set_name, ps, members, dtype, op_name, pre, post):
    case = f"grouped_allreduce {op_name} pre={pre} post={post} {dtype} set={set_name}"
    shapes = [(5,), (3, 4), (2, 3, 2)]
    xs = [{r: normal(s, dtype, case, "x", i, r) for r in members} for i, s in enumerate(shapes)]
    inputs = [leaf(x[RANK]) for x in xs]
    results = rm.grouped_allreduce(inputs, op=OPS[op_name], prescale_factor=pre, postscale_factor=post,
                                   process_set=ps)
    loss = 0
    for i, result in enumerate(results):
        check(f"{case}: result {i}", result, reduce_np(xs[i].values(), op_name, pre, post), dtype)
        loss = loss + upstream(result, case, i)
    loss.backward()
    for i, shape in enumerate(shapes):
        ws = weights_of(members, {r: shape for r in members}, dtype, case, i)
        check(f"{case}: grad {i}", inputs[i].grad, reduce_np(ws.values(), op_name, pre, post), dtype)


def gather_rows(position: int, salt: int = 0) -> int:
    """Different first dimensions per rank, one of them 0."""
    return [2, 0, 3, 1][(position + salt) % 4]


def allgather_case(set_name, ps, members, dtype, dims):
    case = f"allgather {dtype} {dims} set={set_name}"
    rows = {r: gather_rows(members.index(r)) for r in members}
    xs = {r: normal((rows[r], *SHAPES[dims]), dtype, case, "x", r) for r in members}
    x = leaf(xs[RANK])
    result = rm.allgather(x, process_set=ps)
    check(f"{case}: result", result, np.concatenate([xs[r] for r in members]), dtype)
    upstream(result, case).backward()
    mean = sum(f64(w) for w in weights_of(members, {r: result.shape for r in members}, dtype, case).values()) / len(
        members)
    start = offsets([rows[r] for r in members])[members.index(RANK)]
    check(f"{case}: grad", x.grad, mean[start:start + rows[RANK]], dtype)


def grouped_allgather_case(set_name, ps, members, dtype):
    case = f"grouped_allgather {dtype} set={set_name}"
    tails = [(), (3,), (2, 2)]
    rows = [{r: gather_rows(members.index(r), salt) for r in members} for salt in range(len(tails))]
    xs = [{r: normal((rows[i][r], *tail), dtype, case, "x", i, r) for r in members} for i, tail in enumerate(tails)]
    inputs = [leaf(x[RANK]) for x in xs]
    results = rm.grouped_allgather(inputs, process_set=ps)
    loss = 0
    for i, result in enumerate(results):
        check(f"{case}: result {i}", result, np.concatenate([xs[i][r] for r in members]), dtype)
        loss = loss + upstream(result, case, i)
    loss.backward()
    for i in range(len(tails)):
        gathered = (sum(rows[i].values()), *tails[i])
        mean = sum(f64(w) for w in weights_of(members, {r: gathered for r in members}, dtype, case,
                                              i).values()) / len(members)
        start = offsets([rows[i][r] for r in members])[members.index(RANK)]
        check(f"{case}: grad {i}", inputs[i].grad, mean[start:start + rows[i][RANK]], dtype)


def broadcast_case(set_name, ps, members, dtype, dims, root):
    case = f"broadcast root={root} {dtype} {dims} set={set_name}"
    shape = (3, *SHAPES[dims])
    xs = {r: normal(shape, dtype, case, "x", r) for r in members}
    x = leaf(xs[RANK])
    result = rm.broadcast(x, root_rank=root, process_set=ps)
    check(f"{case}: result", result, xs[root], dtype)
    upstream(result, case).backward()
    ws = weights_of(members, {r: shape for r in members}, dtype, case)
    expected = reduce_np(ws.values(), "Average") if RANK == root else np.zeros(shape)
    check(f"{case}: grad", x.grad, expected, dtype)


def alltoall_splits(position: int, size: int):
    """Rows the ``position``-th member sends to each member: uneven, some 0."""
    return [(position + 2 * j + 1) % 3 for j in range(size)]


def alltoall_case(set_name, ps, members, dtype, dims, explicit: bool):
    case = f"alltoall splits={'uneven' if explicit else 'None'} {dtype} {dims} set={set_name}"
    n, me = len(members), members.index(RANK)
    splits = [alltoall_splits(i, n) if explicit else [2] * n for i in range(n)]  # splits[sender][receiver]
    xs = [normal((sum(splits[i]), *SHAPES[dims]), dtype, case, "x", members[i]) for i in range(n)]
    x = leaf(xs[me])
    if explicit:
        result, received = rm.alltoall(x, splits=splits[me], process_set=ps)
        check(f"{case}: received splits", received, np.array([splits[i][me] for i in range(n)]), torch.int32)
        check_true(f"{case}: received splits need no grad", not received.requires_grad)
    else:
        result = rm.alltoall(x, process_set=ps)
    sent = [offsets(s) for s in splits]
    expected = np.concatenate([xs[i][sent[i][me]:sent[i][me + 1]] for i in range(n)])
    check(f"{case}: result", result, expected, dtype)
    upstream(result, case).backward()
    # member j received, from each sender i in order, splits[i][j] rows: its W's rows from this rank
    ws = [normal((sum(splits[i][j] for i in range(n)), *SHAPES[dims]), dtype, case, "W", members[j])
          for j in range(n)]
    back = [ws[j][sum(splits[i][j] for i in range(me)):][:splits[me][j]] for j in range(n)]
    check(f"{case}: grad", x.grad, np.concatenate(back), dtype)


def reducescatter_case(set_name, ps, members, dtype, dims, op_name, pre, post):
    case = f"reducescatter {op_name} pre={pre} post={post} {dtype} {dims} set={set_name}"
    n, me = len(members), members.index(RANK)
    rows = 2 * n + 1  # does not divide evenly (except in a set of one)
    shape = (rows, *SHAPES[dims])
    xs = {r: normal(shape, dtype, case, "x", r) for r in members}
    x = leaf(xs[RANK])
    result = rm.reducescatter(x, op=OPS[op_name], prescale_factor=pre, postscale_factor=post, process_set=ps)
    counts = blocks(rows, n)
    starts = offsets(counts)
    check(f"{case}: result", result, reduce_np(xs.values(), op_name, pre, post)[starts[me]:starts[me + 1]], dtype)
    upstream(result, case).backward()
    ws = [normal((counts[j], *SHAPES[dims]), dtype, case, "W", members[j]) for j in range(n)]
    factor = (n if op_name == "Sum" else 1) * pre * post
    check(f"{case}: grad", x.grad, np.concatenate([f64(w) for w in ws]) * factor, dtype)


def grouped_reducescatter_case(set_name, ps, members, dtype, op_name, pre, post):
    case = f"grouped_reducescatter {op_name} pre={pre} post={post} {dtype} set={set_name}"
    n, me = len(members), members.index(RANK)
    shapes = [(2 * n + 1,), (n + 1, 3), (3 * n - 1, 2, 2)]
    xs = [{r: normal(s, dtype, case, "x", i, r) for r in members} for i, s in enumerate(shapes)]
    inputs = [leaf(x[RANK]) for x in xs]
    results = rm.grouped_reducescatter(inputs, op=OPS[op_name], prescale_factor=pre, postscale_factor=post,
                                       process_set=ps)
    loss = 0
    for i, result in enumerate(results):
        starts = offsets(blocks(shapes[i][0], n))
        check(f"{case}: result {i}", result,
              reduce_np(xs[i].values(), op_name, pre, post)[starts[me]:starts[me + 1]], dtype)
        loss = loss + upstream(result, case, i)
    loss.backward()
    factor = (n if op_name == "Sum" else 1) * pre * post
    for i, shape in enumerate(shapes):
        counts = blocks(shape[0], n)
        ws = [normal((counts[j], *shape[1:]), dtype, case, i, "W", members[j]) for j in range(n)]
        check(f"{case}: grad {i}", inputs[i].grad, np.concatenate([f64(w) for w in ws]) * factor, dtype)


def chain_case(set_name, ps, members, dtype):
    """Two collectives in one graph: allgather(allreduce(x, Average) * a) ; backward runs both."""
    case = f"chain allgather(allreduce) {dtype} set={set_name}"
    n = len(members)
    xs = {r: normal((2, 3), dtype, case, "x", r) for r in members}
    scales = {r: normal((2, 3), dtype, case, "a", r) for r in members}
    x = leaf(xs[RANK])
    hidden = rm.allreduce(x, op=rm.Average, process_set=ps) * torch.from_numpy(scales[RANK])
    result = rm.allgather(hidden, process_set=ps)
    mean = reduce_np(xs.values(), "Average")
    check(f"{case}: result", result, np.concatenate([mean * f64(scales[r]) for r in members]), dtype)
    upstream(result, case).backward()
    mean = sum(f64(w) for w in weights_of(members, {r: (2 * n, 3) for r in members}, dtype, case).values()) / n
    grads_of_hidden = [mean[2 * i:2 * i + 2] * f64(scales[r]) for i, r in enumerate(members)]
    check(f"{case}: grad", x.grad, sum(grads_of_hidden) / n, dtype)


def extra_cases(set_name, ps, members):
    """A 0-d allgather, a non-contiguous input, average=, Compression.fp16, grouped calls whose loss
    uses one result only, splits as a tensor."""
    n, me = len(members), members.index(RANK)
    case = f"allgather 0-d set={set_name}"
    xs = {r: normal((), torch.float64, case, "x", r) for r in members}
    x = leaf(xs[RANK])
    result = rm.allgather(x, process_set=ps)
    check(f"{case}: result", result, np.array([xs[r] for r in members]), torch.float64)
    upstream(result, case).backward()
    mean = sum(f64(w) for w in weights_of(members, {r: (n,) for r in members}, torch.float64, case).values()) / n
    check(f"{case}: grad", x.grad, mean[me], torch.float64)

    case = f"allreduce non-contiguous input set={set_name}"
    xs = {r: normal((3, 4), torch.float64, case, "x", r) for r in members}
    x = leaf(xs[RANK])
    result = rm.allreduce(x.t(), op=rm.Sum, process_set=ps)
    check(f"{case}: result", result, reduce_np([a.T for a in xs.values()], "Sum"), torch.float64)
    upstream(result, case).backward()
    ws = weights_of(members, {r: (4, 3) for r in members}, torch.float64, case)
    check(f"{case}: grad", x.grad, reduce_np(ws.values(), "Sum").T, torch.float64)

    for average in (True, False):
        case = f"allreduce average={average} set={set_name}"
        xs = {r: normal((5,), torch.float32, case, "x", r) for r in members}
        x = leaf(xs[RANK])
        result = rm.allreduce(x, average=average, process_set=ps)
        op_name = "Average" if average else "Sum"
        check(f"{case}: result", result, reduce_np(xs.values(), op_name), torch.float32)
        upstream(result, case).backward()
        ws = weights_of(members, {r: (5,) for r in members}, torch.float32, case)
        check(f"{case}: grad", x.grad, reduce_np(ws.values(), op_name), torch.float32)

    for compression, half, (rtol, atol) in [(rm.Compression.fp16, torch.float16, (1e-2, 2e-2)),
                                            (rm.Compression.bf16, torch.bfloat16, (2e-2, 5e-2))]:
        case = f"allreduce Compression.{half} set={set_name}"
        xs = {r: normal((6,), torch.float32, case, "x", r) for r in members}
        x = leaf(xs[RANK])
        result = rm.allreduce(x, op=rm.Sum, compression=compression, process_set=ps)
        tally.report(f"{case}: result dtype", result.dtype == torch.float32, str(result.dtype))
        expected = reduce_np([torch.from_numpy(a).to(half).double().numpy() for a in xs.values()], "Sum")
        tally.report(f"{case}: result", np.allclose(result.detach().double().numpy(), expected, rtol=rtol, atol=atol))
        upstream(result, case).backward()
        ws = weights_of(members, {r: (6,) for r in members}, torch.float32, case)
        got = x.grad.double().numpy() if x.grad is not None else None
        tally.report(f"{case}: grad", got is not None and np.allclose(got, reduce_np(ws.values(), "Sum"), rtol=rtol,
                                                                      atol=atol), f"got {got}")

    # grouped calls where the loss uses one result only, and one input does not require grad
    case = f"grouped_allreduce one result used set={set_name}"
    xs = [{r: normal((4,), torch.float64, case, "x", i, r) for r in members} for i in range(3)]
    inputs = [leaf(xs[0][RANK]), torch.from_numpy(xs[1][RANK]), leaf(xs[2][RANK])]
    results = rm.grouped_allreduce(inputs, op=rm.Sum, process_set=ps)
    upstream(results[0], case).backward()
    ws = weights_of(members, {r: (4,) for r in members}, torch.float64, case)
    check(f"{case}: grad of the used one", inputs[0].grad, reduce_np(ws.values(), "Sum"), torch.float64)
    check(f"{case}: grad of the unused one", inputs[2].grad, np.zeros(4), torch.float64)
    tally.report(f"{case}: no grad without requires_grad", inputs[1].grad is None)

    case = f"grouped_allgather one result used set={set_name}"
    rows = {r: gather_rows(members.index(r)) for r in members}
    xs = [{r: normal((rows[r], 2), torch.float64, case, "x", i, r) for r in members} for i in range(2)]
    inputs = [leaf(xs[0][RANK]), leaf(xs[1][RANK])]
    results = rm.grouped_allgather(inputs, process_set=ps)
    upstream(results[1], case).backward()
    mean = sum(f64(w) for w in weights_of(members, {r: results[1].shape for r in members}, torch.float64,
                                          case).values()) / n
    start = offsets([rows[r] for r in members])[me]
    check(f"{case}: grad of the used one", inputs[1].grad, mean[start:start + rows[RANK]], torch.float64)
    check(f"{case}: grad of the unused one", inputs[0].grad, np.zeros((rows[RANK], 2)), torch.float64)

    case = f"alltoall splits as a tensor set={set_name}"
    splits = [alltoall_splits(i, n) for i in range(n)]
    xs = [normal((sum(splits[i]), 2), torch.float64, case, "x", members[i]) for i in range(n)]
    x = leaf(xs[me])
    result, received = rm.alltoall(x, splits=torch.tensor(splits[me]), process_set=ps)
    sent = [offsets(s) for s in splits]
    check(f"{case}: result", result, np.concatenate([xs[i][sent[i][me]:sent[i][me + 1]] for i in range(n)]),
          torch.float64)
    upstream(result, case).backward()
    ws = [normal((sum(splits[i][j] for i in range(n)), 2), torch.float64, case, "W", members[j]) for j in range(n)]
    back = [ws[j][sum(splits[i][j] for i in range(me)):][:splits[me][j]] for j in range(n)]
    check(f"{case}: grad", x.grad, np.concatenate(back), torch.float64)


def issue_examples(set_name, ps, members):
    """The values issue 29 reported, literally: every member passes the same upstream gradient."""
    n, me = len(members), members.index(RANK)
    case = f"issue 29 allgather set={set_name}"
    x = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    result = rm.allgather(x, process_set=ps)
    result.backward(torch.cat([torch.full((2,), float(p), dtype=torch.float64) for p in range(n)]))
    check(f"{case}: grad", x.grad, np.full(2, float(me)), torch.float64)  # the sum rule gave n * me

    case = f"issue 29 grouped_allgather set={set_name}"
    xs = [torch.zeros(2, dtype=torch.float64, requires_grad=True), torch.zeros(1, 3, requires_grad=True)]
    results = rm.grouped_allgather(xs, process_set=ps)
    torch.autograd.backward(results, [torch.cat([torch.full((2,), float(p), dtype=torch.float64) for p in range(n)]),
                                      torch.ones(n, 3)])
    check(f"{case}: grad 0", xs[0].grad, np.full(2, float(me)), torch.float64)
    check(f"{case}: grad 1", xs[1].grad, np.ones((1, 3)), torch.float32)

    for op_name, pre, post, factor in [("Sum", 1.0, 1.0, n), ("Average", 1.0, 1.0, 1),
                                       ("Sum", 0.5, 3.0, n * 1.5), ("Average", 2.0, 0.25, 0.5)]:
        case = f"issue 29 reducescatter {op_name} pre={pre} post={post} set={set_name}"
        x = torch.zeros(2 * n, requires_grad=True)
        result = rm.reducescatter(x, op=OPS[op_name], prescale_factor=pre, postscale_factor=post, process_set=ps)
        result.backward(torch.ones(2))
        check(f"{case}: grad", x.grad, np.full(2 * n, float(factor)), torch.float32)

        case = f"issue 29 grouped_reducescatter {op_name} pre={pre} post={post} set={set_name}"
        xs = [torch.zeros(2 * n, requires_grad=True), torch.zeros(n, 2, dtype=torch.float64, requires_grad=True)]
        results = rm.grouped_reducescatter(xs, op=OPS[op_name], prescale_factor=pre, postscale_factor=post,
                                           process_set=ps)
        torch.autograd.backward(results, [torch.ones(2), torch.ones(1, 2, dtype=torch.float64)])
        check(f"{case}: grad 0", xs[0].grad, np.full(2 * n, float(factor)), torch.float32)
        check(f"{case}: grad 1", xs[1].grad, np.full((n, 2), float(factor)), torch.float64)


def gradients():
    for set_name, ps, members in MY_SETS:
        n = len(members)
        for dtype in (torch.float32, torch.float64):
            for d, dims in enumerate(SHAPES):
                for op_name, pre, post in [("Sum", 1.0, 1.0), ("Average", 1.0, 1.0), ("Sum", 0.5, 3.0),
                                           ("Average", 1.5, 0.5)]:
                    run(f"allreduce {op_name} {dtype} {dims} {set_name}",
                        lambda: allreduce_case(set_name, ps, members, dtype, dims, op_name, pre, post))
                run(f"allgather {dtype} {dims} {set_name}",
                    lambda: allgather_case(set_name, ps, members, dtype, dims))
                root = members[(d + 1) % n]  # a non-zero root first (root 0 too, in the even set)
                run(f"broadcast {dtype} {dims} {set_name}",
                    lambda: broadcast_case(set_name, ps, members, dtype, dims, root))
                for explicit in (True, False):
                    run(f"alltoall {dtype} {dims} {set_name}",
                        lambda: alltoall_case(set_name, ps, members, dtype, dims, explicit))
                op_name, pre, post = [("Average", 1.0, 1.0), ("Sum", 0.5, 3.0), ("Average", 1.5, 2.0)][d]
                run(f"reducescatter {dtype} {dims} {set_name}",
                    lambda: reducescatter_case(set_name, ps, members, dtype, dims, op_name, pre, post))
            for op_name, pre, post in [("Sum", 1.0, 1.0), ("Average", 0.5, 3.0)]:
                run(f"grouped_allreduce {dtype} {set_name}",
                    lambda: grouped_allreduce_case(set_name, ps, members, dtype, op_name, pre, post))
                run(f"grouped_reducescatter {dtype} {set_name}",
                    lambda: grouped_reducescatter_case(set_name, ps, members, dtype, op_name, pre, post))
            run(f"grouped_allgather {dtype} {set_name}", lambda: grouped_allgather_case(set_name, ps, members, dtype))
            run(f"chain {dtype} {set_name}", lambda: chain_case(set_name, ps, members, dtype))
        # float16 and bfloat16 forward and backward of allreduce (loose tolerance), Horovod's Min/Max
        # rule in float32
        for half in (torch.float16, torch.bfloat16):
            for dims in SHAPES:
                for op_name, pre, post in [("Sum", 1.0, 1.0), ("Average", 1.0, 1.0), ("Average", 0.5, 2.0)]:
                    run(f"allreduce {half} {op_name} {dims} {set_name}",
                        lambda: allreduce_case(set_name, ps, members, half, dims, op_name, pre, post))
        run(f"allgather float16 {set_name}", lambda: allgather_case(set_name, ps, members, torch.float16, "2d"))
        run(f"extras {set_name}", lambda: extra_cases(set_name, ps, members))
        run(f"issue 29 {set_name}", lambda: issue_examples(set_name, ps, members))
        for op_name in ("Min", "Max"):
            run(f"allreduce {op_name} {set_name}",
                lambda: allreduce_case(set_name, ps, members, torch.float32, "2d", op_name, 1.0, 1.0))


# ==================================================================== graph
def graph():
    """grad_fn: on the differentiable calls' results when the input requires grad, nowhere else."""
    n = SIZE

    def x(shape=(2 * n, 3)):
        return torch.from_numpy(normal(shape, torch.float32, "graph", shape, RANK))

    calls = {
        "allreduce": lambda t: rm.allreduce(t, op=rm.Sum),
        "grouped_allreduce": lambda t: rm.grouped_allreduce([t, t * 2])[1],
        "allgather": lambda t: rm.allgather(t),
        "grouped_allgather": lambda t: rm.grouped_allgather([t, t[:1]])[0],
        "broadcast": lambda t: rm.broadcast(t, root_rank=SIZE - 1),
        "alltoall splits": lambda t: rm.alltoall(t, splits=[2] * n)[0],
        "alltoall": lambda t: rm.alltoall(t),
        "reducescatter": lambda t: rm.reducescatter(t),
        "grouped_reducescatter": lambda t: rm.grouped_reducescatter([t, t[:n]])[0],
    }
    for what, call in calls.items():
        def body():
            tracked = call(x().requires_grad_())
            check_true(f"{what}: grad_fn when the input requires grad", tracked.grad_fn is not None
                       and tracked.requires_grad, f"grad_fn={tracked.grad_fn}")
            with torch.no_grad():
                untracked = call(x().requires_grad_())
            check_true(f"{what}: no grad_fn under no_grad", untracked.grad_fn is None and not untracked.requires_grad,
                       f"grad_fn={untracked.grad_fn} requires_grad={untracked.requires_grad}")
            plain = call(x())
            check_true(f"{what}: no grad_fn without requires_grad", plain.grad_fn is None and not plain.requires_grad,
                       f"grad_fn={plain.grad_fn} requires_grad={plain.requires_grad}")
        run(f"graph {what}", body)

    def no_graph(what, result, same=None):
        results = result if isinstance(result, (list, tuple)) else [result]
        for i, r in enumerate(results):
            if same is not None:  # in place: the tensor passed in (a leaf), still without grad_fn
                check_true(f"{what} [{i}] returns its tensor", r is same[i])
                check_true(f"{what} [{i}]: no grad_fn", r.grad_fn is None, f"grad_fn={r.grad_fn}")
            else:
                check_true(f"{what} [{i}]: no grad_fn, no grad", r.grad_fn is None and not r.requires_grad,
                           f"grad_fn={r.grad_fn} requires_grad={r.requires_grad}")

    def leaves(count=1):
        return [x().requires_grad_() for _ in range(count)]

    def body():
        t = leaves()
        no_graph("allreduce_", rm.allreduce_(t[0], op=rm.Sum), t)
        t = leaves(2)
        no_graph("grouped_allreduce_", rm.grouped_allreduce_(t, op=rm.Sum), t)
        t = leaves()
        no_graph("broadcast_", rm.broadcast_(t[0], root_rank=SIZE - 1), t)
        t = leaves()
        no_graph("allreduce_async_", rm.synchronize(rm.allreduce_async_(t[0], op=rm.Sum)), t)
        t = leaves(2)
        no_graph("grouped_allreduce_async_", rm.synchronize(rm.grouped_allreduce_async_(t)), t)
        t = leaves()
        no_graph("broadcast_async_", rm.synchronize(rm.broadcast_async_(t[0], root_rank=0)), t)
        t = leaves(2)
        no_graph("allreduce_async", rm.synchronize(rm.allreduce_async(t[0])))
        no_graph("grouped_allreduce_async", rm.synchronize(rm.grouped_allreduce_async(t)))
        no_graph("allgather_async", rm.synchronize(rm.allgather_async(t[0])))
        no_graph("grouped_allgather_async", rm.synchronize(rm.grouped_allgather_async(t)))
        no_graph("broadcast_async", rm.synchronize(rm.broadcast_async(t[0], root_rank=SIZE - 1)))
        no_graph("alltoall_async", rm.synchronize(rm.alltoall_async(t[0])))
        no_graph("alltoall_async splits", rm.synchronize(rm.alltoall_async(t[0], splits=[2] * n)))
        no_graph("reducescatter_async", rm.synchronize(rm.reducescatter_async(t[0])))
        no_graph("grouped_reducescatter_async", rm.synchronize(rm.grouped_reducescatter_async(t)))
    run("graph in-place and async", body)

    # in a process set too, and an integer input (which cannot require grad) goes through unchanged
    for set_name, ps, set_members in MY_SETS[1:]:
        def body():
            tracked = rm.allgather(x().requires_grad_(), process_set=ps)
            check_true(f"allgather set={set_name}: grad_fn", tracked.grad_fn is not None)
            with torch.no_grad():
                check_true(f"allreduce set={set_name}: no grad_fn under no_grad",
                           rm.allreduce(x().requires_grad_(), process_set=ps).grad_fn is None)
        run(f"graph set={set_name}", body)


# ================================================================= integers
def scale_int(values: np.ndarray, factor: float, dtype) -> np.ndarray:
    """Horovod's integer scaling: in float64, truncated toward zero, back in ``dtype``."""
    if factor == 1.0:
        return values.astype(np.int64)
    return np.trunc(values.astype(np.float64) * factor).astype(np.int64)


def reduce_int(arrays, op_name: str, pre: float, post: float, dtype) -> np.ndarray:
    """The reference integer reduction: prescale each, sum, then postscale / average, truncating."""
    total = sum(scale_int(a, pre, dtype) for a in arrays)
    n = len(arrays)
    if op_name == "Sum":
        result = scale_int(total, post, dtype)
    elif post == 1.0:  # Average: truncating division
        result = np.trunc(total.astype(np.float64) / n).astype(np.int64)
    else:
        result = np.trunc(total.astype(np.float64) * (post / n)).astype(np.int64)
    return result.astype(NUMPY[dtype])


FACTORS = [(1.0, 1.0), (0.5, 1.0), (1.0, 1.5), (1.5, 0.5), (0.5, 3.0), (3.0, 1.0)]


def integer_cases(set_name, ps, members, factors):
    n, me = len(members), members.index(RANK)
    for dtype in (torch.int32, torch.int64, torch.uint8):
        for op_name in ("Sum", "Average"):
            for pre, post in factors:
                tag = f"{op_name} pre={pre} post={post} {dtype} set={set_name}"

                def allreduce():
                    case = f"int allreduce {tag}"
                    xs = {r: integers((3, 5), dtype, case, r) for r in members}
                    result = rm.allreduce(torch.from_numpy(xs[RANK]), op=OPS[op_name], prescale_factor=pre,
                                          postscale_factor=post, process_set=ps)
                    check(case, result, reduce_int(list(xs.values()), op_name, pre, post, dtype), dtype)
                run(f"int allreduce {tag}", allreduce)

                def grouped_allreduce():
                    case = f"int grouped_allreduce {tag}"
                    shapes = [(7,), (2, 3)]
                    xs = [{r: integers(s, dtype, case, i, r) for r in members} for i, s in enumerate(shapes)]
                    results = rm.grouped_allreduce([torch.from_numpy(x[RANK]) for x in xs], op=OPS[op_name],
                                                   prescale_factor=pre, postscale_factor=post, process_set=ps)
                    for i, result in enumerate(results):
                        check(f"{case} [{i}]", result, reduce_int(list(xs[i].values()), op_name, pre, post, dtype),
                              dtype)
                run(f"int grouped_allreduce {tag}", grouped_allreduce)

                def reducescatter():
                    case = f"int reducescatter {tag}"
                    rows = 2 * n + 1
                    xs = {r: integers((rows, 2), dtype, case, r) for r in members}
                    result = rm.reducescatter(torch.from_numpy(xs[RANK]), op=OPS[op_name], prescale_factor=pre,
                                              postscale_factor=post, process_set=ps)
                    starts = offsets(blocks(rows, n))
                    check(case, result, reduce_int(list(xs.values()), op_name, pre, post, dtype)[starts[me]:
                                                                                              starts[me + 1]], dtype)
                run(f"int reducescatter {tag}", reducescatter)

                def grouped_reducescatter():
                    case = f"int grouped_reducescatter {tag}"
                    shapes = [(n + 1,), (2 * n + 1, 3)]
                    xs = [{r: integers(s, dtype, case, i, r) for r in members} for i, s in enumerate(shapes)]
                    results = rm.grouped_reducescatter([torch.from_numpy(x[RANK]) for x in xs], op=OPS[op_name],
                                                       prescale_factor=pre, postscale_factor=post, process_set=ps)
                    for i, result in enumerate(results):
                        starts = offsets(blocks(shapes[i][0], n))
                        expected = reduce_int(list(xs[i].values()), op_name, pre, post, dtype)
                        check(f"{case} [{i}]", result, expected[starts[me]:starts[me + 1]], dtype)
                run(f"int grouped_reducescatter {tag}", grouped_reducescatter)


def integers_section():
    # the reference itself: truncation toward zero, not floor (odd negative values scaled by 1.5,
    # a negative sum averaged)
    check("reference truncates", torch.from_numpy(reduce_int([np.array([-3, 3, -5], np.int32)] * 2, "Average",
                                                              1.5, 1.0, torch.int32)),
          np.array([-4, 4, -7], np.int32), torch.int32)
    for set_name, ps, members in MY_SETS:
        integer_cases(set_name, ps, members, FACTORS if set_name == "global" else [(1.0, 1.0), (1.5, 0.5)])

    # exact values, chosen so that truncation and floor differ
    def exact():
        # rank 0 holds the values, the others zeros
        signed = torch.tensor([-3, -1, 1, 3, -7], dtype=torch.int32) * (1 if RANK == 0 else 0)
        result = rm.allreduce(signed, op=rm.Sum, prescale_factor=1.5)
        check("int Sum prescale 1.5 truncates each rank's input", result,
              np.array([-4, -1, 1, 4, -10], np.int32), torch.int32)
        result = rm.allreduce(signed, op=rm.Average)
        check("int Average truncates toward zero", result,
              np.trunc(np.array([-3, -1, 1, 3, -7]) / SIZE).astype(np.int32), torch.int32)
        # the sparse allreduce's Average divides each rank's entries, truncating the same way
        sparse = torch.sparse_coo_tensor([[0, 2, 4]], torch.tensor([-3, 5, -7], dtype=torch.int64) * (RANK + 1),
                                         (6,))
        dense = rm.sparse_allreduce_async(sparse, name="int sparse average", op=rm.Average)().coalesce().to_dense()
        expected = np.zeros(6)
        for rank in range(SIZE):
            expected[[0, 2, 4]] += np.trunc(np.array([-3, 5, -7]) * (rank + 1) / SIZE)
        check("int sparse Average truncates each entry toward zero", dense, expected.astype(np.int64), torch.int64)
    run("int exact", exact)

    for what, call in {
        "allreduce": lambda t, **k: rm.allreduce(t, op=rm.Sum, **k),
        "allreduce_": lambda t, **k: rm.allreduce_(t, op=rm.Sum, **k),
        "grouped_allreduce": lambda t, **k: rm.grouped_allreduce([t, t], op=rm.Sum, **k),
        "reducescatter": lambda t, **k: rm.reducescatter(t, op=rm.Sum, **k),
        "grouped_reducescatter": lambda t, **k: rm.grouped_reducescatter([t], op=rm.Max, **k),
    }.items():
        for factors in ({"prescale_factor": 2.0}, {"postscale_factor": 0.5}):
            case = f"bool {what} {factors} raises TypeError"
            try:
                call(torch.ones(2 * SIZE, dtype=torch.bool), **factors)
                tally.report(case, False, "no error")
            except TypeError:
                tally.report(case, True)
            except Exception as error:  # noqa: BLE001
                tally.report(case, False, f"raised {type(error).__name__}: {error}")
    # the job is still in step after the refused calls
    run("after bool errors", lambda: check("allreduce after the refused calls",
                                           rm.allreduce(torch.ones(2, dtype=torch.int64), op=rm.Sum),
                                           np.full(2, SIZE, np.int64), torch.int64))


# ==================================================================== model
def model_parallel(set_name, ps, members):
    """A Linear layer whose output features are split over the set's members.

    Each member computes its features' partial output; an allgather of the partials
    (features first) gives the full output on every member. Every member computes the same loss,
    the single-process loss: allgather's backward averages the members' (equal) gradients, so
    each shard's gradient must be the matching slice of the single-process gradient.
    """
    n, me = len(members), members.index(RANK)
    batch, features_in, per_rank = 5, 4, 3
    features_out = per_rank * n
    generator = torch.Generator().manual_seed(seed("model", set_name))
    inputs = torch.randn(batch, features_in, generator=generator, dtype=torch.float64)
    weight = torch.randn(features_out, features_in, generator=generator, dtype=torch.float64)
    bias = torch.randn(features_out, generator=generator, dtype=torch.float64)
    target = torch.randn(batch, features_out, generator=generator, dtype=torch.float64)

    def loss_of(output):
        return ((output.tanh() - target) ** 2).sum() + (output * target).mean()

    # the single-process reference, with torch
    reference_weight, reference_bias = weight.clone().requires_grad_(), bias.clone().requires_grad_()
    reference_inputs = inputs.clone().requires_grad_()
    reference_output = torch.nn.functional.linear(reference_inputs, reference_weight, reference_bias)
    reference_output.retain_grad()
    reference_loss = loss_of(reference_output)
    reference_loss.backward()

    # this member's shard
    mine = slice(me * per_rank, (me + 1) * per_rank)
    shard_weight, shard_bias = weight[mine].clone().requires_grad_(), bias[mine].clone().requires_grad_()
    shard_inputs = inputs.clone().requires_grad_()
    partial = torch.nn.functional.linear(shard_inputs, shard_weight, shard_bias)  # (batch, per_rank)
    output = rm.allgather(partial.t(), process_set=ps).t()  # (batch, features_out)
    check(f"model set={set_name}: output", output, reference_output.detach().numpy(), torch.float64)
    loss = loss_of(output)
    check(f"model set={set_name}: loss", loss.detach(), reference_loss.detach().numpy(), torch.float64)
    loss.backward()
    check(f"model set={set_name}: weight shard grad", shard_weight.grad, reference_weight.grad[mine].numpy(),
          torch.float64)
    check(f"model set={set_name}: bias shard grad", shard_bias.grad, reference_bias.grad[mine].numpy(), torch.float64)
    # the inputs' gradient through this shard only; the shards' add up to the reference's
    through_shard = reference_output.grad[:, mine] @ weight[mine]
    check(f"model set={set_name}: input grad through the shard", shard_inputs.grad, through_shard.numpy(),
          torch.float64)
    check_true(f"model set={set_name}: the shards' input grads add up",
               torch.allclose(sum(reference_output.grad[:, i * per_rank:(i + 1) * per_rank]
                                  @ weight[i * per_rank:(i + 1) * per_rank] for i in range(n)),
                              reference_inputs.grad))


def model():
    for set_name, ps, members in MY_SETS:
        run(f"model set={set_name}", lambda: model_parallel(set_name, ps, members))


# ===================================================================== main
started = time.monotonic()
for section in SECTIONS:
    tally.section = section
    before = tally.cases
    {"gradients": gradients, "graph": graph, "integers": integers_section, "model": model}[section]()
    print(f"CASES {section} {tally.cases - before}", flush=True)
tally.section = "end"
rm.barrier()
rm.remove_process_set(ODD)
rm.remove_process_set(EVEN)
print(f"TIME rank {RANK} {time.monotonic() - started:.1f}s", flush=True)
tally.done()
