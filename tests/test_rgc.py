"""Residual gradient compression, per rank (ringmaster.worker.compression.rgc): the residual invariant
(sent + residual == accumulated gradients, exactly), combine over simulated ranks, the
message bytes, selection counts, quantized RGC, momentum correction against torch's SGD,
clipping, dense decisions, argument and NaN errors, dtypes, the top-k baseline, checkpoints.
Single process: N ranks are N compressors whose messages are concatenated."""

from __future__ import annotations

import math
import struct

import pytest
import torch

from ringmaster.worker.compression import rgc
from ringmaster.worker.compression.rgc import Plan, RGCCompressor, TopKCompressor

pytestmark = pytest.mark.timeout(120)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]  # cuda skips (conftest) without a GPU


def gen(seed):
    return torch.Generator().manual_seed(seed)


def dyadic(shape, seed, dtype=torch.float32, high=64, device="cpu"):
    """Integer multiples of 1/8: sums of a few thousand of them are exact in float32."""
    shape = (shape,) if isinstance(shape, int) else shape
    return (torch.randint(-high, high + 1, shape, generator=gen(seed)).to(torch.float64) / 8).to(dtype).to(device)


def sent_dense(message, numel, dtype, quantized=False):
    """What one message carries, as a dense float64 vector."""
    [(indices, values)] = rgc.decode(message.cpu(), 1, dtype, quantized=quantized)
    return torch.zeros(numel, dtype=torch.float64).index_add_(0, indices, values.to(torch.float64))


def sparse(**kwargs):
    kwargs.setdefault("min_size", 0)
    return RGCCompressor(**kwargs)


# ---------------------------------------------------------------------------------------
# The residual invariant


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("quantize,selection", [(False, "exact"), (False, "trimmed"), (False, "threshold"),
                                                (False, "auto"), (True, "exact"), (True, "trimmed")])
def test_sent_plus_residual_is_the_sum_of_gradients_exactly(quantize, selection, dtype):
    # k = 4: a quantized mean of 4 multiples of 1/8 is exact, and so is every difference.
    n, steps, ranks = 4096, 40, 2
    comps = [sparse(ratio=4 / n, selection=selection, quantize=quantize) for _ in range(ranks)]
    for rank, comp in enumerate(comps):
        total_grad = torch.zeros(n, dtype=torch.float64)
        total_sent = torch.zeros(n, dtype=torch.float64)
        for step in range(steps):
            grad = dyadic((64, 64), seed=1000 * rank + step, dtype=dtype)
            plan = comp.prepare("w", grad, ranks)
            assert not plan.dense
            total_grad += grad.reshape(-1).to(torch.float64)
            total_sent += sent_dense(plan.message, n, dtype, quantize)
        residual = comp.residual("w").reshape(-1).to(torch.float64)
        assert torch.equal(total_sent + residual, total_grad)
        assert total_sent.abs().sum() > 0


@pytest.mark.parametrize("quantize", [False, True])
@pytest.mark.parametrize("nesterov", [False, True])
def test_with_momentum_sent_plus_residual_is_the_sum_of_updates(nesterov, quantize):
    n, m, steps = 2048, 0.5, 30
    comp = sparse(ratio=2 / n, selection="exact", quantize=quantize, momentum=m, nesterov=nesterov)
    total_added = torch.zeros(n, dtype=torch.float64)
    total_sent = torch.zeros(n, dtype=torch.float64)
    for step in range(steps):
        grad = dyadic(n, seed=step, dtype=torch.float64)
        before = comp.momentum_buffer("w") if step else torch.zeros(n, dtype=torch.float64)
        momentum = m * before + grad
        total_added += grad + m * momentum if nesterov else momentum
        plan = comp.prepare("w", grad, 2)
        sent = sent_dense(plan.message, n, torch.float64, quantize)
        total_sent += sent
        [(indices, _)] = rgc.decode(plan.message, 1, torch.float64, quantized=quantize)
        after = comp.momentum_buffer("w")
        assert torch.equal(after[indices], torch.zeros(indices.numel(), dtype=torch.float64))  # masking
        kept = torch.ones(n, dtype=torch.bool).index_fill_(0, indices, False)
        assert torch.equal(after[kept], momentum[kept])
    assert torch.equal(total_sent + comp.residual("w"), total_added)


def test_with_clipping_sent_plus_residual_is_the_sum_of_clipped_gradients():
    n, ranks, clip = 1000, 4, 1.0
    comp = sparse(ratio=0.01, clip_norm=clip)
    total_clipped = torch.zeros(n, dtype=torch.float64)
    total_sent = torch.zeros(n, dtype=torch.float64)
    for step in range(20):
        grad = torch.randn(n, generator=gen(step), dtype=torch.float64) * (0.01 if step % 2 else 1.0)
        limit = clip / math.sqrt(ranks)
        total_clipped += grad * min(1.0, limit / float(grad.norm()))
        total_sent += sent_dense(comp.prepare("w", grad, ranks).message, n, torch.float64)
    torch.testing.assert_close(total_sent + comp.residual("w"), total_clipped, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_rounding_stays_in_the_float32_residual(dtype):
    # Values up to 512 in steps of 1/8 need 13 bits: float16 and bfloat16 round them.
    n = 4096
    comp = sparse(ratio=8 / n)
    total_grad = torch.zeros(n, dtype=torch.float64)
    total_sent = torch.zeros(n, dtype=torch.float64)
    rounded = False
    for step in range(30):
        grad = dyadic(n, seed=step, high=4096).to(dtype)
        total_grad += grad.to(torch.float64)
        plan = comp.prepare("w", grad, 1)
        total_sent += sent_dense(plan.message, n, dtype)
        residual = comp.residual("w")
        assert residual.dtype == torch.float32
        [(indices, _)] = rgc.decode(plan.message, 1, dtype)
        rounded |= bool(residual[indices].ne(0).any())
    assert rounded
    assert torch.equal(total_sent + comp.residual("w").to(torch.float64), total_grad)


# ---------------------------------------------------------------------------------------
# combine over simulated ranks


def spiked(ranks, spikes, shape, seed):
    """Per rank: small dyadic noise (< 1) plus large values at that rank's spike indices."""
    grads = []
    for rank in range(ranks):
        grad = dyadic(shape, seed=seed + rank, high=7).reshape(-1)
        grad[spikes[rank]] = torch.arange(len(spikes[rank]), dtype=torch.float32) / 8 + 10 + rank
        grads.append(grad.reshape(shape))
    return grads


def reference_average(grads, spikes):
    total = torch.zeros(grads[0].numel(), dtype=torch.float64)
    for grad, chosen in zip(grads, spikes):
        index = torch.tensor(chosen)
        total[index] += grad.reshape(-1).to(torch.float64)[index]
    return (total / len(grads)).reshape(grads[0].shape)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("layout", ["overlapping", "disjoint", "partly"])
def test_combine_is_the_average_of_the_selected_entries(ranks, layout, device):
    shape, k = (4, 8, 16), 5
    if layout == "overlapping":
        spikes = [[3, 40, 77, 100, 511]] * ranks
    elif layout == "disjoint":
        spikes = [[r + ranks * j for j in range(k)] for r in range(ranks)]
    else:
        spikes = [[0, 1, 2, 300 + r, 400 + 2 * r] for r in range(ranks)]
    grads = spiked(ranks, spikes, shape, seed=7)
    comps = [sparse(ratio=k / 512, selection="exact") for _ in range(ranks)]
    plans = [comp.prepare("w", grad.to(device), ranks) for comp, grad in zip(comps, grads)]
    assert all(plan.count == k and plan.message.device.type == device for plan in plans)
    gathered = torch.cat([plan.message for plan in plans])
    expected = reference_average(grads, spikes)
    for comp in comps:
        result = comp.combine("w", gathered, ranks)
        assert result.shape == shape and result.dtype == torch.float32 and result.device.type == device
        assert torch.equal(result.cpu().to(torch.float64), expected)


@pytest.mark.parametrize("ranks", [2, 4])
def test_combine_with_empty_messages(ranks):
    # Quantized first steps take positive entries; an all-negative rank has none to send.
    n = 256
    grads = [-(dyadic(n, seed=r).abs() + 1) if r % 2 else dyadic(n, seed=r) for r in range(ranks)]
    comps = [sparse(ratio=4 / n, selection="exact", quantize=True) for _ in range(ranks)]
    plans = [comp.prepare("b", grad, ranks) for comp, grad in zip(comps, grads)]
    for rank, plan in enumerate(plans):
        assert plan.count == (0 if rank % 2 else 4)
        assert plan.message.numel() == (4 if rank % 2 else 4 + 16 + 4)
    expected = sum(sent_dense(plan.message, n, torch.float32, True) for plan in plans) / ranks
    result = comps[0].combine("b", torch.cat([plan.message for plan in plans]), ranks)
    assert torch.equal(result.to(torch.float64), expected)
    assert result.abs().sum() > 0


def test_combine_accepts_messages_at_odd_offsets():
    # float16 values make the next message start on a byte offset not divisible by 4.
    n = 100
    comps = [sparse(ratio=3 / n, selection="exact") for _ in range(3)]
    grads = [dyadic(n, seed=r, dtype=torch.float16) for r in range(3)]
    plans = [comp.prepare("h", grad, 3) for comp, grad in zip(comps, grads)]
    assert plans[0].message.numel() == 4 + 12 + 6
    expected = sum(sent_dense(plan.message, n, torch.float16) for plan in plans) / 3
    result = comps[1].combine("h", torch.cat([plan.message for plan in plans]), 3)
    assert result.dtype == torch.float16
    assert torch.equal(result, expected.to(torch.float16))


# ---------------------------------------------------------------------------------------
# Message format


def test_message_bytes():
    grad = torch.zeros(10)
    grad[[2, 7, 9]] = torch.tensor([5.0, -6.0, 0.5])
    plan = sparse(ratio=0.2, selection="exact").prepare("w", grad, 1)
    expected = struct.pack("<i", 2) + struct.pack("<2i", 2, 7) + struct.pack("<2f", 5.0, -6.0)
    assert plan.message.dtype == torch.uint8 and plan.message.dim() == 1
    assert bytes(plan.message.tolist()) == expected


def test_quantized_message_bytes():
    grad = torch.tensor([1.0, 4.0, -9.0, 2.0, 0.0, 3.0])
    plan = sparse(ratio=0.5, selection="exact", quantize=True).prepare("w", grad, 1)
    expected = struct.pack("<i", 3) + struct.pack("<3i", 1, 3, 5) + struct.pack("<f", 3.0)
    assert bytes(plan.message.tolist()) == expected


@pytest.mark.parametrize("dtype,size", [(torch.float16, 2), (torch.bfloat16, 2), (torch.float32, 4),
                                        (torch.float64, 8)])
def test_values_travel_in_the_gradient_dtype(dtype, size):
    n, k = 1000, 3
    plan = sparse(ratio=k / n).prepare("w", dyadic(n, seed=1, dtype=dtype), 1)
    assert plan.message.numel() == 4 + 4 * k + size * k
    quantized = sparse(ratio=k / n, quantize=True).prepare("w", dyadic(n, seed=1, dtype=dtype), 1)
    assert quantized.message.numel() == 4 + 4 * k + size


def test_encode_decode_round_trip():
    indices = torch.tensor([1, 5, 8])
    values = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)
    buffer = torch.cat([rgc.encode(indices, values), rgc.encode(indices[:0], values[:0])])
    (first_i, first_v), (second_i, second_v) = rgc.decode(buffer, 2, torch.float64)
    assert torch.equal(first_i, indices) and torch.equal(first_v, values)
    assert second_i.numel() == 0 and second_v.numel() == 0


def test_bad_gathered_buffers_raise_naming_the_tensor():
    comp = sparse(ratio=0.1, selection="exact")
    message = comp.prepare("layer1.weight", dyadic(100, seed=0), 2).message
    twice = torch.cat([message, message])
    assert comp.combine("layer1.weight", twice, 2).shape == (100,)
    bad = {
        "short": twice[:-1],
        "extra": torch.cat([twice, torch.zeros(3, dtype=torch.uint8)]),
        "one message for two ranks": message,
        "cut in the header": torch.cat([message, message[:2]]),
    }
    for buffer in bad.values():
        with pytest.raises(RuntimeError, match="layer1.weight"):
            comp.combine("layer1.weight", buffer, 2)
    with pytest.raises(RuntimeError, match="layer1.weight"):  # three messages for two ranks
        comp.combine("layer1.weight", torch.cat([twice, message]), 2)
    huge = torch.cat([torch.tensor([1000], dtype=torch.int32).view(torch.uint8), message[4:]])
    with pytest.raises(RuntimeError, match="layer1.weight"):
        comp.combine("layer1.weight", torch.cat([huge, message]), 2)
    outside = rgc.encode(torch.tensor([100]), torch.tensor([1.0]))
    with pytest.raises(RuntimeError, match="outside"):
        comp.combine("layer1.weight", torch.cat([outside, message]), 2)
    with pytest.raises(TypeError, match="uint8"):
        comp.combine("layer1.weight", twice.to(torch.int32), 2)
    with pytest.raises(RuntimeError, match="before prepare"):
        comp.combine("unknown", twice, 2)


# ---------------------------------------------------------------------------------------
# Selection


@pytest.mark.parametrize("selection", ["exact", "trimmed", "auto"])
def test_exact_methods_send_exactly_k(selection):
    n, ratio = 50_000, 0.001
    comp = sparse(ratio=ratio, selection=selection)
    for step in range(8):
        grad = torch.randn(n, generator=gen(step))
        plan = comp.prepare("w", grad, 1)
        assert plan.count == 50
        [(indices, _values)] = rgc.decode(plan.message, 1, torch.float32)
        assert torch.equal(indices, indices.sort().values) and indices.unique().numel() == 50


@pytest.mark.parametrize("selection", ["threshold", "sampled"])
def test_threshold_methods_send_k_to_2k(selection):
    n, k = 200_000, 200
    comp = sparse(ratio=k / n, selection=selection)
    upper = 2 * k if selection == "threshold" else int(2 * k * 1.25)
    for step in range(12):
        plan = comp.prepare("w", torch.randn(n, generator=gen(step)), 1)
        assert k <= plan.count <= upper
    if selection == "threshold":
        thresholds = comp._states["w"].thresholds[0]
        assert thresholds.searches + thresholds.reuses == 12  # one state per tensor, kept across steps


def test_the_largest_residual_entries_are_selected():
    n = 1000
    comp = sparse(ratio=0.01, selection="exact")
    for step in range(5):
        grad = torch.randn(n, generator=gen(step), dtype=torch.float64)
        before = comp.residual("w") + grad if step else grad
        [(indices, values)] = rgc.decode(comp.prepare("w", grad, 1).message, 1, torch.float64)
        assert torch.equal(values, before[indices])
        assert set(indices.tolist()) == set(before.abs().topk(10).indices.tolist())


def test_k_uses_the_decimal_ratio():
    # 0.1 * 30 is 3.0000000000000004 in binary floating point; k must still be 3.
    plan = sparse(ratio=0.1, selection="exact").prepare("w", torch.randn(30, generator=gen(0)), 1)
    assert plan.count == 3


# ---------------------------------------------------------------------------------------
# Quantized RGC


def test_quantized_alternates_signs_and_sends_one_value():
    n, k = 2000, 10
    comp = sparse(ratio=k / n, selection="trimmed", quantize=True)
    for step in range(8):
        grad = torch.randn(n, generator=gen(step), dtype=torch.float64)
        before = comp.residual("w") + grad if step else grad
        plan = comp.prepare("w", grad, 1)
        assert plan.count == k and plan.message.numel() == 4 + 4 * k + 8
        [(indices, values)] = rgc.decode(plan.message, 1, torch.float64, quantized=True)
        sign = 1 if step % 2 == 0 else -1
        assert bool((values * sign > 0).all()) and values.unique().numel() == 1
        assert set(indices.tolist()) == set((before * sign).topk(k).indices.tolist())
        mean = before[indices].mean()
        torch.testing.assert_close(values[0], mean, rtol=0, atol=0)
        torch.testing.assert_close(comp.residual("w")[indices], before[indices] - mean, rtol=0, atol=0)


def test_quantized_with_fewer_entries_of_the_sign_than_k():
    grad = torch.tensor([-1.0, 2.0, -3.0, -4.0, -5.0, -6.0, -7.0, -8.0])
    comp = sparse(ratio=0.5, selection="exact", quantize=True)
    plan = comp.prepare("w", grad, 1)
    assert plan.count == 1 and bytes(plan.message.tolist()) == struct.pack("<iif", 1, 1, 2.0)
    plan = comp.prepare("w", torch.zeros(8), 1)
    assert plan.count == 4
    [(indices, values)] = rgc.decode(plan.message, 1, torch.float32, quantized=True)
    assert indices.tolist() == [4, 5, 6, 7] and values[0] == -6.5


def test_quantized_threshold_search_keeps_the_invariant():
    n = 100_000
    comp = sparse(ratio=0.001, selection="threshold", quantize=True)
    total_grad = torch.zeros(n, dtype=torch.float64)
    total_sent = torch.zeros(n, dtype=torch.float64)
    for step in range(12):
        grad = torch.randn(n, generator=gen(step), dtype=torch.float64)
        total_grad += grad
        plan = comp.prepare("w", grad, 1)
        assert 100 <= plan.count <= 200
        total_sent += sent_dense(plan.message, n, torch.float64, True)
    torch.testing.assert_close(total_sent + comp.residual("w"), total_grad, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------
# Momentum correction, dense steps, clipping


@pytest.mark.parametrize("nesterov", [False, True])
def test_dense_momentum_steps_are_momentum_sgd(nesterov):
    ranks, m, lr, shape = 2, 0.9, 0.1, (5, 3)
    comps = [RGCCompressor(momentum=m, nesterov=nesterov, warmup_steps=100, min_size=0) for _ in range(ranks)]
    start = torch.randn(shape, generator=gen(0), dtype=torch.float64)
    ours = torch.nn.Parameter(start.clone())
    theirs = torch.nn.Parameter(start.clone())
    plain = torch.optim.SGD([ours], lr=lr, momentum=0)
    reference = torch.optim.SGD([theirs], lr=lr, momentum=m, nesterov=nesterov)
    for comp in comps:
        comp.check_optimizer(plain)
    for step in range(8):
        grads = [torch.randn(shape, generator=gen(100 * step + r), dtype=torch.float64) for r in range(ranks)]
        plans = [comp.prepare("w", grad, ranks) for comp, grad in zip(comps, grads)]
        assert all(plan.dense and plan.tensor.shape == shape for plan in plans)
        ours.grad = sum(plan.tensor for plan in plans) / ranks
        theirs.grad = sum(grads) / ranks
        plain.step()
        reference.step()
        torch.testing.assert_close(ours.data, theirs.data, rtol=1e-12, atol=1e-12)


def test_dense_plan_does_not_alias_the_momentum_buffer():
    comp = RGCCompressor(momentum=0.5, min_size=100)
    plan = comp.prepare("b", torch.ones(4), 1)
    plan.tensor.mul_(0)  # a caller reducing in place
    assert torch.equal(comp.momentum_buffer("b"), torch.ones(4))


def test_check_optimizer():
    param = torch.nn.Parameter(torch.zeros(2))
    heavy = torch.optim.SGD([{"params": [param], "momentum": 0.9}], lr=0.1)
    with pytest.raises(ValueError, match=r"param group 0.*momentum=0.9.*set momentum=0 in the optimizer"):
        RGCCompressor(momentum=0.9).check_optimizer(heavy)
    with pytest.raises(ValueError, match="param group 0"):
        rgc.check_optimizer(heavy, 0.9)
    RGCCompressor().check_optimizer(heavy)  # no momentum correction: nothing to clash
    RGCCompressor(momentum=0.9).check_optimizer(torch.optim.SGD([param], lr=0.1))
    RGCCompressor(momentum=0.9).check_optimizer(torch.optim.Adam([param]))


def test_clipping_scales_to_the_local_norm():
    grad = torch.full((16,), 1.0, dtype=torch.float64)  # norm 4
    comp = RGCCompressor(clip_norm=2.0, min_size=1000)
    plan = comp.prepare("b", grad, 4)  # local limit 2 / sqrt(4) = 1
    torch.testing.assert_close(plan.tensor, grad / 4, rtol=1e-15, atol=0)
    small = torch.full((16,), 0.01, dtype=torch.float64)
    assert torch.equal(comp.prepare("b", small, 4).tensor, small)
    assert torch.equal(comp.prepare("b", torch.zeros(16), 4).tensor, torch.zeros(16))
    sparse_plan = sparse(ratio=1.0, clip_norm=2.0).prepare("w", grad, 1)
    torch.testing.assert_close(sent_dense(sparse_plan.message, 16, torch.float64), grad / 2, rtol=1e-15, atol=0)


def test_dense_decisions_by_size_and_warmup():
    comps = [RGCCompressor(ratio=0.01, warmup_steps=3, min_size=500) for _ in range(2)]
    for step in range(6):
        for rank, comp in enumerate(comps):
            small = dyadic(499, seed=step + 10 * rank)
            big = dyadic((10, 50), seed=step + 10 * rank + 1)
            small_plan, big_plan = comp.prepare("bias", small, 2), comp.prepare("weight", big, 2)
            assert small_plan.dense and torch.equal(small_plan.tensor, small) and small_plan.message is None
            assert big_plan.dense == (step < 3)
            if big_plan.dense:
                assert torch.equal(big_plan.tensor, big) and big_plan.tensor.shape == (10, 50)
                assert torch.equal(comp.residual("weight"), torch.zeros(10, 50))
            else:
                assert big_plan.tensor is None and big_plan.count == 5
    assert torch.equal(comps[0].residual("bias"), torch.zeros(499))
    assert rgc.DEFAULT_MIN_SIZE == RGCCompressor().min_size == 32768


# ---------------------------------------------------------------------------------------
# Errors, dtypes and sizes


@pytest.mark.parametrize("kwargs,argument", [
    ({"ratio": 0}, "ratio"), ({"ratio": 1.5}, "ratio"), ({"ratio": True}, "ratio"), ({"ratio": "0.1"}, "ratio"),
    ({"selection": "fast"}, "selection"), ({"quantize": "yes"}, "quantize"),
    ({"quantize": True, "selection": "sampled"}, "sampled"), ({"momentum": 1.0}, "momentum"),
    ({"momentum": -0.1}, "momentum"), ({"nesterov": True}, "nesterov"), ({"warmup_steps": -1}, "warmup_steps"),
    ({"warmup_steps": 1.5}, "warmup_steps"), ({"min_size": -1}, "min_size"), ({"clip_norm": 0}, "clip_norm"),
    ({"clip_norm": math.inf}, "clip_norm"),
])
def test_bad_arguments_are_refused_by_name(kwargs, argument):
    with pytest.raises(ValueError, match=argument):
        RGCCompressor(**kwargs)


def test_bad_prepare_arguments():
    comp = sparse()
    with pytest.raises(ValueError, match="world_size"):
        comp.prepare("w", torch.zeros(4), 0)
    with pytest.raises(TypeError, match="floating-point"):
        comp.prepare("w", torch.zeros(4, dtype=torch.int64), 1)
    comp.prepare("w", torch.zeros(4), 1)
    with pytest.raises(ValueError, match="changed from shape"):
        comp.prepare("w", torch.zeros(5), 1)
    with pytest.raises(ValueError, match="ratio"):
        TopKCompressor(ratio=2)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("dense", [False, True])
def test_non_finite_gradients_raise_naming_the_parameter(bad, dense):
    comp = RGCCompressor(ratio=0.1, min_size=1000 if dense else 0, momentum=0.9)
    comp.prepare("fc.weight", torch.ones(100), 1)
    momentum, residual = comp.momentum_buffer("fc.weight"), comp.residual("fc.weight")
    grad = torch.ones(100)
    grad[17] = bad
    with pytest.raises(ValueError, match="fc.weight"):
        comp.prepare("fc.weight", grad, 1)
    assert torch.equal(comp.momentum_buffer("fc.weight"), momentum)  # left unchanged
    assert torch.equal(comp.residual("fc.weight"), residual)
    with pytest.raises(ValueError, match="fc.weight"):
        TopKCompressor(ratio=0.1, min_size=1000 if dense else 0).prepare("fc.weight", grad, 1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_dtypes_round_trip(dtype):
    n, ranks = 3000, 2
    comps = [sparse(ratio=0.01) for _ in range(ranks)]
    grads = [dyadic(n, seed=r, dtype=dtype) for r in range(ranks)]
    plans = [comp.prepare("w", grad, ranks) for comp, grad in zip(comps, grads)]
    result = comps[0].combine("w", torch.cat([plan.message for plan in plans]), ranks)
    assert result.dtype == dtype and result.shape == (n,)
    expected = sum(sent_dense(plan.message, n, dtype) for plan in plans) / ranks
    assert torch.equal(result, expected.to(dtype))
    assert comps[0].residual("w").dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    dense = RGCCompressor(min_size=10_000, momentum=0.9).prepare("w", grads[0], ranks)
    assert dense.tensor.dtype == dtype and torch.equal(dense.tensor, grads[0])


def test_tiny_tensors():
    everything = sparse(ratio=1.0, selection="exact")
    grad = torch.tensor([[1.0, -2.0], [3.0, 0.0]])
    plan = everything.prepare("w", grad, 1)
    assert plan.count == 4 and torch.equal(everything.residual("w"), torch.zeros(2, 2))
    assert torch.equal(everything.combine("w", plan.message, 1), grad)
    for n in (1, 10):  # ratio * numel < 1: k is 1
        comp = sparse(ratio=0.001)
        assert comp.prepare("w", torch.arange(n, dtype=torch.float32) + 1, 1).count == 1
    empty = sparse(ratio=0.5)
    plan = empty.prepare("e", torch.zeros(0, 3), 2)
    assert plan.count == 0 and plan.message.numel() == 4
    assert empty.combine("e", torch.cat([plan.message, plan.message]), 2).shape == (0, 3)


def test_tensors_too_large_for_int32_indices_are_refused():
    huge = torch.zeros(1).expand(2**31)  # no memory behind it
    with pytest.raises(ValueError, match="int32"):
        sparse().prepare("embedding", huge, 1)


# ---------------------------------------------------------------------------------------
# The top-k baseline


def test_topk_drops_what_it_does_not_send():
    n, ranks = 1000, 2
    comps = [TopKCompressor(ratio=0.005, selection="exact", min_size=0) for _ in range(ranks)]
    for step in range(3):
        grads = [torch.randn(n, generator=gen(10 * step + r), dtype=torch.float64) for r in range(ranks)]
        plans = [comp.prepare("w", grad, ranks) for comp, grad in zip(comps, grads)]
        expected = torch.zeros(n, dtype=torch.float64)
        for grad, plan in zip(grads, plans):
            top = grad.abs().topk(5).indices  # from this step's gradient alone: no memory
            expected[top] += grad[top]
            assert plan.count == 5
        result = comps[1].combine("w", torch.cat([plan.message for plan in plans]), ranks)
        torch.testing.assert_close(result, expected / ranks, rtol=0, atol=0)
    assert not hasattr(comps[0], "residual")
    small = TopKCompressor().prepare("bias", torch.ones(10), 2)
    assert small.dense and torch.equal(small.tensor, torch.ones(10))


def test_reset_forgets_state():
    comp = sparse(ratio=0.01, warmup_steps=1)
    comp.prepare("w", torch.randn(100, generator=gen(0)), 1)
    comp.prepare("w", torch.randn(100, generator=gen(1)), 1)
    assert comp.residual("w").abs().sum() > 0
    comp.reset()
    with pytest.raises(KeyError):
        comp.residual("w")
    assert comp.prepare("w", torch.randn(100), 1).dense  # warm-up starts over
    assert isinstance(Plan(dense=True), Plan)


def test_mode_is_sparse_or_auto():
    assert RGCCompressor().mode == "sparse" and TopKCompressor(mode="auto").mode == "auto"
    with pytest.raises(ValueError, match="mode must be one of 'sparse', 'auto'"):
        RGCCompressor(mode="dense")


# ---------------------------------------------------------------------------------------
# Checkpoints


def _saved_and_loaded(state_dict):
    """``state_dict`` through torch.save and torch.load(weights_only=True), as a checkpoint goes."""
    import io

    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("options", [dict(ratio=0.05, momentum=0.9, selection="threshold"),
                                     dict(ratio=0.05, quantize=True, selection="trimmed"),
                                     dict(ratio=0.05, nesterov=True, momentum=0.5, warmup_steps=2)])
def test_a_loaded_state_continues_exactly_as_the_saved_compressor_would(options):
    gradients = [(name, torch.randn(shape, generator=gen(seed))) for seed in range(6)
                 for name, shape in (("w", (40, 5)), ("b", (300,)))]
    original = sparse(**options)
    for name, grad in gradients[:6]:
        original.prepare(name, grad, 2)
    saved = _saved_and_loaded(original.state_dict())
    resumed = sparse(**options)
    resumed.load_state_dict(saved)
    for name, grad in gradients[6:]:
        expected, got = original.prepare(name, grad, 2), resumed.prepare(name, grad, 2)
        assert expected.dense == got.dense
        if expected.dense:
            assert torch.equal(expected.tensor, got.tensor)
        else:
            assert torch.equal(expected.message, got.message) and expected.count == got.count
    for name in ("w", "b"):
        assert torch.equal(original.residual(name), resumed.residual(name))


def test_without_the_loaded_state_the_residuals_are_lost():
    comp = sparse(ratio=0.01)
    comp.prepare("w", dyadic(1000, 0), 1)
    saved = comp.state_dict()
    assert saved["tensors"]["w"]["residual"].abs().sum() > 0
    comp.prepare("w", dyadic(1000, 1), 1)  # the saved state is a copy, not a view
    assert not torch.equal(saved["tensors"]["w"]["residual"], comp.residual("w").reshape(-1))
    fresh = sparse(ratio=0.01)
    fresh.load_state_dict(saved)
    assert torch.equal(fresh.residual("w").reshape(-1), saved["tensors"]["w"]["residual"])
    fresh.load_state_dict(sparse(ratio=0.01).state_dict())  # loading replaces, it does not merge
    with pytest.raises(KeyError):
        fresh.residual("w")


def test_k_follows_the_loading_compressors_ratio():
    comp = sparse(ratio=0.01)
    comp.prepare("w", dyadic(1000, 0), 1)
    other = sparse(ratio=0.1)
    other.load_state_dict(comp.state_dict())
    plan = other.prepare("w", dyadic(1000, 1), 1)
    assert plan.count == 100


def test_topk_state_round_trips():
    comp = TopKCompressor(ratio=0.01, min_size=0, selection="threshold")
    comp.prepare("w", dyadic(1000, 0), 1)
    loaded = TopKCompressor(ratio=0.01, min_size=0, selection="threshold")
    loaded.load_state_dict(_saved_and_loaded(comp.state_dict()))
    assert loaded.state_dict()["tensors"]["w"]["calls"] == 1
    grad = dyadic(1000, 1)
    assert torch.equal(comp.prepare("w", grad, 1).message, loaded.prepare("w", grad, 1).message)


@pytest.mark.parametrize("corrupt,field", [
    (lambda d: d.pop("format"), "format="),
    (lambda d: d["tensors"]["w"].update(shape="ten"), "shape must be a list of sizes"),
    (lambda d: d["tensors"]["w"].update(dtype="float99"), "dtype must be the name of a torch dtype"),
    (lambda d: d["tensors"]["w"].update(calls=-1), "calls must be an integer >= 0"),
    (lambda d: d["tensors"]["w"].update(residual=torch.zeros(7)), "residual must be None or a 1-D torch.float32"),
    (lambda d: d["tensors"]["w"].update(thresholds=[]), "thresholds must be two dicts"),
])
def test_a_bad_state_dict_is_refused_naming_the_field(corrupt, field):
    comp = sparse(ratio=0.01)
    comp.prepare("w", dyadic(1000, 0), 1)
    state = comp.state_dict()
    corrupt(state)
    with pytest.raises(ValueError, match=field):
        sparse(ratio=0.01).load_state_dict(state)
    with pytest.raises(ValueError, match="what state_dict\\(\\) of a compressor returned"):
        sparse().load_state_dict({"state": {}, "param_groups": []})  # an optimizer's, say
