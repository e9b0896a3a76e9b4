"""8-bit gradient codecs: the dynamic tree and linear data types of Dettmers, "8-Bit
Approximations for Parallelism in Deep Learning" (ICLR 2016).

Both types store one byte per element plus the tensor's absolute maximum ``absmax``:
elements are divided by ``absmax`` (so they lie in [-1, 1]), each is replaced by the code
of the nearest of 256 values, and decoding multiplies the code's value by ``absmax``.

Byte layout (bit 7 is the most significant bit)::

    bit 7      sign: 1 = negative
    bits 6..0  7-bit magnitude code c; c = 0..127 indexes a sorted table of 128 values

Dynamic tree magnitude (``dynamic_tree_values()``), bits 6..0 read left to right:
``n`` zero bits (n = 0..6), a 1 *flag* bit, then ``k = 6 - n`` *tree* bits. The zeros give
the decimal exponent 10^-n; the tree bits walk a bisection of the interval [0.1, 1] (a
0 bit keeps the lower half, a 1 bit the upper half), so that after k bits, read as the
integer j, the interval left is [0.1 + 0.9 j / 2^k, 0.1 + 0.9 (j+1) / 2^k]. The code's
value is that interval's upper end, scaled by the exponent::

    value(n, j) = 10^-n * (0.1 + 0.9 * (j + 1) / 2^k)          code c = 2^k + j

The 7-bit code with no flag bit, 0000000, is zero. (The paper leaves open which point of
the final interval a code stands for; the upper end makes 1.0 representable and joins the
decades without gaps or duplicates.) So code 0b1111111 is exactly 1.0 (the
element equal to ``absmax`` is decoded exactly), code 0b0000001 (n = 6, no tree bits) is
10^-6, the smallest non-zero magnitude, and each decade's values continue the grid of the
decade below (the bottom end 10^-n * 0.1 of decade n is the top value of decade n + 1).
The 128 values are therefore distinct and strictly increasing in code order: the 7-bit
code of a magnitude is its index in the sorted table. Decade n holds 2^(6-n) values:
64 in (0.1, 1], 32 in (0.01, 0.1], ..., 1 in (1e-7, 1e-6], and zero.

Linear magnitude (``linear8_values()``): ``c / 127``, 127 levels per sign plus zero.

Rounding: ``absmax`` is the largest magnitude rounded to float32; each element, divided
by it in float32, becomes the nearest table value, and one exactly halfway between two
becomes the smaller; the sign bit is the element's own (``torch.signbit``). So magnitudes
up to 5e-7 * absmax (tree) or absmax / 254 (linear) decode to zero, as code 0x00 (+0.0)
or, for negative elements, 0x80 (-0.0). These two are the only codes of equal value, so
``encode(decode(c)) == c`` for all 256 codes. The search is ``nearest_codes`` (a binary
search among the midpoints); the encoder runs it once per float32 bit-pattern cell, when
it builds its tables, and per element looks the cell up and makes one comparison.

Wire format (``pack``/``unpack``): ``absmax`` as 4 bytes of float32 in native byte order,
then the codes, one byte per element in row-major order.

Non-finite input (NaN or ±Inf anywhere) raises ``ValueError`` on the host: the absmax
would be Inf or NaN and every element would decode to garbage. That check reads a flag
back, which on a CUDA device is a synchronization, so on a device the encoders skip it
unless asked (``check_finite=True``): a block with a non-finite element then carries a NaN
or Inf absmax, and EVERY element of it decodes to NaN or ±Inf (0 × Inf is NaN), never to a
finite wrong value, as a float16 cast or an uncompressed sum would pass NaN on. A tensor of
zeros has absmax 0 and decodes to exact zeros.

Devices: the blockwise codecs (``encode_blocks``/``decode_blocks``) run as one Triton kernel
each way where Triton runs on the input's device (``fused_codecs``: the same codes, bits and
errors); otherwise encoding and decoding are torch operations on the input's device, with the
tables (256 decode values, 65536-entry encode tables) built once on the host and copied to
each device once, on first use (``_tables``, cached per device); results stay on the input's
device, and nothing is read back on a device unless ``check_finite=True``. ``RingCodec``
works on the host arrays of the ring allreduce, and on torch tensors of any device.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from ringmaster.worker.compression import devices, fused_codecs

#: Bytes in front of the codes in a packed buffer: ``absmax`` as float32.
HEADER_BYTES = 4

#: The input dtypes the codecs take; the arithmetic is done in float32.
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# The fast encoder looks up each float32's top 16 bits (sign, exponent, 7 mantissa bits).
_CELL_SHIFT = 16
_CELLS = 1 << 16
_SIGN = 0x80


def dynamic_tree_values() -> torch.Tensor:
    """The 128 non-negative dynamic tree values, indexed by 7-bit code (float64, sorted)."""
    values = [0.0]
    for n in range(6, -1, -1):  # 6 leading zeros (smallest decade) first: code order
        steps = 2 ** (6 - n)
        values += [10.0 ** -n * (0.1 + 0.9 * (j + 1) / steps) for j in range(steps)]
    return torch.tensor(values, dtype=torch.float64)


def linear8_values() -> torch.Tensor:
    """The 128 non-negative linear values ``c / 127``, indexed by 7-bit code (float64)."""
    return torch.arange(128, dtype=torch.float64) / 127


_VALUES = {"dynamic tree": dynamic_tree_values, "linear8": linear8_values}


def midpoints(values: torch.Tensor) -> torch.Tensor:
    """The 127 float32 decision boundaries halfway between consecutive sorted ``values``."""
    values = values.to(torch.float64)
    return ((values[1:] + values[:-1]) / 2).to(torch.float32)


def nearest_codes(magnitudes: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The index of the nearest of the sorted ``values`` to each of ``magnitudes`` (int64).

    A binary search (``torch.bucketize``) among the midpoints between consecutive values;
    a magnitude exactly on a midpoint gets the lower index. This defines the encoding: the
    encoder's per-element lookup is precomputed from it and gives the same codes.
    """
    boundaries = midpoints(values).to(magnitudes.device)
    return torch.bucketize(magnitudes.to(torch.float32), boundaries)


class _Tables(NamedTuple):
    decode: torch.Tensor     # 256 float32 values, indexed by code (sign bit included)
    cell_code: torch.Tensor  # 65536 uint8: the code of the smallest float in each cell
    threshold: torch.Tensor  # 65536 int32: float32 bits above which a cell's code is one more


@functools.cache
def _tables(kind: str, device: torch.device) -> _Tables:
    """Decode and encode tables of a data type on ``device``: built once on the host
    (:func:`_host_tables`), copied to each device once, on its first use."""
    tables = _host_tables(kind)
    if device.type == "cpu":
        return tables
    return _Tables(*(table.to(device) for table in tables))


@functools.cache
def _host_tables(kind: str) -> _Tables:
    """Decode and encode tables of a data type, built on the host.

    Encoding looks up ``key`` = the top 16 bits of a normalized float32 (its *cell*). No
    cell spans more than one midpoint (cells are at most 2^-7 of their value wide; the
    tables' relative steps are wider), so a cell's code is that of its smallest float,
    plus one where the float is above the midpoint in the cell: exactly ``nearest_codes``,
    as a table lookup and one comparison instead of a branchy binary search per element.
    Negative floats have the sign bit in their key, and compare as int32 bit patterns the
    way their magnitudes do.
    """
    values = _VALUES[kind]()
    magnitude_keys = torch.arange(_CELLS // 2, dtype=torch.int64)
    lowest = (magnitude_keys << _CELL_SHIFT).to(torch.int32).view(torch.float32)
    highest = ((magnitude_keys << _CELL_SHIFT) | 0xFFFF).to(torch.int32).view(torch.float32)
    low_code = nearest_codes(torch.nan_to_num(lowest, nan=float("inf")), values)
    high_code = nearest_codes(torch.nan_to_num(highest, nan=float("inf")), values)
    if int((high_code - low_code).max()) > 1:
        raise RuntimeError(f"the {kind} table is too fine for {_CELL_SHIFT}-bit cells")
    boundaries = torch.cat([midpoints(values), torch.tensor([float("inf")])])
    threshold = boundaries[low_code].view(torch.int32)
    sign_bits = torch.tensor(-(1 << 31), dtype=torch.int32)
    decode = values.to(torch.float32)
    return _Tables(
        decode=torch.cat([decode, -decode]),
        cell_code=torch.cat([low_code, low_code | _SIGN]).to(torch.uint8),
        threshold=torch.cat([threshold, threshold | sign_bits]),
    )


def _check_floating(tensor: torch.Tensor, what: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} takes a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(dtype).replace("torch.", "") for dtype in SUPPORTED_DTYPES)
        raise TypeError(f"{what} takes a {names} tensor, got {tensor.dtype}")


def _checks_finite(tensor: torch.Tensor, check_finite: bool | None) -> bool:
    """Whether to refuse non-finite input: as asked, else on the host only (on a device
    the check is a synchronization; see the module docstring)."""
    return devices.on_host(tensor) if check_finite is None else bool(check_finite)


def _absmax(flat: torch.Tensor, tensor: torch.Tensor, check_finite: bool = True) -> torch.Tensor:
    """The largest magnitude of ``flat`` (``tensor`` as float32) as a float32 0-d tensor;
    ``ValueError`` if it is not finite and ``check_finite``."""
    if flat.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=flat.device)
    low, high = torch.aminmax(flat)
    absmax = torch.maximum(low.abs(), high.abs())  # never -0.0
    if check_finite and not bool(torch.isfinite(absmax)):
        bad = int((~torch.isfinite(tensor)).sum())
        if bad:
            raise ValueError(
                f"cannot quantize a tensor with {bad} non-finite element(s) (NaN or Inf) of "
                f"{tensor.numel()}: check for exploding gradients (clip gradients, lower the "
                f"learning rate) or, in mixed precision, use loss scaling")
        raise ValueError(f"cannot quantize a tensor whose largest magnitude "
                         f"{float(tensor.abs().max()):g} exceeds the float32 range of the 8-bit header")
    return absmax


def _encode(tensor: torch.Tensor, kind: str, what: str,
            check_finite: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    _check_floating(tensor, what)
    flat = tensor.detach().reshape(-1).to(torch.float32)
    absmax = _absmax(flat, tensor, _checks_finite(tensor, check_finite))
    tables = _tables(kind, flat.device)
    bits = (flat / torch.where(absmax > 0, absmax, 1.0)).view(torch.int32)
    keys = (bits >> _CELL_SHIFT).bitwise_and_(_CELLS - 1)
    codes = torch.index_select(tables.cell_code, 0, keys)
    codes += bits > torch.index_select(tables.threshold, 0, keys)
    return codes.reshape(tensor.shape), absmax


def _decode(codes: torch.Tensor, absmax, dtype: torch.dtype, kind: str, what: str) -> torch.Tensor:
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8:
        got = codes.dtype if isinstance(codes, torch.Tensor) else type(codes).__name__
        raise TypeError(f"{what} takes uint8 codes, got {got}")
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{what} decodes to float16, bfloat16, float32 or float64, not {dtype}")
    scale = torch.as_tensor(absmax, dtype=torch.float32, device=codes.device)
    if scale.numel() != 1:
        raise ValueError(f"{what} takes one absmax, got a tensor of shape {tuple(scale.shape)}")
    values = (_tables(kind, codes.device).decode * scale.reshape(())).to(dtype)
    return torch.index_select(values, 0, codes.reshape(-1).to(torch.int32)).reshape(codes.shape)


def encode_dynamic_tree(tensor: torch.Tensor, *, check_finite: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode ``tensor`` in the dynamic tree type: ``(codes, absmax)``.

    ``codes`` is a uint8 tensor of ``tensor``'s shape (see the module docstring for the
    bit layout), ``absmax`` a float32 0-d tensor, both on ``tensor``'s device. Raises
    ``ValueError`` if ``tensor`` has NaN or Inf elements and ``check_finite`` (default: on
    the host only; on a device non-finite input decodes to NaN or Inf instead).
    """
    return _encode(tensor, "dynamic tree", "encode_dynamic_tree", check_finite)


def decode_dynamic_tree(codes: torch.Tensor, absmax, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The ``dtype`` tensor of ``codes``' shape that ``encode_dynamic_tree`` approximated."""
    return _decode(codes, absmax, dtype, "dynamic tree", "decode_dynamic_tree")


def encode_linear8(tensor: torch.Tensor, *, check_finite: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode ``tensor`` in the linear type (sign bit, magnitude ``round(127 |x| / absmax)``).

    Returns ``(codes, absmax)`` like :func:`encode_dynamic_tree`.
    """
    return _encode(tensor, "linear8", "encode_linear8", check_finite)


def decode_linear8(codes: torch.Tensor, absmax, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The ``dtype`` tensor of ``codes``' shape that ``encode_linear8`` approximated."""
    return _decode(codes, absmax, dtype, "linear8", "decode_linear8")


def pack(codes: torch.Tensor, absmax) -> torch.Tensor:
    """One flat uint8 buffer: ``absmax`` as 4 float32 bytes, then the codes (row-major)."""
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8:
        raise TypeError("pack takes uint8 codes")
    header = torch.as_tensor(absmax, dtype=torch.float32, device=codes.device).reshape(1)
    return torch.cat([header.view(torch.uint8), codes.reshape(-1)])


def unpack(buffer: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a :func:`pack` buffer of ``numel`` codes into ``(flat codes, absmax)``.

    The codes are a view of ``buffer``; reshape them to the original shape.
    """
    if not isinstance(buffer, torch.Tensor) or buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise TypeError("unpack takes a 1-d uint8 tensor made by pack")
    if buffer.numel() != HEADER_BYTES + numel:
        raise ValueError(f"a packed buffer of {numel} codes has {HEADER_BYTES + numel} bytes, "
                         f"this one has {buffer.numel()}")
    absmax = buffer[:HEADER_BYTES].clone().view(torch.float32).reshape(())
    return buffer[HEADER_BYTES:], absmax


#: Elements per absmax in :func:`encode_blocks`: the ring's blocks are its chunks; a tensor
#: codec with one absmax for a whole large tensor would let one outlier flatten the rest to
#: zero. 4096 elements cost 4 bytes of scale each (0.1 % over the codes) and keep an outlier's
#: reach to its block.
BLOCK_ELEMENTS = 4096


def encode_blocks(tensor: torch.Tensor, kind: str, block: int = BLOCK_ELEMENTS, *,
                  check_finite: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode ``tensor`` in the 8-bit type ``kind`` ("dynamic tree" or "linear8") with one
    absmax per ``block`` consecutive elements (row-major): ``(codes, absmaxes)``, the codes a
    uint8 tensor of ``tensor``'s shape, the absmaxes float32 of ``ceil(numel / block)``, both
    on ``tensor``'s device. ``check_finite`` as in :func:`encode_dynamic_tree`."""
    what = f"encode_blocks({kind!r})"
    if kind not in _VALUES:
        raise ValueError(f"unknown 8-bit type {kind!r}; use one of {', '.join(map(repr, _VALUES))}")
    _check_floating(tensor, what)
    if fused_codecs.usable(tensor, block):  # one kernel on a device: the same codes
        codes, absmax = fused_codecs.encode_blocks(tensor.detach(), _tables(kind, tensor.device), block)
        if _checks_finite(tensor, check_finite) and not bool(torch.isfinite(absmax).all()):
            _absmax(tensor.detach().reshape(-1).to(torch.float32), tensor)  # raises with the count of bad elements
        return codes, absmax
    flat = tensor.detach().reshape(-1).to(torch.float32)
    count = flat.numel()
    blocks = -(-count // block)
    padded = flat if count == blocks * block else torch.nn.functional.pad(flat, (0, blocks * block - count))
    padded = padded.reshape(blocks, block)
    absmax = padded.abs().amax(dim=1) if count else torch.zeros(0, dtype=torch.float32, device=flat.device)
    if count and _checks_finite(tensor, check_finite) and not bool(torch.isfinite(absmax).all()):
        _absmax(flat, tensor)  # raises with the count of bad elements
    tables = _tables(kind, flat.device)
    bits = (padded / torch.where(absmax > 0, absmax, 1.0).unsqueeze(1)).view(torch.int32).reshape(-1)
    keys = (bits >> _CELL_SHIFT).bitwise_and_(_CELLS - 1)
    codes = torch.index_select(tables.cell_code, 0, keys)
    codes += bits > torch.index_select(tables.threshold, 0, keys)
    return codes[:count].reshape(tensor.shape), absmax


def decode_blocks(codes: torch.Tensor, absmax: torch.Tensor, dtype: torch.dtype, kind: str,
                  block: int = BLOCK_ELEMENTS) -> torch.Tensor:
    """The ``dtype`` tensor of ``codes``' shape that :func:`encode_blocks` approximated."""
    what = f"decode_blocks({kind!r})"
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8:
        got = codes.dtype if isinstance(codes, torch.Tensor) else type(codes).__name__
        raise TypeError(f"{what} takes uint8 codes, got {got}")
    count = codes.numel()
    if not isinstance(absmax, torch.Tensor) or absmax.reshape(-1).numel() != -(-count // block):
        raise ValueError(f"{what}: {count} codes in blocks of {block} need {-(-count // block)} absmax values, "
                         f"got {absmax.numel() if isinstance(absmax, torch.Tensor) else absmax!r}")
    if dtype in SUPPORTED_DTYPES and fused_codecs.usable(codes, block):
        return fused_codecs.decode_blocks(codes.contiguous(), absmax, dtype, _tables(kind, codes.device), block)
    values = _tables(kind, codes.device).decode.to(torch.float32)
    decoded = torch.index_select(values, 0, codes.reshape(-1).to(torch.int32))
    return _scaled(decoded, absmax.reshape(-1).to(torch.float32), block).to(dtype).reshape(codes.shape)


def _scaled(decoded: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """``decoded[i] * scales[i // block]``: whole blocks broadcast their scale (no tensor of
    per-element scales is made), the last partial block is multiplied apart."""
    whole = decoded.numel() // block
    head = (decoded[:whole * block].view(whole, block) * scales[:whole].unsqueeze(1)).view(-1)
    if whole * block == decoded.numel():
        return head
    return torch.cat([head, decoded[whole * block:] * scales[whole]])


class RingCodec:
    """An 8-bit type as the quantized ring allreduce's codec (``ops.quantized_ring.Codec``).

    A block of ``count`` float32 values travels as :func:`pack` lays it out: its absmax
    (4 bytes), then ``count`` codes. Works on NumPy arrays (CPU) without copies, and on
    torch tensors of any device (nothing is read back on a device; a non-finite block then
    decodes to NaN or Inf, see the module docstring).
    """

    def __init__(self, kind: str):
        if kind not in _VALUES:
            raise ValueError(f"unknown 8-bit type {kind!r}; use one of {', '.join(map(repr, _VALUES))}")
        self.kind = kind

    @staticmethod
    def encoded_bytes(count: int) -> int:
        """``count`` codes plus the header."""
        return HEADER_BYTES + count

    def encode(self, values, out) -> None:
        """Encode the float32 array ``values`` into the uint8 array ``out``."""
        codes, absmax = _encode(_as_tensor(values), self.kind, "ring encode")
        target = _as_tensor(out)
        target[:HEADER_BYTES] = absmax.reshape(1).view(torch.uint8)
        target[HEADER_BYTES:] = codes

    def decode(self, encoded, out, add=None) -> None:
        """Decode the uint8 array ``encoded`` into the float32 array ``out`` (plus ``add``)."""
        source = _as_tensor(encoded)
        absmax = source[:HEADER_BYTES].clone().view(torch.float32).reshape(())
        values = _tables(self.kind, source.device).decode * absmax
        target = _as_tensor(out)
        if add is None:
            torch.index_select(values, 0, source[HEADER_BYTES:].to(torch.int32), out=target)
        else:
            decoded = torch.index_select(values, 0, source[HEADER_BYTES:].to(torch.int32))
            torch.add(_as_tensor(add), decoded, out=target)


    def encode_blocks(self, values, out, block: int) -> None:
        """Encode ``values`` in blocks of ``block`` elements (the last one shorter) into ``out``,
        laid out as consecutive :meth:`encode` outputs, with the same bytes: every full block
        in one set of tensor operations (one per block would be a few kernel launches each)."""
        source, target = _as_tensor(values), _as_tensor(out)
        full = source.numel() // block
        if full:
            rows = source[:full * block].reshape(full, block).to(torch.float32)
            low, high = torch.aminmax(rows, dim=1)
            absmax = torch.maximum(low.abs(), high.abs())  # never -0.0
            if _checks_finite(source, None) and not bool(torch.isfinite(absmax).all()):
                self._encode_each(source[:full * block], target, block)  # raises encode's error
            tables = _tables(self.kind, rows.device)
            bits = (rows / torch.where(absmax > 0, absmax, 1.0).unsqueeze(1)).view(torch.int32)
            keys = ((bits >> _CELL_SHIFT).bitwise_and_(_CELLS - 1)).reshape(-1)
            codes = torch.index_select(tables.cell_code, 0, keys).reshape(full, block)
            codes += bits > torch.index_select(tables.threshold, 0, keys).reshape(full, block)
            packed = target[:full * (HEADER_BYTES + block)].reshape(full, HEADER_BYTES + block)
            packed[:, :HEADER_BYTES] = absmax.reshape(full, 1).view(torch.uint8)
            packed[:, HEADER_BYTES:] = codes
        if source.numel() > full * block:
            self.encode(source[full * block:], target[full * (HEADER_BYTES + block):])

    def decode_blocks(self, encoded, out, block: int, add=None) -> None:
        """Decode what :meth:`encode_blocks` wrote into ``out`` (plus ``add``), with the values
        of :meth:`decode`: every full block in one set of tensor operations."""
        source, target = _as_tensor(encoded), _as_tensor(out)
        addend = None if add is None else _as_tensor(add)
        full = target.numel() // block
        if full:
            packed = source[:full * (HEADER_BYTES + block)].reshape(full, HEADER_BYTES + block)
            absmax = packed[:, :HEADER_BYTES].contiguous().view(torch.float32)  # (full, 1)
            table = _tables(self.kind, source.device).decode.unsqueeze(0) * absmax  # each block's values
            decoded = torch.gather(table, 1, packed[:, HEADER_BYTES:].to(torch.int64))
            rows = target[:full * block].reshape(full, block)
            if addend is None:
                rows.copy_(decoded)
            else:
                torch.add(addend[:full * block].reshape(full, block), decoded, out=rows)
        if target.numel() > full * block:
            rest = full * block
            self.decode(source[full * (HEADER_BYTES + block):], target[rest:],
                        add=None if addend is None else addend[rest:])

    def _encode_each(self, values: torch.Tensor, out: torch.Tensor, block: int) -> None:
        for start in range(0, values.numel(), block):
            count = min(block, values.numel() - start)
            position = start // block * (HEADER_BYTES + block)
            self.encode(values[start:start + count], out[position:position + HEADER_BYTES + count])


def _as_tensor(array) -> torch.Tensor:
    """A torch view (no copy) of a torch tensor, a NumPy array, or a device array that
    speaks DLPack (CuPy)."""
    if isinstance(array, torch.Tensor):
        return array
    if type(array).__module__.split(".")[0] == "numpy":
        return torch.from_numpy(array)
    return torch.from_dlpack(array)
