"""Small data in the response cache's cycle (``cache_protocol.Payload``): simulated ranks, each a
``CacheProtocol``, whose vectors reduce with MIN and whose payloads reduce with MPI's rule, as
the two allreduces of a cycle do; then real jobs, whose cached results must equal the
negotiated ones bit for bit while cycles carry them."""

import numpy as np
import pytest
from mpijob import ringrun

from ringmaster.proto import ringmaster_pb2 as pb
from ringmaster.worker.runtime.cache_payload import MIN_PAYLOAD_BYTES, PAYLOAD_FRESH_RUNS, PAYLOAD_SLOTS, carriable
from ringmaster.worker.runtime.cache_protocol import CacheProtocol, CycleVector, Hit, Proposal


def mpi_rule(parts, reduce_op):
    """What MPI's built-in op computes, folding ``out = op(out, in)`` as it does."""
    out = parts[0].copy()
    for incoming in parts[1:]:
        if reduce_op in (pb.SUM, pb.AVERAGE):
            out = out + incoming
        elif reduce_op == pb.PRODUCT:
            out = out * incoming
        elif reduce_op == pb.MIN:
            out = np.where(out < incoming, out, incoming)
        else:
            out = np.where(out > incoming, out, incoming)
    return out


def allreduce_response(name, count, dtype="float32", reduce_op=pb.SUM, prescale=1.0, device="cpu", compression=""):
    response = pb.Response(op_type=pb.ALLREDUCE, reduce_op=reduce_op, names=[name], dtype=dtype, device=device,
                           prescale_factor=prescale, postscale_factor=1.0, compression=compression)
    response.shapes.add().dims.extend([count])
    return response


class _Entry:
    def __init__(self, values):
        self.tensor = values
        self.handle = object()


class Job:
    """Simulated ranks whose cycles run as a job's do (vectors by MIN, payloads by MPI's rule)."""

    def __init__(self, ranks, responses, capacity=16):
        self.ranks = [CacheProtocol(capacity=capacity, ranks=ranks) for _ in range(ranks)]
        for protocol in self.ranks:
            for response in responses:
                protocol.propose(Proposal.from_response(response, 0, (response.names[0],)))
        self.cycle()

    def cycle(self, hits=None):
        """One cycle; ``hits``: {rank: {name: values}} taken first. Returns each rank's
        (names that ran, {name: carried data})."""
        for rank, taken in (hits or {}).items():
            for name, values in taken.items():
                assert self.ranks[rank].take((name,), Hit(_Entry(values), [], 0.0))
        vectors = [protocol.vector(0.0, lambda hit: hit.entry.tensor) for protocol in self.ranks]
        outgoing = [protocol.outgoing for protocol in self.ranks]
        reduced = None
        if outgoing[0] is not None:
            assert all(part is not None and part.shape == outgoing[0].shape and part.dtype == outgoing[0].dtype
                       for part in outgoing), "every rank carries the same payload"
            reduced = mpi_rule(outgoing, self.ranks[0].payload.reduce_op)
        result = CycleVector.reduce(vectors)
        results = []
        for protocol in self.ranks:
            ready, carried = protocol.apply(result.copy(), 0.0, None if reduced is None else reduced.copy())
            results.append(([slot.template.names[0] for slot in ready],
                            {slot.template.names[0]: data for slot, data in carried}))
        return results


def values(rank, count, dtype="float32", seed=0):
    return (np.random.default_rng(seed * 100 + rank).standard_normal(count) * 20).astype(dtype)


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "int64"])
@pytest.mark.parametrize("reduce_op", [pb.SUM, pb.AVERAGE, pb.PRODUCT, pb.MIN, pb.MAX])
@pytest.mark.parametrize("ranks", [2, 3, 5])
def test_a_slot_rides_from_its_second_run_with_mpis_result(dtype, reduce_op, ranks):
    job = Job(ranks, [allreduce_response("metric", 7, dtype, reduce_op)])
    parts = [values(rank, 7, dtype) for rank in range(ranks)]
    hits = {rank: {"metric": parts[rank]} for rank in range(ranks)}
    first = job.cycle(hits)
    assert all(ran == ["metric"] and carried == {} for ran, carried in first)  # ran as a transfer
    second = job.cycle(hits)
    for ran, carried in second:
        assert ran == ["metric"]
        np.testing.assert_array_equal(carried["metric"], mpi_rule(parts, reduce_op))


def test_min_and_max_treat_nan_as_mpi_does():
    parts = [np.array([np.nan, 1.0, 2.0], np.float32), np.array([0.0, np.nan, 3.0], np.float32)]
    for reduce_op in (pb.MIN, pb.MAX):
        job = Job(2, [allreduce_response("m", 3, reduce_op=reduce_op)])
        hits = {rank: {"m": parts[rank]} for rank in range(2)}
        job.cycle(hits)
        for _, carried in job.cycle(hits):
            np.testing.assert_array_equal(carried["m"], mpi_rule(parts, reduce_op))


def test_metrics_logged_in_turn_ride_together():
    """loss, then accuracy, then loss again: once both ran, each rides in every cycle."""
    job = Job(2, [allreduce_response("loss", 1), allreduce_response("accuracy", 1)])
    loss = {rank: {"loss": np.array([rank + 1.0], np.float32)} for rank in range(2)}
    accuracy = {rank: {"accuracy": np.array([10.0 * rank], np.float32)} for rank in range(2)}
    job.cycle(loss)
    job.cycle(accuracy)
    for _ in range(3):
        for hits, name, total in ((loss, "loss", 3.0), (accuracy, "accuracy", 10.0)):
            for ran, carried in job.cycle(hits):
                assert ran == [name] and carried[name].tolist() == [total]


def test_a_payload_slot_pending_on_some_ranks_only_is_not_carried():
    job = Job(3, [allreduce_response("a", 4), allreduce_response("b", 4)])
    a = {rank: {"a": values(rank, 4)} for rank in range(3)}
    job.cycle(a)
    # Rank 2 is late with "a" and submits "b" first: "a" is not ready, and nothing is carried.
    mixed = {0: {"a": values(0, 4)}, 1: {"a": values(1, 4)}, 2: {"b": values(2, 4)}}
    assert all(ran == [] and carried == {} for ran, carried in job.cycle(mixed))
    # Then every rank has both: both ready, "a" carried with every rank's data.
    late = {0: {"b": values(0, 4)}, 1: {"b": values(1, 4)}, 2: {"a": values(2, 4, seed=1)}}
    for ran, carried in job.cycle(late):
        assert ran == ["a", "b"]
        np.testing.assert_array_equal(carried["a"], values(0, 4) + values(1, 4) + values(2, 4, seed=1))


@pytest.mark.parametrize("response, why", [
    (allreduce_response("half", 4, dtype="float16"), "MPI reduces it in float32: another rounding"),
    (allreduce_response("flags", 4, dtype="bool", reduce_op=pb.MAX), "bool"),
    (allreduce_response("adasum", 4, reduce_op=pb.ADASUM), "Adasum is no MPI op"),
    (allreduce_response("scaled", 4, prescale=0.5), "prescaled before the transfer"),
    (allreduce_response("wire", 4, compression="int8"), "8-bit wire format"),
    (allreduce_response("device", 4, device="cuda"), "device memory"),  # cuda-marker: not a device (a name)
    (allreduce_response("big", 20_000), "over 64 KiB"),
])
def test_what_a_cycle_never_carries(response, why):
    job = Job(2, [response])
    assert not job.ranks[0].table.slots[0].carriable, why
    assert job.ranks[0].payload is None


def test_what_may_ride():
    assert carriable("float32", pb.AVERAGE) and carriable("int64", pb.MIN)
    assert not carriable("float16", pb.SUM) and not carriable("float32", pb.ADASUM)


def test_floats_on_more_than_two_ranks_ride_only_up_to_mpis_small_message_size():
    """The payload's bytes, not each slot's, decide MPI's algorithm, so they stay small."""
    count = MIN_PAYLOAD_BYTES // 4 // 2  # two slots fill the room
    names = ["x", "y", "z"]
    job = Job(3, [allreduce_response(name, count) for name in names])
    for name in names:
        job.cycle({rank: {name: values(rank, count)} for rank in range(3)})
    payload = job.ranks[0].payload
    assert payload.edges[-1] * 4 <= MIN_PAYLOAD_BYTES and payload.slots == (2, 1)  # the latest two
    ints = Job(3, [allreduce_response(f"i{n}", 1000, dtype="int32") for n in range(3)])
    for n in range(3):
        ints.cycle({rank: {f"i{n}": values(rank, 1000, "int32")} for rank in range(3)})
    assert len(ints.ranks[0].payload.slots) == 3  # integers reduce exactly in any order: up to 64 KiB


def test_a_payload_holds_one_dtype_and_reduction_and_at_most_its_slot_count():
    floats = [allreduce_response(f"s{n}", 1) for n in range(PAYLOAD_SLOTS + 2)]
    job = Job(2, floats + [allreduce_response("ints", 1, dtype="int64")], capacity=32)
    # all the float slots in one cycle: the payload takes the first PAYLOAD_SLOTS of them
    job.cycle({rank: {f"s{n}": values(rank, 1, seed=n) for n in range(PAYLOAD_SLOTS + 2)} for rank in range(2)})
    payload = job.ranks[0].payload
    assert payload.dtype == np.float32 and payload.slots == tuple(range(PAYLOAD_SLOTS))
    # an int64 slot runs: the payload is of the latest one's dtype and reduction only
    job.cycle({rank: {"ints": values(rank, 1, "int64")} for rank in range(2)})
    assert job.ranks[0].payload.slots == (PAYLOAD_SLOTS + 2,) and job.ranks[0].payload.dtype == np.int64


def test_a_slot_that_stops_running_leaves_the_payload():
    """A metric logged earlier stops costing every cycle a second allreduce of its zeros."""
    job = Job(2, [allreduce_response("metric", 1), allreduce_response("big", 100_000)])
    job.cycle({rank: {"metric": values(rank, 1)} for rank in range(2)})
    assert job.ranks[0].payload.slots == (0,)
    for run in range(PAYLOAD_FRESH_RUNS):
        assert job.ranks[0].payload is not None, run
        job.cycle({rank: {"big": values(rank, 100_000)} for rank in range(2)})  # too big to ride
    assert all(protocol.payload is None for protocol in job.ranks)
    job.cycle()  # the next cycle carries nothing
    assert all(protocol.outgoing is None for protocol in job.ranks)


def test_an_evicted_slot_leaves_the_payload():
    job = Job(2, [allreduce_response("a", 1), allreduce_response("b", 1)], capacity=2)
    for name in ("a", "b"):
        job.cycle({rank: {name: values(rank, 1)} for rank in range(2)})
    assert set(job.ranks[0].payload.slots) == {0, 1}
    for protocol in job.ranks:  # a third collective takes the least recently run slot, "a"'s
        protocol.propose(Proposal.from_response(allreduce_response("c", 1, dtype="int32"), 0, ("c",)))
    job.cycle()
    assert job.ranks[0].payload.slots == (1,)


CARRIED_BITS = """
    import torch, ringmaster as rm
    from ringmaster.worker.runtime import current
    rm.init()
    failures = 0
    for count in (1, 7, 33, 64, 5000):
        for dtype in (torch.float32, torch.float64, torch.int32, torch.int64):
            for op in (rm.Sum, rm.Average, rm.Min, rm.Max, rm.Product):
                generator = torch.Generator().manual_seed(1000 * rm.rank() + count)
                x = (torch.randn(count, generator=generator, dtype=torch.float64) * 1e3).to(dtype)
                name = f"bits.{count}.{dtype}.{op}"
                # negotiated, then cached: run as a transfer once, then carried by the cycles
                results = [rm.allreduce(x, op=op, name=name) for _ in range(4)]
                if not all(torch.equal(result, results[0]) for result in results[1:]):
                    failures += 1
                    print(f"FAIL rank {rm.rank()}: {name} differs once cached", flush=True)
    print(f"DONE {rm.rank()} {failures} failures carried={current.runtime().cache.carried}", flush=True)
    rm.shutdown()
"""


@pytest.mark.timeout(150)
@pytest.mark.parametrize("np", [2, 5])
def test_carried_results_equal_negotiated_ones_bit_for_bit(np):
    """Every dtype, reduction and size, negotiated once then cached three times: the same bits
    each time, at 2 and 5 ranks, with cycles carrying the small ones."""
    result = ringrun(np, CARRIED_BITS, timeout=140)
    failures = [line for line in result.output.splitlines() if line.startswith("FAIL")]
    assert not failures, "\n".join(failures[:20])
    done = result.lines_starting("DONE")
    assert len(done) == np and all(" 0 failures" in line for line in done), result.output[-3000:]
    assert all(int(line.split("carried=")[1]) > 0 for line in done), done
