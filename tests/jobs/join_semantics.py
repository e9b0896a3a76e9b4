"""join() as Horovod defines it, with every rank joining first in turn.

Round ``first`` (one per rank): rank ``first`` joins at once; the others start allreduces of
every reducible dtype at once (several in flight), with Sum and Average, which complete
with the joined rank contributing zeros and Average dividing by the full job size (integers
truncating); then an allgather and a broadcast, which must fail with a RuntimeError on the
ranks that called them; then every rank but ``last`` joins, and ``last`` runs one more
allreduce, which can only complete once all the others have joined (it sees only its own
contribution), and joins last. join() must return ``last`` on every rank.

With ``JOIN_WARM=1``, every rank first runs the round's named collectives together once, so
that the names were negotiated before. Prints FAIL lines, then DONE.
"""

import os

import torch

import ringmaster as rm
from job_report import Tally

rm.init()
RANK, SIZE = rm.rank(), rm.size()
TALLY = Tally(RANK)
WARM = os.environ.get("JOIN_WARM") == "1"
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64, torch.uint8]


def contribution(rank, dtype):
    # signed values for signed types, so that truncation toward zero is visible
    values = torch.tensor([rank + 1, 2 * rank + 3, -(rank + 2)], dtype=torch.float64)
    if dtype == torch.uint8:
        values = values.abs()
    return values.to(dtype)


def expected(active, dtype, op):
    total = sum(contribution(r, dtype).to(torch.float64) for r in active)
    if op == rm.Average:
        total = total / SIZE
        if not dtype.is_floating_point:
            total = torch.trunc(total)
    return total.to(dtype)


def round_collectives(first, last, round_index):
    """What every rank but ``first`` does before joining; ``last`` also runs the final allreduce."""
    active = [r for r in range(SIZE) if r != first]
    handles = [(dtype, op, rm.allreduce_async(contribution(RANK, dtype), op=op, name=f"j{round_index}.{dtype}.{op}"))
               for dtype in DTYPES for op in (rm.Sum, rm.Average)]
    for dtype, op, handle in handles:
        got = rm.synchronize(handle)
        want = expected(active, dtype, op)
        ok = torch.allclose(got.double(), want.double(), rtol=1e-2, atol=1e-2) if dtype.is_floating_point \
            else torch.equal(got, want)
        TALLY.report(f"round {first}: allreduce {dtype} op {op} with rank {first} joined", ok,
                     f"got {got.tolist()} want {want.tolist()}")
    for what, call in [("allgather", lambda: rm.allgather(torch.ones(2), name=f"g{round_index}")),
                       ("broadcast", lambda: rm.broadcast(torch.ones(2), root_rank=last, name=f"b{round_index}"))]:
        try:
            call()
            TALLY.report(f"round {first}: {what} with a joined rank raises", False, "it returned")
        except RuntimeError as error:
            TALLY.report(f"round {first}: {what} with a joined rank raises", isinstance(error, rm.RingmasterError)
                         and "joined" in str(error) and "join()" in str(error), str(error))


for round_index, first in enumerate(range(SIZE)):
    last = (first + SIZE - 1) % SIZE
    if WARM:  # every name of the round negotiated once by every rank
        for dtype in DTYPES:
            for op in (rm.Sum, rm.Average):
                rm.allreduce(contribution(RANK, dtype), op=op, name=f"j{round_index}.{dtype}.{op}")
        rm.allreduce(torch.ones(1), name=f"final{round_index}")
    if RANK != first:
        round_collectives(first, last, round_index)
    if RANK == last:
        alone = rm.allreduce(torch.tensor([float(RANK + 1)]), op=rm.Sum, name=f"final{round_index}")
        TALLY.report(f"round {first}: the last rank's allreduce after all others joined", alone.item() == RANK + 1,
                     f"got {alone.item()}")
    joined_last = rm.join()
    TALLY.report(f"round {first}: join() returns the last rank", joined_last == last, f"got {joined_last}")
    after = rm.allreduce(torch.ones(1), op=rm.Sum, name=f"after{round_index}")
    TALLY.report(f"round {first}: collectives work again after join", after.item() == SIZE)

TALLY.done()
