"""The 8-bit codecs of ringmaster.worker.compression.quantization: tables, rounding, error, edge cases,
wire format and compressors. Single process, no MPI, a few seconds in all."""

from __future__ import annotations

import struct

import pytest
import torch

from ringmaster.worker.compression import quantization as q
from ringmaster.worker.compression.compressors import Compressor

CODECS = {
    "dynamic tree": (q.encode_dynamic_tree, q.decode_dynamic_tree, q.dynamic_tree_values),
    "linear8": (q.encode_linear8, q.decode_linear8, q.linear8_values),
}
ALL_CODES = torch.arange(256, dtype=torch.uint8)


def reference_codes(normalized: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Binary search for the nearest magnitude, sign bit apart: the format's definition."""
    magnitude = q.nearest_codes(normalized.abs(), values).to(torch.uint8)
    return magnitude | (torch.signbit(normalized).to(torch.uint8) << 7)


def mean_relative_error(x: torch.Tensor, y: torch.Tensor, above: float = 1e-3) -> float:
    keep = x.abs() > above
    return float(((y[keep] - x[keep]).abs() / x[keep].abs()).mean())


def test_dynamic_tree_table():
    values = q.dynamic_tree_values()
    assert values.shape == (128,) and values.dtype == torch.float64
    assert bool((values[1:] > values[:-1]).all()), "strictly increasing: code order is value order"
    assert values[0] == 0 and values[127] == 1.0 and values[1] == pytest.approx(1e-6)
    # Code 2^k + j: n = 6 - k leading zeros, the flag, then k tree bits j (upper end of the leaf).
    for k in range(7):
        for j in range(2 ** k):
            expected = 10.0 ** -(6 - k) * (0.1 + 0.9 * (j + 1) / 2 ** k)
            assert values[2 ** k + j] == pytest.approx(expected, rel=1e-12)
    # Each decade's top value (all tree bits 1) is a power of ten: the decades join up.
    assert [float(values[2 ** k - 1]) for k in range(1, 8)] == pytest.approx([1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 0.1, 1.0])


def test_linear8_table():
    values = q.linear8_values()
    assert values.shape == (128,) and values[0] == 0 and values[127] == 1.0
    assert torch.allclose(values[1:] - values[:-1], torch.full((127,), 1 / 127, dtype=torch.float64))


@pytest.mark.parametrize("value, code", [(1.0, 0b01111111), (-1.0, 0b11111111), (0.55, 0b01011111),
                                          (0.1, 0b00111111), (0.2345678, 0b01001001), (0.0000234, 0b00000100),
                                          (-4e-7, 0b10000000), (6e-7, 0b00000001)])
def test_dynamic_tree_examples(value, code):
    codes, absmax = q.encode_dynamic_tree(torch.tensor([1.0, value]))
    assert absmax == 1.0 and int(codes[1]) == code


def test_error_on_normal_samples_beats_linear():
    x = torch.randn(2_500_000, generator=torch.Generator().manual_seed(2016))
    errors = {name: mean_relative_error(x, decode(*encode(x))) for name, (encode, decode, _) in CODECS.items()}
    print(f"mean relative error over |x| > 1e-3 of N(0,1): {errors}")
    assert errors["dynamic tree"] < 0.035
    assert errors["dynamic tree"] < errors["linear8"]


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("absmax, dtype", [(1.0, torch.float32), (3.7, torch.float32), (1e-3, torch.float64),
                                           (250.0, torch.float64)])
def test_every_code_round_trips(name, absmax, dtype):
    encode, decode, _ = CODECS[name]
    decoded = decode(ALL_CODES, torch.tensor(absmax), dtype)
    assert decoded.dtype == dtype
    codes, again = encode(decoded)
    assert torch.equal(codes, ALL_CODES) and float(again) == pytest.approx(absmax)
    # The one duplicate value: 0x80 is -0.0, equal to 0x00's +0.0.
    assert decoded[0] == decoded[128] == 0 and torch.signbit(decoded[128])


@pytest.mark.parametrize("name", CODECS)
def test_fast_encoder_is_the_binary_search(name):
    encode, _, table = CODECS[name]
    values = table()
    boundaries = q.midpoints(values)
    tricky = torch.cat([values.float(), boundaries, torch.nextafter(boundaries, torch.zeros(())),
                        torch.nextafter(boundaries, torch.ones(()))])
    generator = torch.Generator().manual_seed(7)
    every_float_below_one = torch.randint(0, 0x3F800000, (200_000,), generator=generator,
                                          dtype=torch.int32).view(torch.float32)
    normal = torch.randn(200_000, generator=generator).clamp(-1, 1)
    x = torch.cat([torch.ones(1), tricky, -tricky, every_float_below_one, -every_float_below_one, normal])
    codes, absmax = encode(x)
    assert absmax == 1.0  # so the normalized values are x itself
    assert torch.equal(codes, reference_codes(x, values))


def test_linear8_rounds_to_nearest_level():
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(3))
    codes, absmax = q.encode_linear8(x)
    levels = torch.round(x.abs() / absmax * 127)
    assert torch.equal((codes & 0x7F).long(), levels.long())
    assert torch.equal(codes >= 0x80, torch.signbit(x))


@pytest.mark.parametrize("name", CODECS)
def test_zero_tensor_decodes_to_exact_zeros(name):
    encode, decode, _ = CODECS[name]
    codes, absmax = encode(torch.zeros(3, 4))
    assert float(absmax) == 0 and not torch.signbit(absmax)
    assert torch.equal(codes, torch.zeros(3, 4, dtype=torch.uint8))
    decoded = decode(codes, absmax)
    assert torch.equal(decoded, torch.zeros(3, 4)) and not torch.signbit(decoded).any()


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_input_raises(name, bad):
    encode = CODECS[name][0]
    x = torch.ones(10)
    x[3] = x[7] = bad
    with pytest.raises(ValueError, match=r"2 non-finite element.*of 10.*exploding gradients"):
        encode(x)


def test_float64_beyond_float32_range_raises():
    with pytest.raises(ValueError, match="float32 range"):
        q.encode_dynamic_tree(torch.tensor([1.0, -1e300], dtype=torch.float64))


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_float_dtypes(name, dtype):
    encode, decode, _ = CODECS[name]
    x = torch.randn(5, 7, generator=torch.Generator().manual_seed(1)).to(dtype)
    codes, absmax = encode(x)
    assert codes.shape == x.shape and codes.dtype == torch.uint8 and absmax.dtype == torch.float32
    assert torch.equal(codes, encode(x.float())[0])
    decoded = decode(codes, absmax, dtype)
    assert decoded.dtype == dtype and decoded.shape == x.shape
    assert float((decoded.double() - x.double()).abs().max()) <= 0.01 * float(absmax)


@pytest.mark.parametrize("name", CODECS)
def test_zero_dimensional_and_empty_tensors(name):
    encode, decode, _ = CODECS[name]
    codes, absmax = encode(torch.tensor(-2.5))
    assert codes.shape == () and int(codes) == 0xFF and float(absmax) == 2.5
    assert torch.equal(decode(codes, absmax), torch.tensor(-2.5))
    codes, absmax = encode(torch.empty(0, 3, dtype=torch.float16))
    assert codes.shape == (0, 3) and float(absmax) == 0
    assert decode(codes, absmax, torch.float16).shape == (0, 3)


@pytest.mark.parametrize("name", CODECS)
def test_non_contiguous_input(name):
    encode, decode, _ = CODECS[name]
    base = torch.randn(64, 32, generator=torch.Generator().manual_seed(5))
    for view in (base.t(), base[:, ::3], base[::2].unsqueeze(0).expand(2, -1, -1)):
        codes, absmax = encode(view)
        expected, expected_absmax = encode(view.contiguous())
        assert torch.equal(codes, expected) and absmax == expected_absmax
        assert decode(codes, absmax).shape == view.shape


def test_pack_and_unpack():
    x = torch.randn(100, generator=torch.Generator().manual_seed(9))
    codes, absmax = q.encode_dynamic_tree(x)
    buffer = q.pack(codes, absmax)
    assert buffer.dtype == torch.uint8 and buffer.shape == (q.HEADER_BYTES + 100,)
    assert bytes(buffer[:4].tolist()) == struct.pack("=f", float(absmax))
    unpacked, unpacked_absmax = q.unpack(buffer, 100)
    assert torch.equal(unpacked, codes) and unpacked_absmax == absmax and unpacked_absmax.shape == ()
    assert torch.equal(q.unpack(q.pack(codes[:0], 0.0), 0)[0], codes[:0])
    with pytest.raises(ValueError, match="100 codes has 104 bytes"):
        q.unpack(buffer[:-1], 100)
    with pytest.raises(TypeError):
        q.unpack(buffer.float(), 100)


@pytest.mark.parametrize("kind, encode, decode", [("dynamic tree", q.encode_dynamic_tree, q.decode_dynamic_tree),
                                                  ("linear8", q.encode_linear8, q.decode_linear8)])
@pytest.mark.parametrize("count", [0, 1, 1000])
def test_ring_codec_lays_blocks_out_as_pack_does(kind, encode, decode, count):
    codec = q.RingCodec(kind)
    values = torch.randn(count, generator=torch.Generator().manual_seed(count)).numpy()
    encoded = torch.empty(codec.encoded_bytes(count), dtype=torch.uint8)
    codec.encode(values, encoded.numpy())
    assert torch.equal(encoded, q.pack(*encode(torch.from_numpy(values))))
    out = torch.full((count,), 7.0)
    codec.decode(encoded.numpy(), out.numpy())
    codes, absmax = q.unpack(encoded, count)
    assert torch.equal(out, decode(codes, absmax))
    base = torch.arange(count, dtype=torch.float32)
    codec.decode(encoded.numpy(), out.numpy(), add=base.numpy())
    assert torch.equal(out, base + decode(codes, absmax))


def test_int8_and_linear8_compressors_are_real_8_bit_codecs():
    from ringmaster.worker.compression.compressors import Compression, wire_format

    x = torch.randn(3, 5000, generator=torch.Generator().manual_seed(2))  # 15000 elements: 4 blocks
    x[0, 0] = 40.0  # an outlier flattens only its own block
    errors = {}
    for compressor, name, kind in [(Compression.int8, "int8", "dynamic tree"),
                                   (Compression.linear8, "linear8", "linear8")]:
        assert issubclass(compressor, Compressor)
        codes, ctx = compressor.compress(x)
        assert codes.dtype == torch.uint8 and codes.shape == x.shape
        absmax, dtype = ctx
        assert dtype == torch.float32 and absmax.shape == (4,) and absmax.dtype == torch.float32
        assert float(absmax[0]) == 40.0 and float(absmax[1]) == float(x.reshape(-1)[4096:8192].abs().max())
        restored = compressor.decompress(codes, ctx)
        assert restored.dtype == x.dtype and restored.shape == x.shape
        assert torch.equal(restored.reshape(-1)[4096:8192], q.decode_blocks(codes.reshape(-1)[4096:8192],
                                                                           absmax[1:2], torch.float32, kind))
        errors[name] = mean_relative_error(x.reshape(-1)[4096:], restored.reshape(-1)[4096:])
        assert wire_format(compressor, x) == name and wire_format(compressor, torch.arange(3)) == ""
        same, none = compressor.compress(torch.arange(3))  # integers pass through
        assert none is None and compressor.decompress(same, none) is same
        half = compressor.decompress(*compressor.compress(x.to(torch.float16)))
        assert half.dtype == torch.float16
    # Dettmers' Table 2: dynamic tree about 2-3 %, linear worse, on N(0, 1)
    assert errors["int8"] < 0.03 and errors["int8"] < errors["linear8"] < 0.07, errors
    assert wire_format(Compression.fp16, x) == "" and wire_format(Compression.none, x) == ""
    with pytest.raises(ValueError, match="unknown 8-bit type"):
        q.RingCodec("int4")
    with pytest.raises(ValueError, match="non-finite"):
        Compression.int8.compress(torch.tensor([1.0, float("nan")]))
    with pytest.raises(ValueError, match="need 2 absmax values"):
        q.decode_blocks(torch.zeros(5000, dtype=torch.uint8), torch.ones(1), torch.float32, "linear8")
    empty, ctx = Compression.int8.compress(torch.zeros(0))
    assert Compression.int8.decompress(empty, ctx).shape == (0,)


def test_wrong_types_are_refused():
    with pytest.raises(TypeError, match=r"float16, bfloat16, float32, float64 tensor, got torch\.int64"):
        q.encode_dynamic_tree(torch.arange(3))
    with pytest.raises(TypeError, match="uint8 codes"):
        q.decode_linear8(torch.arange(3), torch.tensor(1.0))
    with pytest.raises(TypeError, match="decodes to"):
        q.decode_dynamic_tree(ALL_CODES, torch.tensor(1.0), torch.int32)


@pytest.mark.cuda
@pytest.mark.parametrize("name", CODECS)
def test_cuda_matches_cpu(name):
    encode, decode, _ = CODECS[name]
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(13))
    codes, absmax = encode(x.cuda())
    assert codes.is_cuda and absmax.is_cuda
    cpu_codes, cpu_absmax = encode(x)
    assert torch.equal(codes.cpu(), cpu_codes) and absmax.cpu() == cpu_absmax
    assert torch.equal(decode(codes, absmax).cpu(), decode(cpu_codes, cpu_absmax))
    assert torch.equal(q.pack(codes, absmax).cpu(), q.pack(cpu_codes, cpu_absmax))


@pytest.mark.parametrize("kind", ["dynamic tree", "linear8"])
@pytest.mark.parametrize("count", [0, 5, 3_000, 3_001, 10_007])
def test_ring_codec_whole_chunks_give_the_bytes_of_one_block_at_a_time(kind, count):
    codec, block = q.RingCodec(kind), 1000
    values = torch.randn(count, generator=torch.Generator().manual_seed(count)) * 3
    addend = torch.randn(count, generator=torch.Generator().manual_seed(count + 1))
    blocks = [(start, min(block, count - start)) for start in range(0, count, block)]
    size = sum(codec.encoded_bytes(n) for _, n in blocks)
    one_at_a_time, whole = torch.empty(size, dtype=torch.uint8), torch.empty(size, dtype=torch.uint8)
    expected, expected_sum = torch.empty(count), torch.empty(count)
    position = 0
    for start, n in blocks:
        part = one_at_a_time[position:position + codec.encoded_bytes(n)]
        codec.encode(values[start:start + n], part)
        codec.decode(part, expected[start:start + n])
        codec.decode(part, expected_sum[start:start + n], add=addend[start:start + n])
        position += codec.encoded_bytes(n)
    codec.encode_blocks(values, whole, block)
    decoded, summed = torch.empty(count), torch.empty(count)
    codec.decode_blocks(whole, decoded, block)
    codec.decode_blocks(whole, summed, block, add=addend)
    assert torch.equal(whole, one_at_a_time)
    assert torch.equal(decoded.view(torch.int32), expected.view(torch.int32))
    assert torch.equal(summed.view(torch.int32), expected_sum.view(torch.int32))


def test_ring_codec_whole_chunks_refuse_non_finite_input_as_one_block_does():
    values = torch.ones(3_000)
    values[1_500] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        q.RingCodec("linear8").encode_blocks(values, torch.empty(3_012, dtype=torch.uint8), 1000)
