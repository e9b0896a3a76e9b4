"""The response cache's cycle reduction (``cache_protocol.combine``) on vectors made here, as
the cycle's MPI allreduce applies it: the header and slot bits reduce with MIN; a payload is
reduced only where every rank carried the same slot, with MPI's own rule for each reduction.
Jobs carry no payload for now (``cache_protocol.CARRY_PAYLOADS``); the reduction is kept,
tested, for a payload in an allreduce of its own."""

import warnings

import numpy as np
import pytest
from mpijob import ringrun

from ringmaster.proto import ringmaster_pb2 as pb
from ringmaster.worker.runtime import cache_protocol
from ringmaster.worker.runtime.cache_protocol import (MAX_PAYLOAD_BYTES, NO_JOIN, AgreedCycle, CacheProtocol,
                                                      CycleVector, Hit, Proposal, payload_code, payload_words)

SLOTS = 6


def vector(hits, carried=None, events=3, room=32):
    return CycleVector(queued=0, idle=False, events=events, closing=False, join_round=NO_JOIN, hits=hits,
                       carried=carried, room=room).encode(SLOTS)


def carrying(slot, values, reduce_op):
    values = np.asarray(values)
    return slot, payload_code(values.dtype.name, reduce_op), values.view(np.uint8)


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


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "int64"])
@pytest.mark.parametrize("reduce_op", [pb.SUM, pb.AVERAGE, pb.PRODUCT, pb.MIN, pb.MAX])
@pytest.mark.parametrize("ranks", [2, 3, 5])
def test_a_slot_every_rank_carries_is_reduced_in_the_cycle(dtype, reduce_op, ranks):
    generator = np.random.default_rng(ranks * 100 + reduce_op)
    parts = [(generator.standard_normal(7) * 20).astype(dtype) for _ in range(ranks)]
    result = CycleVector.reduce([vector((1, 4), carrying(4, part, reduce_op)) for part in parts])
    agreed = AgreedCycle.decode(result)
    assert agreed.ready == [1, 4] and agreed.events_agree
    slot, reduced = agreed.carried
    assert slot == 4 and reduced.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(reduced[:7], mpi_rule(parts, reduce_op))


def test_min_and_max_treat_nan_as_mpi_does():
    parts = [np.array([np.nan, 1.0, 2.0], np.float32), np.array([0.0, np.nan, 3.0], np.float32)]
    for reduce_op in (pb.MIN, pb.MAX):
        result = CycleVector.reduce([vector((0,), carrying(0, part, reduce_op)) for part in parts])
        _, reduced = AgreedCycle.decode(result).carried
        np.testing.assert_array_equal(reduced[:3], mpi_rule(parts, reduce_op))


@pytest.mark.parametrize("other", ["nothing", "another slot", "another dtype"])
def test_a_payload_not_carried_by_every_rank_is_ignored(other):
    ones = np.ones(4, np.float32)
    mine = vector((2, 3), carrying(2, ones, pb.SUM))
    theirs = {"nothing": vector((2, 3)),
              "another slot": vector((2, 3), carrying(3, ones, pb.SUM)),
              "another dtype": vector((2, 3), carrying(2, ones.astype(np.float64), pb.SUM))}[other]
    for order in ([mine, theirs], [theirs, mine], [mine, mine, theirs], [mine, theirs, mine]):
        agreed = AgreedCycle.decode(CycleVector.reduce([v.copy() for v in order]))
        assert agreed.carried is None and agreed.ready == [2, 3]


def test_the_header_still_reduces_with_min():
    result = CycleVector.reduce([vector((0, 5), events=4), vector((5,), events=2)])
    agreed = AgreedCycle.decode(result)
    assert agreed.ready == [5] and agreed.events == 2 and not agreed.events_agree and agreed.carried is None


def test_what_a_cycle_cannot_carry():
    assert payload_code("float16", pb.SUM) is None   # MPI reduces it in float32: another rounding
    assert payload_code("bool", pb.MAX) is None
    assert payload_code("float32", pb.ADASUM) is None


def test_a_large_payload_rides_in_a_vector_with_room_for_it():
    parts = [np.arange(5000, dtype=np.float32) * (rank + 1) for rank in range(3)]
    room = payload_words(parts[0].nbytes)
    assert room * 8 == 32 << 10   # 20,000 bytes: the next power of two
    result = CycleVector.reduce([vector((2,), carrying(2, part, pb.SUM), room=room) for part in parts])
    agreed = AgreedCycle.decode(result)
    assert agreed.ready == [2]
    np.testing.assert_array_equal(agreed.carried[1][:5000], parts[0] + parts[1] + parts[2])


def allreduce_response(name, count, prescale=1.0):
    response = pb.Response(op_type=pb.ALLREDUCE, reduce_op=pb.SUM, names=[name], dtype="float32", device="cpu",
                           prescale_factor=prescale, postscale_factor=1.0)
    response.shapes.add().dims.extend([count])
    return response


class _Entry:
    def __init__(self, count):
        self.tensor = np.ones(count, np.float32)
        self.handle = object()


def test_the_room_follows_what_ran_in_the_last_cycle(monkeypatch):
    """A slot rides once a cycle ran it (the room is then its size); a cycle that ran only
    slots a cycle cannot carry (too big, prescaled) gives the room back. (The protocol's
    rule, with carrying switched on; in jobs it is off: cache_protocol.CARRY_PAYLOADS.)"""
    monkeypatch.setattr(cache_protocol, "CARRY_PAYLOADS", True)
    protocol = CacheProtocol(capacity=8)
    for name, count, prescale in [("mid", 3000, 1.0), ("scaled", 3000, 0.5), ("big", 200_000, 1.0)]:
        protocol.propose(Proposal.from_response(allreduce_response(name, count, prescale), 0, (name,)))
    protocol.apply(_agree(protocol), 0.0)
    payload = lambda hit: hit.entry.tensor.view(np.uint8)  # noqa: E731

    def run(name, count):
        assert protocol.take((name,), Hit(_Entry(count), [], 0.0))
        sent = protocol.vector(0.0, payload)
        ready, carried = protocol.apply(CycleVector.reduce([sent]), 0.0)
        assert [slot.template.names[0] for slot in ready] == [name]
        return carried is not None

    assert protocol.payload_room == 32
    assert not run("mid", 3000)            # 12,000 bytes: no room yet
    assert protocol.payload_room * 8 == 16 << 10
    assert run("mid", 3000)                # the next time it rides
    assert not run("scaled", 3000)         # prescaled: never carried, and the room goes back
    assert protocol.payload_room == 32
    assert not run("big", 200_000)
    assert 200_000 * 4 > MAX_PAYLOAD_BYTES and protocol.payload_room == 32


def _agree(protocol):
    """A cycle that applies the queued proposals."""
    return CycleVector.reduce([protocol.vector(0.0)])


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
                results = [rm.allreduce(x, op=op, name=name) for _ in range(4)]  # negotiated, then cached
                if not all(torch.equal(result, results[0]) for result in results[1:]):
                    failures += 1
                    print(f"FAIL rank {rm.rank()}: {name} differs once cached", flush=True)
    print(f"DONE {rm.rank()} {failures} failures carried={current.runtime().cache.carried}", flush=True)
    rm.shutdown()
"""


def test_jobs_carry_no_payload_while_it_needs_an_mpi_op_written_in_python():
    """Such an op runs inside MPI's progress and needs the GIL there: it hung an 8-rank job."""
    assert not cache_protocol.CARRY_PAYLOADS and CacheProtocol(capacity=8).payload_room == 0


@pytest.mark.timeout(150)
@pytest.mark.parametrize("np", [2, 5])
def test_cached_results_equal_mpis_bit_for_bit(np):
    """Every dtype, reduction and size, negotiated once then cached three times: the same bits
    each time, at 2 and 5 ranks (no cycle carries data: carried=0)."""
    result = ringrun(np, CARRIED_BITS, timeout=140)
    failures = [line for line in result.output.splitlines() if line.startswith("FAIL")]
    assert not failures, "\n".join(failures[:20])
    done = result.lines_starting("DONE")
    assert len(done) == np and all(" 0 failures" in line for line in done), result.output[-3000:]
    assert all(int(line.split("carried=")[1]) == 0 for line in done), done


def test_an_overflowing_payload_gives_inf_without_a_warning():
    parts = [np.full(3, 3e38, np.float32), np.full(3, 3e38, np.float32)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # a warning inside the MPI op would end the process
        result = CycleVector.reduce([vector((0,), carrying(0, part, pb.SUM)) for part in parts])
    assert np.isinf(AgreedCycle.decode(result).carried[1][:3]).all()
