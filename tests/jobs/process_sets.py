"""Process sets on a real job of 4 ranks, checked against a single-process reference.

Sets {0,2} and {1,3} run the same collectives under the same names at the same time; a
third set {0,1,2} overlaps both, and its collectives interleave with global ones submitted
in a different order on every rank. Then registration errors, a non-member's call, and
remove / add again. Prints one ``FAIL`` line per wrong result, then ``DONE <cases>``.
"""

import random
import sys

import torch

import ringmaster as rm

rm.init()
RANK, SIZE = rm.rank(), rm.size()
assert SIZE == 4, "this job is written for 4 ranks"
failures = 0
cases = 0


def check(case, got, expected):
    global failures, cases
    cases += 1
    same = (isinstance(got, torch.Tensor) and isinstance(expected, torch.Tensor) and got.shape == expected.shape
            and got.dtype == expected.dtype and torch.allclose(got.double(), expected.double(), rtol=1e-6))
    if not isinstance(expected, torch.Tensor):
        same = got == expected
    if not same:
        failures += 1
        print(f"FAIL rank {RANK} {case}:\n  got {got}\n  expected {expected}", flush=True)


def raises(case, error_type, call, *fragments):
    """``call()`` must raise ``error_type`` whose message contains every fragment."""
    try:
        call()
    except error_type as error:
        missing = [f for f in fragments if f not in str(error)]
        check(f"{case} message has {missing}", missing, [])
        return
    except Exception as error:  # noqa: BLE001 - report the wrong kind of error
        check(f"{case} raises {error_type.__name__}", f"{type(error).__name__}: {error}", error_type.__name__)
        return
    check(f"{case} raises {error_type.__name__}", "no error", error_type.__name__)


def value(rank, shape, salt=0, dtype=torch.float32):
    generator = torch.Generator().manual_seed(100 * rank + salt)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator).to(dtype)
    return torch.randint(0, 100, shape, generator=generator).to(dtype)


# ------------------------------------------------------------- registration
check("global set ranks", rm.global_process_set.ranks, [0, 1, 2, 3])
check("global set rank()", rm.global_process_set.rank(), RANK)
check("global set size()", rm.global_process_set.size(), SIZE)
even = rm.add_process_set([2, 0])
odd = rm.add_process_set(rm.ProcessSet([3, 1]))
trio = rm.add_process_set([0, 1, 2])
check("ranks are sorted", (even.ranks, odd.ranks, trio.ranks), ([0, 2], [1, 3], [0, 1, 2]))
check("ids are distinct and not 0", len({0, even.process_set_id, odd.process_set_id, trio.process_set_id}), 4)
mine = even if RANK % 2 == 0 else odd
other = odd if mine is even else even
check("included", (mine.included(), other.included()), (True, False))
check("size", (mine.size(), trio.size()), (2, 3))
check("rank in set", mine.rank(), mine.ranks.index(RANK))
raises("rank() of a non-member", ValueError, other.rank, f"rank {RANK} is not a member")
members = mine.ranks
n = len(members)

# ------------------------------ the same names in {0,2} and {1,3} at the same time
inputs = {r: value(r, (5, 3)) for r in members}
total = sum(inputs.values())
check("allreduce Sum", rm.allreduce(inputs[RANK], op=rm.Sum, name="ps.x", process_set=mine), total)
check("allreduce Average", rm.allreduce(inputs[RANK], name="ps.x", process_set=mine), total / n)
ints = {r: value(r, (7,), 1, torch.int64) for r in members}
check("allreduce Average int floors", rm.allreduce(ints[RANK], op=rm.Average, process_set=mine),
      torch.div(sum(ints.values()), n, rounding_mode="floor"))
check("allreduce Max", rm.allreduce(inputs[RANK], op=rm.Max, process_set=mine),
      torch.stack(list(inputs.values())).max(0).values)
in_place = inputs[RANK].clone()
rm.allreduce_(in_place, op=rm.Sum, name="ps.x", process_set=mine)
check("allreduce_", in_place, total)
check("pre/postscale", rm.allreduce(inputs[RANK], op=rm.Sum, prescale_factor=0.5, postscale_factor=3.0,
                                    process_set=mine), total * 1.5)
grouped = rm.grouped_allreduce([inputs[RANK], inputs[RANK][0]], op=rm.Average, name="ps.g", process_set=mine)
check("grouped_allreduce 0", grouped[0], total / n)
check("grouped_allreduce 1", grouped[1], total[0] / n)
in_place = [inputs[RANK].clone(), inputs[RANK][:, 0].clone()]
rm.grouped_allreduce_(in_place, op=rm.Sum, process_set=mine)
check("grouped_allreduce_", in_place[1], total[:, 0])
# fused: many small allreduces of one set in flight together
handles = [rm.allreduce_async(torch.full((3,), float(RANK + i)), op=rm.Sum, name=f"ps.f.{i}", process_set=mine)
           for i in range(20)]
for i, handle in enumerate(handles):
    check(f"fused {i}", rm.synchronize(handle), torch.full((3,), float(sum(members) + n * i)))

rows = {r: value(r, (r + 1, 2), 2) for r in members}  # members send different numbers of rows
check("allgather", rm.allgather(rows[RANK], name="ps.x", process_set=mine), torch.cat([rows[r] for r in members]))
check("allgather 0-d", rm.allgather(torch.tensor(float(RANK)), process_set=mine),
      torch.tensor(members, dtype=torch.float32))

for root in members:  # root_rank is a global rank
    sent = value(RANK, (4,), 3)
    check(f"broadcast root {root}", rm.broadcast(sent, root_rank=root, name="ps.x", process_set=mine),
          value(root, (4,), 3))
    target = value(RANK, (2, 3), 4).t()
    rm.broadcast_(target, root_rank=root, process_set=mine)
    check(f"broadcast_ root {root}", target, value(root, (2, 3), 4).t())


def splits_of(rank):
    return [(rank + position) % 3 for position in range(n)]


sources = {r: torch.arange(sum(splits_of(r)) * 2, dtype=torch.float32).reshape(-1, 2) + 100 * r for r in members}
me = mine.rank()
received, received_splits = rm.alltoall(sources[RANK], splits=splits_of(RANK), name="ps.x", process_set=mine)
parts = []
for r in members:
    offsets = [0]
    for s in splits_of(r):
        offsets.append(offsets[-1] + s)
    parts.append(sources[r][offsets[me]:offsets[me + 1]])
check("alltoall splits", received, torch.cat(parts))
check("alltoall received splits", received_splits, torch.tensor([splits_of(r)[me] for r in members], dtype=torch.int32))
even_rows = {r: torch.arange(2 * n, dtype=torch.int64) + 10 * r for r in members}
check("alltoall even", rm.alltoall(even_rows[RANK], process_set=mine),
      torch.cat([even_rows[r][2 * me:2 * me + 2] for r in members]))

scatter = {r: value(r, (5, 2), 5) for r in members}
reduced = sum(scatter.values())
counts = [5 // n + (1 if i < 5 % n else 0) for i in range(n)]
start = sum(counts[:me])
check("reducescatter Sum", rm.reducescatter(scatter[RANK], op=rm.Sum, name="ps.x", process_set=mine),
      reduced[start:start + counts[me]])
check("reducescatter Average", rm.reducescatter(scatter[RANK], process_set=mine),
      reduced[start:start + counts[me]] / n)
rm.barrier(process_set=mine)

# ---------- an overlapping set, interleaved with global collectives in shuffled order
plan = []
for i in range(40):
    plan.append(("global", i))
    plan.append(("mine", i))
    if trio.included():
        plan.append(("trio", i))
random.Random(RANK).shuffle(plan)  # each rank submits in its own order
sets = {"global": rm.global_process_set, "mine": mine, "trio": trio}
handles = {}
for kind, i in plan:
    tensor = torch.full((i % 5 + 1,), float(RANK * 1000 + i))
    if i % 4 == 3:  # some allgathers among the allreduces
        handles[kind, i] = rm.allgather_async(tensor, name=f"mix.{i}", process_set=sets[kind])
    else:  # the same name in every set
        handles[kind, i] = rm.allreduce_async(tensor, op=rm.Sum, name=f"mix.{i}", process_set=sets[kind])
waits = list(handles)
random.Random(RANK + 100).shuffle(waits)
for kind, i in waits:
    ranks = sets[kind].ranks
    if i % 4 == 3:
        expected = torch.cat([torch.full((i % 5 + 1,), float(r * 1000 + i)) for r in ranks])
    else:
        expected = torch.full((i % 5 + 1,), float(sum(r * 1000 + i for r in ranks)))
    check(f"interleaved {kind} {i}", rm.synchronize(handles[kind, i]), expected)

# ----------------------------------- a mismatch fails the set's operation only
try:
    rm.allreduce(torch.ones(2 + mine.rank()), name="ps.mismatch", process_set=mine)
    check("mismatch in a set raises", "no error", "TensorMismatchError")
except rm.TensorMismatchError as error:
    check("mismatch names the tensor", "'ps.mismatch'" in str(error), True)
check("set usable after a mismatch", rm.allreduce(torch.ones(1), op=rm.Sum, process_set=mine),
      torch.full((1,), float(n)))

# ------------------------------------------------------------ invalid input
raises("non-member call", ValueError, lambda: rm.allreduce(torch.ones(1), process_set=other),
       f"rank {RANK} is not a member of process set {other.process_set_id}", str(other.ranks))
raises("non-member allgather", ValueError, lambda: rm.allgather_async(torch.ones(1), process_set=other),
       "not a member")
raises("non-member barrier", ValueError, lambda: rm.barrier(process_set=other), "not a member")
raises("root outside the set", ValueError,
       lambda: rm.broadcast(torch.ones(1), root_rank=other.ranks[0], process_set=mine),
       f"root_rank={other.ranks[0]}", "global rank")
raises("alltoall splits per set rank", ValueError,
       lambda: rm.alltoall(torch.ones(4), splits=[1, 1, 1, 1], process_set=mine), "process set")
raises("duplicate set", ValueError, lambda: rm.add_process_set([0, 2]),
       "already registered as process set", str(even.process_set_id))
raises("duplicate of the global set", ValueError, lambda: rm.add_process_set([0, 1, 2, 3]),
       "already registered as process set 0")
raises("rank out of range", ValueError, lambda: rm.add_process_set([1, 4]), "rank 4", "size 4")
raises("negative rank", ValueError, lambda: rm.add_process_set([-1, 0]), "rank -1")
raises("repeated rank", ValueError, lambda: rm.add_process_set([1, 1]), "more than once")
raises("empty set", ValueError, lambda: rm.add_process_set([]), "at least one rank")
raises("not ranks", TypeError, lambda: rm.ProcessSet(3), "global ranks")
raises("not integers", TypeError, lambda: rm.ProcessSet([0, "1"]), "'1'")
raises("registered twice", ValueError, lambda: rm.add_process_set(even), "already registered")
raises("unregistered set", ValueError,
       lambda: rm.allreduce(torch.ones(1), process_set=rm.ProcessSet([0, 1, 2, 3])), "not registered")
raises("not a set", TypeError, lambda: rm.allreduce(torch.ones(1), process_set=[0, 1]), "ProcessSet")
check("global set cannot be removed", rm.remove_process_set(rm.global_process_set), False)

# ------------------------------------------------------ remove, add again
check("remove", (rm.remove_process_set(even), rm.remove_process_set(odd)), (True, True))
check("removed set is invalidated", (even.process_set_id, even.size(), even.rank()), (None, None, None))
check("remove twice", rm.remove_process_set(even), False)
raises("removed set", ValueError, lambda: rm.allreduce(torch.ones(1), process_set=mine), "not registered")
again = rm.add_process_set([0, 2])
check("added again with a new id", again.process_set_id not in (None, 0, odd.process_set_id), True)
if again.included():
    check("added again works", rm.allreduce(torch.ones(1) * RANK, op=rm.Sum, process_set=again), torch.full((1,), 2.0))
single = rm.add_process_set([3])
if single.included():
    check("set of one rank", rm.allreduce(torch.ones(2) * 5, op=rm.Average, process_set=single), torch.full((2,), 5.0))
    check("set of one rank allgather", rm.allgather(torch.ones(2), process_set=single), torch.ones(2))
check("global collective still fine", rm.allreduce(torch.ones(1), op=rm.Sum), torch.full((1,), float(SIZE)))
for process_set in (again, single, trio):
    check(f"remove {process_set.ranks}", rm.remove_process_set(process_set), True)

rm.barrier()
print(f"DONE {cases} cases, {failures} failures", flush=True)
rm.shutdown()
sys.exit(1 if failures else 0)
