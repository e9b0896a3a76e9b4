"""Compression on the device (issue 31, part 5): the codecs, RGC's selections and compressor
steps give on a device what the host path gives for the same input.

Every test runs twice. On "cuda" (marked ``cuda``; skipped with the reason where no GPU is
usable) the tensors live on the GPU and take the device path naturally. On "cpu" the
device path is forced onto CPU tensors (``devices.HOST_DEVICE_TYPES`` emptied inside
``device_path``), so that CI checks the device path's logic without a GPU. The reference is
always the host path on CPU tensors.

The properties, exactly:

- codecs (fp16, int8 = dynamic tree, linear8): the same codes, the same absmax values and
  bit-identical decoded tensors as the host, on the input's device; the same mean relative
  error on N(0, 1);
- threshold binary search: the same index set as the host for these seeded inputs (they
  hold no element within rounding of a searched threshold), k to 2k of them, every selected
  magnitude >= every unselected one; a reuse returns the same set;
- trimmed top-k: exactly the k indices of the host (the exact top-k);
- sampled search: k to 2k(1 + slack) indices, every selected magnitude >= every unselected
  one (the sample comes from the device's random stream, so the set may differ);
- RGC and top-k compressor steps: the same indices in every message, and values, residuals,
  momenta and combined gradients bit-identical where the arithmetic is elementwise, equal to
  float32 rounding where a device reduction sums in another order (the norm of ``clip_norm``,
  the mean of quantized RGC); the host's errors, with the state unchanged.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import pathlib
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

from ringmaster.worker.compression import device_selection, devices, fused_scan
from ringmaster.worker.compression import quantization as q
from ringmaster.worker.compression import selection as sel
from ringmaster.worker.compression.compressors import Compression
from ringmaster.worker.compression.rgc import RGCCompressor, TopKCompressor
from ringmaster.worker.compression.rgc_messages import decode, encode

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
CODECS = {"fp16": Compression.fp16, "int8": Compression.int8, "linear8": Compression.linear8}
BENCH = pathlib.Path(__file__).resolve().parent.parent / "bench" / "gpu" / "codecs.py"


#: "triton": CPU tensors on the device path with its kernels (``fused_scan``,
#: ``fused_codecs``) run by Triton's interpreter, where Triton is installed and no GPU is (on a GPU, "cuda" runs it).
DEVICE_PATHS = DEVICES + [pytest.param("triton", marks=pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or torch.cuda.is_available(),
    reason="Triton's interpreter: Triton is not installed, or a GPU runs the kernel itself"))]


def where(device: str) -> str:
    """The torch device of a test's ``device`` ("triton" runs on CPU tensors)."""
    return "cpu" if device == "triton" else device


@contextlib.contextmanager
def device_path(device: str):
    """Inside: tensors on ``device`` take compression's device path (on "cpu" and
    "triton" by force; "triton" with the fused pass interpreted)."""
    if device not in ("cpu", "triton"):
        yield
        return
    saved = devices.HOST_DEVICE_TYPES, fused_scan.ALLOW_HOST, os.environ.get("TRITON_INTERPRET")
    devices.HOST_DEVICE_TYPES = frozenset()
    if device == "triton":
        os.environ["TRITON_INTERPRET"] = "1"  # read when a kernel is first made (then cached)
        fused_scan.ALLOW_HOST = True
    try:
        yield
    finally:
        devices.HOST_DEVICE_TYPES, fused_scan.ALLOW_HOST, interpret = saved
        if interpret is None:
            os.environ.pop("TRITON_INTERPRET", None)


def randn(n: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale


def assert_top_set(values: torch.Tensor, indices: torch.Tensor, low: int, high: int) -> None:
    """``low`` to ``high`` ascending distinct indices, none of whose magnitudes is below an
    unselected one."""
    values, indices = values.cpu(), indices.cpu()
    assert indices.dtype == torch.int64 and low <= indices.numel() <= high, (indices.numel(), low, high)
    assert bool((indices[1:] > indices[:-1]).all())
    chosen = torch.zeros(values.numel(), dtype=torch.bool)
    chosen[indices] = True
    magnitudes = values.abs()
    if chosen.any() and (~chosen).any():
        assert magnitudes[chosen].min() >= magnitudes[~chosen].max()


# ---------------------------------------------------------------------------------------
# Codecs


@pytest.mark.parametrize("device", DEVICE_PATHS)
@pytest.mark.parametrize("name", CODECS)
def test_codec_gives_the_host_codes_and_values(device, name):
    codec = CODECS[name]
    x = randn(300_000 + 77, seed=5)  # a partial last block of 4096
    codes, ctx = codec.compress(x)
    decoded = codec.decompress(codes, ctx)
    with device_path(device):
        device_codes, device_ctx = codec.compress(x.to(where(device)))
        device_decoded = codec.decompress(device_codes, device_ctx)
    assert device_codes.device.type == device_decoded.device.type == where(device)
    assert device_codes.dtype == codes.dtype and torch.equal(device_codes.cpu(), codes)
    if name == "fp16":
        assert device_ctx == ctx
    else:
        assert device_ctx[0].device.type == where(device) and torch.equal(device_ctx[0].cpu(), ctx[0])
    assert device_decoded.dtype == x.dtype and torch.equal(device_decoded.cpu(), decoded)


@pytest.mark.parametrize("device", DEVICE_PATHS)
@pytest.mark.parametrize("kind", ["dynamic tree", "linear8"])
def test_one_absmax_encoders_and_packing_match_the_host(device, kind):
    encode_, decode_ = {"dynamic tree": (q.encode_dynamic_tree, q.decode_dynamic_tree),
                        "linear8": (q.encode_linear8, q.decode_linear8)}[kind]
    x = randn(100_000, seed=13)
    codes, absmax = encode_(x)
    with device_path(device):
        device_codes, device_absmax = encode_(x.to(where(device)))
        device_decoded = decode_(device_codes, device_absmax)
        packed = q.pack(device_codes, device_absmax)
        unpacked_codes, unpacked_absmax = q.unpack(packed, x.numel())
    assert device_codes.device.type == device_absmax.device.type == packed.device.type == where(device)
    assert torch.equal(device_codes.cpu(), codes) and device_absmax.cpu() == absmax
    assert torch.equal(device_decoded.cpu(), decode_(codes, absmax))
    assert torch.equal(packed.cpu(), q.pack(codes, absmax))
    assert torch.equal(unpacked_codes.cpu(), codes) and unpacked_absmax.cpu() == absmax


@pytest.mark.parametrize("device", DEVICE_PATHS)
@pytest.mark.parametrize("name,bound", [("fp16", 0.001), ("int8", 0.025), ("linear8", 0.065)])
def test_mean_relative_error_on_normal_data_is_the_hosts(device, name, bound):
    """Dettmers' measure (|x| > 1e-3): dynamic tree under 2.5 %, linear8 under 6.5 %."""
    codec = CODECS[name]
    x = randn(1 << 20, seed=21)

    def error(decoded):
        x64, kept = x.double(), x.abs() > 1e-3
        return float(((decoded.cpu().double() - x64).abs() / x64.abs())[kept].mean())

    host = error(codec.decompress(*codec.compress(x)))
    with device_path(device):
        on_device = error(codec.decompress(*codec.compress(x.to(where(device)))))
    assert on_device == host and host < bound


@pytest.mark.parametrize("device", DEVICE_PATHS)
def test_code_tables_are_made_once_per_device(device):
    place = torch.empty(0, device=where(device)).device
    for kind in ("dynamic tree", "linear8"):
        tables = q._tables(kind, place)
        assert all(table.device == place for table in tables)
        assert q._tables(kind, place) is tables


@pytest.mark.parametrize("device", DEVICE_PATHS)
def test_non_finite_blocks_decode_to_non_finite_values_on_the_device(device):
    """On a device the encoders do not read a finiteness flag back unless asked: a block with
    NaN or Inf decodes to NaN/Inf entirely, the other blocks as on the host."""
    x = randn(3 * q.BLOCK_ELEMENTS, seed=2)
    bad = x.clone()
    bad[q.BLOCK_ELEMENTS + 7] = float("inf")
    with device_path(device):
        decoded = Compression.int8.decompress(*Compression.int8.compress(bad.to(where(device)))).cpu()
        with pytest.raises(ValueError, match="1 non-finite element"):
            q.encode_blocks(bad.to(where(device)), "dynamic tree", check_finite=True)
        with pytest.raises(ValueError, match="non-finite"):
            q.encode_linear8(bad.to(where(device)), check_finite=True)
    middle = slice(q.BLOCK_ELEMENTS, 2 * q.BLOCK_ELEMENTS)
    assert not bool(torch.isfinite(decoded[middle]).any())
    expected = Compression.int8.decompress(*Compression.int8.compress(x))
    assert torch.equal(decoded[:q.BLOCK_ELEMENTS], expected[:q.BLOCK_ELEMENTS])
    assert torch.equal(decoded[2 * q.BLOCK_ELEMENTS:], expected[2 * q.BLOCK_ELEMENTS:])


@pytest.mark.parametrize("device", DEVICE_PATHS)
@pytest.mark.parametrize("kind", ["dynamic tree", "linear8"])
def test_ring_codec_takes_device_tensors(device, kind):
    codec = q.RingCodec(kind)
    values = randn(10_000, seed=4).numpy()
    host_out, host_decoded = np.empty(codec.encoded_bytes(values.size), np.uint8), np.empty_like(values)
    codec.encode(values, host_out)
    codec.decode(host_out, host_decoded, add=values)
    with device_path(device):
        source = torch.from_numpy(values).to(where(device))
        out = torch.empty(codec.encoded_bytes(values.size), dtype=torch.uint8, device=where(device))
        decoded = torch.empty_like(source)
        codec.encode(source, out)
        codec.decode(out, decoded, add=source)
    assert np.array_equal(out.cpu().numpy(), host_out) and np.array_equal(decoded.cpu().numpy(), host_decoded)


@pytest.mark.parametrize("device", DEVICE_PATHS)
def test_ring_codec_whole_chunks_on_the_device_give_the_hosts_bytes(device):
    codec, block = q.RingCodec("dynamic tree"), 1000
    values = randn(10_500, seed=5)
    host = torch.empty(11 * q.HEADER_BYTES + 10_500, dtype=torch.uint8)
    host_decoded = torch.empty(10_500)
    codec.encode_blocks(values, host, block)
    codec.decode_blocks(host, host_decoded, block, add=values)
    with device_path(device):
        source = values.to(where(device))
        out = torch.empty_like(host, device=where(device))
        decoded = torch.empty_like(source)
        codec.encode_blocks(source, out, block)
        codec.decode_blocks(out, decoded, block, add=source)
    assert torch.equal(out.cpu(), host) and torch.equal(decoded.cpu(), host_decoded)


# ---------------------------------------------------------------------------------------
# Selection


FUSED_DEVICES = [pytest.param("cuda", marks=pytest.mark.cuda), DEVICE_PATHS[-1]]


@pytest.mark.parametrize("device", FUSED_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("n,cap", [(1, 4), (4095, 100), (100_003, 10_000), (100_003, 20)])
def test_fused_scan_finds_what_torch_finds(device, dtype, n, cap):
    """Every entry over the threshold (compared in the values' dtype), at most ``cap`` kept,
    the true total, the sum of magnitudes to float32 rounding, the exact maximum."""
    values = randn(n, seed=n).to(dtype)
    threshold = torch.tensor(1.7, dtype=torch.float64)
    with device_path(device):
        assert fused_scan.usable(values.to(where(device)))
        found = fused_scan.scan(values.to(where(device)), threshold.to(where(device)), cap)
    above = torch.nonzero(values.abs() > threshold.to(dtype)).view(-1)
    kept = int(found.kept(cap))
    assert int(found.total) == above.numel() and kept == min(cap, above.numel())
    assert found.indices.numel() == cap and bool((found.indices[kept:] == -1).all())
    stored = found.indices[:kept].cpu().to(torch.int64).sort().values
    if kept == above.numel():
        assert torch.equal(stored, above)
    else:
        assert bool(torch.isin(stored, above).all()) and stored.unique().numel() == kept
    assert float(found.biggest) == float(values.abs().max())
    assert math.isclose(float(found.total_magnitude), float(values.abs().double().sum()), rel_tol=1e-5)


@pytest.mark.parametrize("device", FUSED_DEVICES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_fused_scan_maximum_is_infinite_iff_a_value_is_not_finite(device, bad):
    values = randn(10_000, seed=3)
    values[4321] = bad
    with device_path(device):
        found = fused_scan.scan(values.to(where(device)), torch.tensor(1.0, device=where(device)), 10)
    assert math.isinf(float(found.biggest))


@pytest.mark.parametrize("device", DEVICE_PATHS)
@pytest.mark.parametrize("dist,ratio", [("normal", 0.001), ("normal", 0.01), ("uniform", 0.001)])
def test_threshold_search_selects_the_hosts_set(device, dist, ratio):
    n = 1 << 20
    values = randn(n, seed=31) if dist == "normal" else torch.rand(n, generator=torch.Generator().manual_seed(31)) - 0.5
    k = math.ceil(ratio * n)
    host, host_state = sel.threshold_binary_search(values, k)
    with device_path(device):
        on_device = values.to(where(device))
        indices, state = sel.threshold_binary_search(on_device, k)
        again, state = sel.threshold_binary_search(on_device, k, state)
    assert indices.device.type == where(device)
    assert torch.equal(indices.cpu(), host)
    assert_top_set(values, indices, k, 2 * k)
    assert state.searches == 1 and state.reuses == 1 and torch.equal(again, indices)
    assert math.isclose(float(state.threshold), host_state.threshold, rel_tol=1e-6)


@pytest.mark.parametrize("device", FUSED_DEVICES)
def test_threshold_search_with_fused_candidates_selects_the_hosts_set(device, monkeypatch):
    """The search's candidates made by ``fused_scan`` (off by default, see SEARCH_FUSED)."""
    monkeypatch.setattr(device_selection, "SEARCH_FUSED", True)
    values = randn(1 << 20, seed=31)
    k = math.ceil(0.001 * values.numel())
    host, _ = sel.threshold_binary_search(values, k)
    with device_path(device):
        indices, state = sel.threshold_binary_search(values.to(where(device)), k)
    assert indices.device.type == where(device) and indices.dtype == torch.int64
    assert torch.equal(indices.cpu(), host) and state.threshold is not None


@pytest.mark.parametrize("device", DEVICE_PATHS)
@pytest.mark.parametrize("n", [100_000, 1 << 20, 1 << 22])
def test_trimmed_topk_is_the_exact_top_k(device, n):
    values = randn(n, seed=n)
    k = math.ceil(0.001 * n)
    host = sel.trimmed_topk(values, k)
    with device_path(device):
        indices = sel.trimmed_topk(values.to(where(device)), k)
    assert indices.device.type == where(device) and torch.equal(indices.cpu(), host)
    assert_top_set(values, indices, k, k)


@pytest.mark.parametrize("device", DEVICE_PATHS)
def test_sampled_search_keeps_its_promise(device):
    n = 1 << 22
    values = randn(n, seed=9)
    k = math.ceil(0.001 * n)
    with device_path(device):
        generator = torch.Generator(device=where(device)).manual_seed(0)
        indices = sel.sampled_threshold_search(values.to(where(device)), k, generator=generator)
    assert indices.device.type == where(device)
    assert_top_set(values, indices, k, math.floor(2 * k * 1.25))


@pytest.mark.parametrize("device", DEVICE_PATHS)
@pytest.mark.parametrize("method", ["exact", "trimmed", "threshold", "sampled"])
def test_selection_edge_cases_as_on_the_host(device, method):
    select = {"exact": sel.topk_exact, "trimmed": sel.trimmed_topk, "sampled": sel.sampled_threshold_search,
              "threshold": lambda v, k: sel.threshold_binary_search(v, k)[0]}[method]
    zeros, equal = torch.zeros(50_000), torch.full((50_000,), -2.0)
    few = torch.zeros(50_000)
    few[::1000] = torch.arange(1, 51, dtype=torch.float32)
    nan = randn(50_000, seed=1)
    nan[123] = float("nan")
    with device_path(device):
        for values, k in ((zeros, 100), (equal, 100), (few, 30), (few, 70), (zeros, 0), (equal, 50_000)):
            indices = select(values.to(where(device)), k)
            high = k if method in ("exact", "trimmed") else math.floor(2 * k * 1.25)
            assert_top_set(values, indices, min(k, values.numel()), max(high, min(k, values.numel())))
        assert torch.equal(sel.trimmed_topk(zeros.to(where(device)), 100).cpu(), torch.arange(100))
        with pytest.raises(ValueError, match="NaN or infinity"):
            select(nan.to(where(device)), 10)


# ---------------------------------------------------------------------------------------
# Residual gradient compression


RGC_OPTIONS = [dict(selection="threshold"), dict(selection="trimmed", momentum=0.9),
               dict(selection="exact", momentum=0.9, nesterov=True, clip_norm=1.0),
               dict(selection="threshold", quantize=True), dict(selection="trimmed", quantize=True, momentum=0.5),
               dict(selection="auto", warmup_steps=1)]


def assert_equal_or_rounded(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal up to float32 rounding of a sum taken in another order (values here are O(1)
    to O(10): a rounding of the quantized mean moves a residual entry by a few 1e-6)."""
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def assert_same_message(actual: torch.Tensor, expected: torch.Tensor, quantized: bool) -> None:
    """The same indices, and values equal up to float32 rounding."""
    (indices, values), = decode(actual, 1, torch.float32, quantized=quantized)
    (expected_indices, expected_values), = decode(expected, 1, torch.float32, quantized=quantized)
    assert torch.equal(indices, expected_indices)
    assert_equal_or_rounded(values, expected_values)


def gradients(steps: int, shape=(256, 1024), seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) * (1 + step) for step in range(steps)]


@pytest.mark.parametrize("device", DEVICE_PATHS)
@pytest.mark.parametrize("options", RGC_OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_rgc_steps_match_the_host(device, options):
    host, on_device = (RGCCompressor(ratio=0.01, min_size=1000, **options) for _ in range(2))
    bias = torch.randn(100)  # under min_size: dense
    for step, grad in enumerate(gradients(5)):
        for name, tensor in (("w", grad), ("b", bias * step)):
            expected = host.prepare(name, tensor, 2)
            with device_path(device):
                plan = on_device.prepare(name, tensor.to(where(device)), 2)
            assert plan.dense == expected.dense and plan.count == expected.count
            if plan.dense:
                assert plan.tensor.device.type == where(device)
                assert_equal_or_rounded(plan.tensor.cpu(), expected.tensor)
                continue
            assert plan.message.device.type == where(device)
            assert_same_message(plan.message.cpu(), expected.message, bool(options.get("quantize")))
            with device_path(device):
                combined = on_device.combine(name, plan.message.repeat(2), 2)
            assert combined.device.type == where(device)
            assert_equal_or_rounded(combined.cpu(), host.combine(name, expected.message.repeat(2), 2))
        assert_equal_or_rounded(on_device.residual("w").cpu(), host.residual("w"))
        if options.get("momentum"):
            assert_equal_or_rounded(on_device.momentum_buffer("w").cpu(), host.momentum_buffer("w"))


@pytest.mark.parametrize("device", DEVICE_PATHS)
@pytest.mark.parametrize("quantize", [False, True])
@pytest.mark.parametrize("bad", [float("nan"), float("-inf")])
def test_non_finite_gradient_is_refused_and_leaves_the_state(device, quantize, bad):
    compressor = RGCCompressor(ratio=0.01, min_size=1000, selection="threshold", quantize=quantize, momentum=0.9)
    good, broken = gradients(2)
    broken = broken.clone()
    broken[3, 5] = bad
    with device_path(device):
        compressor.prepare("w", good.to(where(device)), 2)
        residual, momentum = compressor.residual("w"), compressor.momentum_buffer("w")
        with pytest.raises(ValueError, match=r"gradient of 'w' contains NaN or infinity"):
            compressor.prepare("w", broken.to(where(device)), 2)
    state = compressor._states["w"]
    assert state.calls == 1 and state.sparse_steps == 1
    assert torch.equal(compressor.residual("w"), residual) and torch.equal(compressor.momentum_buffer("w"), momentum)


@pytest.mark.parametrize("device", DEVICE_PATHS)
@pytest.mark.parametrize("selection", ["exact", "trimmed", "threshold"])
def test_topk_compressor_matches_the_host(device, selection):
    host, on_device = (TopKCompressor(ratio=0.001, min_size=0, selection=selection) for _ in range(2))
    for grad in gradients(3, shape=(1 << 20,), seed=3):
        expected = host.prepare("g", grad, 4)
        with device_path(device):
            plan = on_device.prepare("g", grad.to(where(device)), 4)
        assert torch.equal(plan.message.cpu(), expected.message)
    broken = torch.zeros(1 << 20)
    broken[9] = float("nan")
    with device_path(device), pytest.raises(ValueError, match="gradient of 'g' contains NaN"):
        on_device.prepare("g", broken.to(where(device)), 4)
    assert on_device._states["g"].calls == 3


@pytest.mark.parametrize("device", DEVICE_PATHS)
@pytest.mark.parametrize("dtype,quantized", [(torch.float16, False), (torch.float32, True), (torch.float64, False)])
def test_messages_decode_on_the_device_as_on_the_host(device, dtype, quantized):
    messages = []
    for count in (3, 0, 5, 1):  # odd counts of 16-bit values leave the next message misaligned
        carried = min(count, 1) if quantized else count
        messages.append(encode(torch.arange(count) * 7, torch.arange(1, carried + 1).to(dtype)))
    buffer = torch.cat(messages)
    expected = decode(buffer, 4, dtype, quantized=quantized, numel=100)
    with device_path(device):
        parts = decode(buffer.to(where(device)), 4, dtype, quantized=quantized, numel=100)
        for broken, world, error in ((buffer[:-1], 4, "ends after"), (buffer, 3, "left over"),
                                     (buffer, 5, "ends before")):
            with pytest.raises(RuntimeError, match=error):
                decode(broken.to(where(device)), world, dtype, quantized=quantized, numel=100)
        with pytest.raises(RuntimeError, match="announces 3 indices for a tensor of 2"):
            decode(buffer.to(where(device)), 4, dtype, quantized=quantized, numel=2)
    for (indices, values), (host_indices, host_values) in zip(parts, expected):
        assert indices.device.type == values.device.type == where(device)
        assert torch.equal(indices.cpu(), host_indices) and torch.equal(values.cpu(), host_values)


@pytest.mark.parametrize("device", DEVICE_PATHS)
def test_combine_refuses_indices_out_of_range_on_the_device(device):
    compressor = RGCCompressor(ratio=0.01, min_size=0, selection="exact")
    with device_path(device):
        message = compressor.prepare("w", randn(2000, seed=1).to(where(device)), 1).message
        wrong = encode(torch.tensor([5, 2000]).to(where(device)), torch.ones(2, device=where(device)))
        with pytest.raises(RuntimeError, match=r"indices outside \[0, 2000\)"):
            compressor.combine("w", torch.cat([message, wrong]), 2)


# ---------------------------------------------------------------------------------------
# Reads back to the host (CUDA only: torch's sync debug mode counts them)


@contextlib.contextmanager
def synchronizations():
    """The synchronizing CUDA operations made inside, as torch's warnings."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        found = []
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode("default")
            found += [w for w in caught if "synchroniz" in str(w.message)]


def places_of_synchronizations(call) -> list[str]:
    """Where ``call()`` synchronizes (after a warm-up call that fills caches)."""
    call()
    with synchronizations() as found:
        call()
    return [f"{w.filename}:{w.lineno}" for w in found]


@pytest.mark.cuda
def test_the_device_path_reads_back_only_where_the_docs_say():
    n = 1 << 22
    values = randn(n, seed=1).cuda()
    k = math.ceil(0.001 * n)
    state = sel.ThresholdState()
    sel.threshold_binary_search(values, k, state)
    codes, ctx = Compression.int8.compress(values)

    def reuse():
        state.reuses_left = sel.REUSE_INTERVAL
        sel.threshold_binary_search(values, k, state)

    zero_reads = {"int8 compress": lambda: Compression.int8.compress(values),
                  "int8 decompress": lambda: Compression.int8.decompress(codes, ctx),
                  "linear8 compress": lambda: Compression.linear8.compress(values),
                  "fp16 compress": lambda: Compression.fp16.compress(values),
                  "message encode": lambda: encode(torch.arange(10, device="cuda"), torch.ones(10, device="cuda"))}
    one_read = {"threshold search": lambda: sel.threshold_binary_search(values, k),
                "threshold reuse": reuse,
                "trimmed top-k": lambda: sel.trimmed_topk(values, k),
                "sampled search": lambda: sel.sampled_threshold_search(values, k),
                "exact top-k (the finiteness check)": lambda: sel.topk_exact(values, k)}
    places_of_synchronizations(torch.cuda.synchronize)  # anything torch does once, on the first check
    places = {name: places_of_synchronizations(call) for name, call in {**zero_reads, **one_read}.items()}
    counts = {name: len(where) for name, where in places.items()}
    assert counts == {**dict.fromkeys(zero_reads, 0), **dict.fromkeys(one_read, 1)}, places

    # A first sparse step searches (a later one may reuse, or search again after a miss).
    grad = values.reshape(1024, -1)
    for options, expected in ((dict(selection="threshold", momentum=0.9), 1), (dict(selection="trimmed"), 1),
                              (dict(selection="threshold", quantize=True), 2)):
        RGCCompressor(ratio=0.001, min_size=1000, **options).prepare("w", grad, 2)  # warm-up
        compressor = RGCCompressor(ratio=0.001, min_size=1000, **options)
        with synchronizations() as found:
            plan = compressor.prepare("w", grad, 2)
        assert len(found) == expected, (options, [str(w.message) for w in found])
        with synchronizations() as found:  # the message counts, and the indices' range
            compressor.combine("w", plan.message.repeat(2), 2)
        assert len(found) == 2


# ---------------------------------------------------------------------------------------
# The benchmark


def test_codecs_benchmark_runs_on_cpu():
    result = subprocess.run([sys.executable, str(BENCH), "--device", "cpu", "--numel", "300000", "--reps", "1"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    for row in ("fp32->fp16 cast", "int8 encode", "int8 decode", "linear8 encode", "linear8 decode",
                "torch.topk", "threshold search", "threshold reuse", "trimmed top-k"):
        assert row in result.stdout, result.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where there is no CUDA device")
def test_codecs_benchmark_refuses_a_missing_cuda_device():
    device = "cuda"  # cuda-marker: not a device (its refusal where there is none)
    result = subprocess.run([sys.executable, str(BENCH), "--device", device, "--numel", "1000"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "no CUDA device" in result.stderr, result.stderr
