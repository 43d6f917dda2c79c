"""Boundary codec: a tensor <-> independently decodable parts (``runtime_pb2.Tensor`` messages).

Every tensor that travels between a trainer and a stage server is one or more *parts* (:func:`encode_parts`):
block-aligned slices of the flattened tensor, each decodable on its own, so that large tensors can be streamed
with encoding, transfer and decoding overlapped. Floating tensors are compressed with one of
:data:`COMPRESSIONS`:

- ``"8bit"``: bitsandbytes dynamic blockwise quantization (SWARM's boundary compression), about 1/4 of the
  fp32 bytes, see :mod:`.quantize`. Buffer layout: ``uint32 blocksize | float32 absmax[num_blocks] | uint8
  codes[numel]``, tagged with this package's own compression value :data:`WIRE_8BIT` (hivemind's
  ``BLOCKWISE_8BIT`` tag means a different byte layout).
- ``"fp16"``: a cast to float16 (bfloat16 tensors travel as they are, since fp16 would overflow them).
- ``"none"``: the raw bytes.

Integer, bool and complex tensors always travel losslessly, and so do tiny floating tensors (fewer than
:data:`LOSSLESS_BELOW` elements), whose compression would save nothing worth the error, and floating values a
lossy format cannot carry: a tensor beyond the fp16 range is sent raw, and so is each 8-bit part that holds NaN
or an infinity (a float attention mask's ``-inf``), so such a tensor's parts may mix 8-bit and raw ones.
Decoding anything a remote peer may send raises :class:`CodecError` and nothing else.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import numpy as np
import torch
from hivemind.proto import runtime_pb2

from lightning_swarm.swarm.wire.quantize import (
    BLOCKSIZE,
    VALID_BLOCKSIZES,
    dequantize_buffer,
    one_thread,
    part_bounds,
    quantize_to_buffer,
)

__all__ = [
    "COMPRESSIONS",
    "CodecError",
    "TooLarge",
    "PartsDecoder",
    "check_compression",
    "all_finite",
    "check_encodable",
    "WIRE_8BIT",
    "decode_parts",
    "decode_tensor",
    "encode_parts",
    "encode_tensor",
    "estimated_bytes",
    "nbytes",
    "num_parts",
    "remember_wire_format",
]

COMPRESSIONS = ("8bit", "fp16", "none")
LOSSLESS_BELOW = 1024  # floating tensors with fewer elements are sent as they are
PART_ELEMENTS = 64 * BLOCKSIZE  # elements per part of a large tensor: the unit of pipelined sending
_MAX_CHUNKS = 1 << 20
_MAX_DIMS = 64
_MAX_NUMEL = 1 << 40  # no peer sends a tensor of a trillion elements; larger declared shapes are garbage

_DTYPES: dict[str, torch.dtype] = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.bool,
        torch.complex64,
        torch.complex128,
    )
}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
_QUANTIZABLE = (torch.float32, torch.float16, torch.bfloat16)
_NONE = runtime_pb2.CompressionType.NONE
_FLOAT16 = runtime_pb2.CompressionType.FLOAT16
# this package's blockwise 8-bit layout (see the module docstring); outside hivemind's enum on purpose
WIRE_8BIT = 0x4C38  # "L8"
_LOSSY_TYPES = {"8bit": WIRE_8BIT, "fp16": _FLOAT16}
_LOSSY_RANGE = {"8bit": float(torch.finfo(torch.float32).max), "fp16": float(torch.finfo(torch.float16).max)}
_WIRE_ATTR = "_lightning_swarm_wire"  # (tensor version when decoded, the parts it was decoded from)
# the tensor version at which a decoded tensor was known to hold only finite values (see all_finite)
_FINITE_ATTR = "_lightning_swarm_finite"


class CodecError(ValueError):
    """A tensor or call could not be encoded, or a received message is malformed."""


class TooLarge(CodecError):
    """A received message declares or carries more than the receiver accepts (refused before allocating)."""


def check_compression(compression: str) -> str:
    """Return ``compression`` if it is one of :data:`COMPRESSIONS`, else raise a ``ValueError`` saying so."""
    if compression not in COMPRESSIONS:
        raise ValueError(f"Unknown boundary compression {compression!r}; use one of {COMPRESSIONS}")
    return compression


def check_encodable(t: torch.Tensor) -> None:
    """Raise ``CodecError`` unless ``t`` is a tensor of a dtype that can cross a stage boundary."""
    if not isinstance(t, torch.Tensor):
        raise CodecError(f"encode_tensor expects a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _DTYPE_NAMES:
        raise CodecError(
            f"Tensors of dtype {t.dtype} cannot cross a stage boundary; use one of {list(_DTYPES)}"
        )


def all_finite(t: torch.Tensor) -> bool:
    """Whether ``t`` holds no NaN and no infinity. For real floating tensors one ``aminmax`` pass (both ends
    propagate NaN; an infinity is an end): ~30x faster than ``isfinite(t).all()``, which writes a bool per
    element, and it allocates nothing of ``t``'s size. Run it inside :func:`~.quantize.one_thread` on a server.

    A tensor decoded from 8-bit parts whose block scales are all finite (and fit its dtype) is finite by
    construction (each value is a code in [-1, 1] times its block's scale): unless modified since, it is not
    scanned again."""
    if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0:
        return True
    mark = getattr(t, _FINITE_ATTR, None)
    if mark is not None and mark == _version(t):  # decoded from 8 bits with finite scales, unmodified since
        return True
    if t.is_complex():  # aminmax does not order complex numbers
        return bool(torch.isfinite(t).all())
    try:
        low, high = torch.aminmax(t)
    except RuntimeError:  # a dtype aminmax does not support: the slow, general way
        return bool(torch.isfinite(t).all())
    return bool(torch.isfinite(low)) and bool(torch.isfinite(high))


def _version(t: torch.Tensor) -> int | None:
    """``t``'s in-place modification counter; ``None`` for an inference tensor, which has none."""
    return None if t.is_inference() else t._version


def _peak(flat: torch.Tensor) -> float:
    """Largest magnitude in ``flat`` (one ``aminmax`` pass; NaN if any element is NaN)."""
    low, high = torch.aminmax(flat)
    return max(-float(low), float(high))


def _raw_bytes(t: torch.Tensor) -> bytes:
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: ship the bit pattern
        t = t.view(torch.int16)
    return t.numpy().tobytes()


def num_parts(numel: int) -> int:
    """How many parts a tensor of ``numel`` elements is sent in (see :func:`encode_parts`)."""
    return max(1, min(_MAX_CHUNKS, -(numel // -PART_ELEMENTS)))


def encode_tensor(t: torch.Tensor, compression: str) -> runtime_pb2.Tensor:
    """Serialize one tensor (moved to CPU if needed) into a single ``runtime_pb2.Tensor``.

    Args:
        t: the tensor; its ``requires_grad`` flag is recorded in the message.
        compression: one of :data:`COMPRESSIONS`; applies to floating tensors only.
    """
    parts = _remembered_parts(t, compression)
    if parts is not None and len(parts) == 1:
        return parts[0]
    return next(_encode_parts(t, compression, chunks=1))


def encode_parts(t: torch.Tensor, compression: str, split: bool = True) -> Iterator[runtime_pb2.Tensor]:
    """Serialize one tensor as independently decodable parts, lazily.

    Each part is one ``runtime_pb2.Tensor`` holding a block-aligned range of the flattened tensor (see
    :func:`part_bounds`), encoded on its own: an 8-bit part carries its own block scales. The first part also
    carries the shape, dtype, ``requires_grad`` and the number of parts (``chunks``). Parts are produced one at a
    time, so a sender can put part ``i`` on the wire while part ``i + 1`` is being quantized, and a receiver
    can decode part ``i`` while part ``i + 1`` is in flight.

    Args:
        t: the tensor.
        compression: one of :data:`COMPRESSIONS`.
        split: cut large tensors into :func:`num_parts` parts; ``False`` sends every tensor as one part (the
            cheapest form when the whole payload travels in one message anyway).

    A tensor that :class:`PartsDecoder` restored from lossy parts and that was not modified since is sent as
    those same parts when asked for the same compression: re-quantizing would cost time and add no information
    (the common case of a stage's output fed to the next stage).
    """
    parts = _remembered_parts(t, compression)
    if parts is not None:
        yield from parts
        return
    yield from _encode_parts(t, compression, None if split else 1)


def _remembered_parts(t: torch.Tensor, compression: str) -> list[runtime_pb2.Tensor] | None:
    wire = getattr(t, _WIRE_ATTR, None)
    lossy = _LOSSY_TYPES.get(compression)
    if wire is None or wire[0] != _version(t) or not any(part.compression == lossy for part in wire[1]):
        return None
    first = runtime_pb2.Tensor()
    first.CopyFrom(wire[1][0])
    first.requires_grad = t.requires_grad
    return [first, *wire[1][1:]]


def remember_wire_format(source: torch.Tensor, target: torch.Tensor) -> None:
    """Let ``target`` (e.g. ``source`` moved to another device) reuse ``source``'s received parts."""
    wire = getattr(source, _WIRE_ATTR, None)
    if (
        wire is not None
        and target is not source
        and wire[0] == _version(source)
        and _version(target) is not None
    ):
        setattr(target, _WIRE_ATTR, (_version(target), wire[1]))


def _encode_parts(t: torch.Tensor, compression: str, chunks: int | None) -> Iterator[runtime_pb2.Tensor]:
    check_compression(compression)
    check_encodable(t)
    dtype_name = _DTYPE_NAMES[t.dtype]
    requires_grad = t.requires_grad
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    flat = t.contiguous().view(-1)
    numel = flat.numel()
    if not t.is_floating_point() or numel < LOSSLESS_BELOW or compression == "none":
        mode = "none"
    elif compression == "fp16" and t.dtype in (torch.float16, torch.bfloat16):
        mode = "none"  # already 16-bit (bfloat16 would overflow in fp16)
    else:
        mode = compression
    if mode != "none" and (mode == "fp16" or t.dtype == torch.float64) and numel:
        # values beyond the lossy format's range would arrive as infinities: send such a tensor as it is
        with one_thread():
            peak = _peak(flat)
        if peak > _LOSSY_RANGE[mode]:
            mode = "none"
    chunks = num_parts(numel) if chunks is None else chunks
    bounds = part_bounds(numel, chunks)
    for i in range(chunks):
        part = flat[bounds[i] : bounds[i + 1]]
        msg = runtime_pb2.Tensor()
        if i == 0:
            msg.size.extend(t.shape)
            msg.dtype, msg.requires_grad, msg.chunks = dtype_name, requires_grad, chunks
        if mode == "none":
            msg.buffer = _raw_bytes(part)
        elif mode == "fp16":
            with one_thread():
                msg.buffer = part.to(torch.float16).numpy().tobytes()
            msg.compression = _FLOAT16
        else:  # 8bit
            source = part if part.dtype in _QUANTIZABLE else part.to(torch.float32)
            buffer = quantize_to_buffer(source)
            if _scales_fit(buffer, part.numel(), torch.float32):
                msg.buffer, msg.compression = buffer, WIRE_8BIT
            else:  # NaN or an infinity in this part (a float mask's -inf): quantized, it would arrive mangled
                msg.buffer = _raw_bytes(part)
        yield msg


def _frombuffer(buffer: bytes, dtype: torch.dtype, count: int) -> torch.Tensor:
    """A writable tensor holding a copy of ``buffer`` (received bytes objects are immutable)."""
    if count == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(bytearray(buffer), dtype=dtype, count=count)


def decode_tensor(msg: runtime_pb2.Tensor) -> torch.Tensor:
    """Restore a tensor (original dtype and shape, on CPU) from :func:`encode_tensor`'s message.

    Raises:
        CodecError: the message is malformed, truncated, inconsistent or only the first of several parts.
    """
    return decode_parts([msg])[0]


def decode_parts(
    parts: Iterable[runtime_pb2.Tensor], max_bytes: float = math.inf, max_tensors: float = math.inf
) -> list[torch.Tensor]:
    """Restore every tensor from a sequence of parts (see :func:`encode_parts`); raises ``CodecError``
    (:class:`TooLarge` beyond the limits, see :class:`PartsDecoder`)."""
    decoder = PartsDecoder(max_bytes, max_tensors)
    for part in parts:
        decoder.feed(part)
    return decoder.finish()


class PartsDecoder:
    """Decodes a stream of tensor parts one part at a time, as they arrive.

    ``feed`` each received part in order; ``finish`` returns the tensors. Floating tensors sent with
    ``requires_grad`` come back as leaves that require grad. Anything malformed raises :class:`CodecError`.

    Args:
        max_bytes: the decoded tensors may take this many bytes in all. A tensor's size is known from its first
            part (shape and dtype), so one declaring more is refused with :class:`TooLarge` before anything is
            allocated for it (an 8-bit part decodes to 4 times its wire size: the limit is on the decoded size).
        max_tensors: at most this many tensors (:class:`TooLarge` beyond).
    """

    def __init__(self, max_bytes: float = math.inf, max_tensors: float = math.inf) -> None:
        self.max_bytes, self.max_tensors = max_bytes, max_tensors
        self.declared_bytes = 0  # decoded size of the tensors started so far
        self.tensors: list[torch.Tensor] = []
        self._first: runtime_pb2.Tensor | None = None
        self._dtype = torch.float32
        self._shape: tuple[int, ...] = ()
        self._bounds: list[int] = []
        self._parts: list[runtime_pb2.Tensor] = []
        self._decoded: list[torch.Tensor] = []
        self._finite = True  # the tensor in progress: every part so far was 8-bit with scales that fit
        self._lossy = _NONE  # the lossy compression of its parts (all the same), if any

    def feed(self, msg: runtime_pb2.Tensor) -> None:
        """Decode one part (the first part of a tensor starts a new one); raises only ``CodecError``."""
        try:
            self._feed(msg)
        except CodecError:
            raise
        except (
            Exception
        ) as e:  # whatever else garbage may trigger in torch or protobuf: still the sender's fault
            raise CodecError(f"Received a malformed tensor part ({type(e).__name__}: {e})") from None

    def _feed(self, msg: runtime_pb2.Tensor) -> None:
        if not isinstance(msg, runtime_pb2.Tensor):
            raise CodecError(f"decode_tensor expects a runtime_pb2.Tensor, got {type(msg).__name__}")
        if self._first is None:
            self._start(msg)
        elif msg.compression != _NONE:
            # raw parts may stand among lossy ones (see encode_parts), nothing else
            if msg.compression not in (_FLOAT16, WIRE_8BIT) or not self._dtype.is_floating_point:
                raise CodecError(
                    f"Received a {self._first.dtype} tensor part with compression {msg.compression}"
                )
            if self._lossy not in (_NONE, msg.compression):
                raise CodecError("Received a tensor whose parts use different lossy compressions")
        if msg.compression != _NONE:
            self._lossy = msg.compression
        index = len(self._decoded)
        numel = self._bounds[index + 1] - self._bounds[index]
        assert self._first is not None
        with one_thread():  # dequantizing is a cheap table lookup: never worth a parallel region
            self._decoded.append(
                _decode_part(msg.buffer, msg.compression, self._dtype, self._first.dtype, numel)
            )
        self._finite = (
            self._finite and msg.compression == WIRE_8BIT and _scales_fit(msg.buffer, numel, self._dtype)
        )
        self._parts.append(msg)
        if len(self._decoded) == len(self._bounds) - 1:
            self._complete()

    def finish(self) -> list[torch.Tensor]:
        """The decoded tensors; raises ``CodecError`` if the last tensor is missing parts."""
        if self._first is not None:
            missing = len(self._bounds) - 1 - len(self._decoded)
            raise CodecError(f"Received a tensor with {missing} of its parts missing")
        return self.tensors

    def _start(self, msg: runtime_pb2.Tensor) -> None:
        dtype = _DTYPES.get(msg.dtype)
        if dtype is None:
            raise CodecError(f"Received a tensor with unsupported dtype {msg.dtype!r}")
        if msg.compression != _NONE and not dtype.is_floating_point:
            raise CodecError(
                f"Received a {msg.dtype} tensor with lossy compression {msg.compression}; only floats are"
            )
        if msg.compression not in (_NONE, _FLOAT16, WIRE_8BIT):
            raise CodecError(f"Received a tensor with unsupported compression type {msg.compression}")
        shape = tuple(msg.size)
        if (
            len(shape) > _MAX_DIMS
            or min(shape, default=0) < 0
            or math.prod(d for d in shape if d) > _MAX_NUMEL
        ):
            raise CodecError(f"Received a tensor of impossible shape {list(shape)[:_MAX_DIMS]}")
        numel = math.prod(shape)
        size = numel * torch.empty((), dtype=dtype).element_size()
        if self.declared_bytes + size > self.max_bytes:
            raise TooLarge(
                f"Received a tensor of shape {list(shape)} ({msg.dtype}, {size} bytes decoded): the message would "
                f"exceed the receiver's limit of {self.max_bytes:.0f} bytes; send smaller microbatches"
            )
        if len(self.tensors) + 1 > self.max_tensors:
            raise TooLarge(f"Received more than {self.max_tensors} tensors in one message")
        self.declared_bytes += size
        chunks = max(1, msg.chunks)
        if chunks > max(1, -(numel // -BLOCKSIZE)):
            raise CodecError(f"Received a tensor of shape {list(shape)} in an impossible {chunks} parts")
        self._first, self._dtype, self._shape = msg, dtype, shape
        self._bounds = part_bounds(numel, chunks)
        self._finite = True
        self._lossy = _NONE

    def _complete(self) -> None:
        first, decoded, parts = self._first, self._decoded, self._parts
        assert first is not None
        if len(decoded) == 1:
            t = decoded[0]
        else:
            with one_thread():
                t = torch.cat(decoded)
        t = t.view(self._shape)
        version = _version(t)  # None under torch.inference_mode: nothing can be remembered then
        if self._lossy != _NONE and version is not None:
            setattr(t, _WIRE_ATTR, (version, parts))  # see encode_parts
        if self._finite and version is not None:
            setattr(t, _FINITE_ATTR, version)  # see all_finite
        if first.requires_grad and t.is_floating_point():
            t.requires_grad_(True)
        self.tensors.append(t)
        self._first, self._bounds, self._parts, self._decoded = None, [], [], []


def _decode_part(
    buffer: bytes, compression: int, dtype: torch.dtype, dtype_name: str, numel: int
) -> torch.Tensor:
    """One part of ``numel`` elements as a flat tensor of ``dtype``."""
    if compression == _NONE:
        itemsize = torch.empty((), dtype=dtype).element_size()
        if len(buffer) != numel * itemsize:
            raise CodecError(
                f"Received {len(buffer)} bytes for {numel} elements of a {dtype_name} tensor, "
                f"expected {numel * itemsize}"
            )
        if dtype == torch.bfloat16:
            return _frombuffer(buffer, torch.int16, numel).view(torch.bfloat16)
        return _frombuffer(buffer, dtype, numel)
    if compression == _FLOAT16:
        if len(buffer) != numel * 2:
            raise CodecError(
                f"Received an fp16-compressed part of {numel} elements with {len(buffer)} bytes, "
                f"expected {numel * 2}"
            )
        return _frombuffer(buffer, torch.float16, numel).to(dtype)
    if compression == WIRE_8BIT:
        if len(buffer) < 4:
            raise CodecError(f"Received an 8-bit tensor with a truncated header ({len(buffer)} bytes)")
        blocksize = int.from_bytes(buffer[:4], "little")
        if blocksize not in VALID_BLOCKSIZES:
            raise CodecError(f"Received an 8-bit tensor with invalid block size {blocksize}")
        num_blocks = -(numel // -blocksize)
        expected = 4 + 4 * num_blocks + numel
        if len(buffer) != expected:
            raise CodecError(
                f"Received an 8-bit part of {numel} elements with {len(buffer)} bytes, expected {expected}"
            )
        if numel == 0:
            return torch.empty(0, dtype=dtype)
        return dequantize_buffer(buffer, blocksize, numel, dtype).to(dtype)
    raise CodecError(f"Received a tensor with unsupported compression type {compression}")


def _scales_fit(buffer: bytes, numel: int, dtype: torch.dtype) -> bool:
    """Whether a (decoded, so validated) 8-bit part's block scales are finite and within ``dtype``'s range: then
    every decoded value is finite (a code in [-1, 1] times its block's scale)."""
    num_blocks = -(numel // -int.from_bytes(buffer[:4], "little"))
    scales = np.frombuffer(buffer, dtype=np.float32, count=num_blocks, offset=4)
    return float(np.abs(scales).max(initial=0.0)) <= torch.finfo(dtype).max  # NaN compares False


def nbytes(msgs: Iterable[runtime_pb2.Tensor]) -> int:
    """Bytes these tensor messages take on the wire."""
    return sum(msg.ByteSize() for msg in msgs)


def estimated_bytes(t: torch.Tensor, compression: str) -> int:
    """About how many bytes ``t`` takes on the wire with ``compression`` (without encoding it)."""
    numel = t.numel()
    if not t.is_floating_point() or numel < LOSSLESS_BELOW or compression == "none":
        return numel * t.element_size()
    if compression == "fp16":
        return numel * 2
    return numel + 4 * -(numel // -BLOCKSIZE) + 4
