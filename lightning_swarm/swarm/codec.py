"""Boundary codec: how activations and gradients cross stage boundaries.

Every tensor that travels between a trainer and a stage server is one ``runtime_pb2.Tensor`` message.
Floating tensors are compressed with one of :data:`COMPRESSIONS`:

- ``"8bit"``: bitsandbytes dynamic blockwise quantization (SWARM's boundary compression), about 1/4 of the
  fp32 bytes. Buffer layout: ``uint32 blocksize | float32 absmax[num_blocks] | uint8 codes[numel]``.
- ``"fp16"``: a cast to float16 (bfloat16 tensors travel as they are, since fp16 would overflow them).
- ``"none"``: the raw bytes.

Integer, bool and complex tensors always travel losslessly, and so do tiny floating tensors (fewer than
:data:`LOSSLESS_BELOW` elements), whose compression would save nothing worth the error.

:func:`pack` / :func:`unpack` carry whole call signatures (``*args, **kwargs`` with nested tuples, lists,
dicts and plain Python values) as a list of tensor messages plus msgpack metadata. Anything malformed that
a remote peer may send raises :class:`CodecError` and nothing else.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
import warnings
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import bitsandbytes.functional as bnb_functional
import msgpack
import torch
from hivemind.proto import runtime_pb2

__all__ = ["COMPRESSIONS", "CodecError", "decode_tensor", "encode_tensor", "nbytes", "pack", "unpack"]

COMPRESSIONS = ("8bit", "fp16", "none")
BLOCKSIZE = 1024  # absmax overhead 0.4%; accuracy barely depends on it (64..4096 measured within 20%)
LOSSLESS_BELOW = 1024  # floating tensors with fewer elements are sent as they are
_VALID_BLOCKSIZES = (64, 128, 256, 512, 1024, 2048, 4096)
_COPY_BELOW = 4096  # decoded buffers this small are copied (tiny bytes objects may be interned singletons)
_MAX_DEPTH = 64

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
_BLOCKWISE_8BIT = runtime_pb2.CompressionType.BLOCKWISE_8BIT
_LOSSY_TYPES = {"8bit": _BLOCKWISE_8BIT, "fp16": _FLOAT16}
_WIRE_ATTR = "_lightning_swarm_wire"  # (tensor version when decoded, the message it was decoded from)

# decoded tensors share memory with the received bytes object, which nobody else references
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)

_dynamic_code: torch.Tensor | None = None


class CodecError(ValueError):
    """A tensor or call signature could not be encoded, or a received message is malformed."""


def _code() -> torch.Tensor:
    global _dynamic_code
    if _dynamic_code is None:
        _dynamic_code = bnb_functional.create_dynamic_map().to(torch.float32)
    return _dynamic_code


@contextlib.contextmanager
def _threads(count: int) -> Iterator[None]:
    """Run torch/bitsandbytes kernels on ``count`` OpenMP threads in this thread (the setting is per thread)."""
    previous = torch.get_num_threads()
    if previous == count:
        yield
        return
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


class _ThreadTuner:
    """Picks how many OpenMP threads the 8-bit quantizer uses, by measuring.

    Quantizing 1 MiB takes about 2 ms on one core. On two idle cores it takes about half that, but on busy
    cores (the normal state of a peer that also computes) every parallel region waits for a descheduled thread
    and it takes 10-30x longer. So the tuner keeps a moving average of the time per element with 1 thread and
    with ``max_threads`` threads, uses the faster, and re-tries the other one every ``explore_every`` calls.
    ``LIGHTNING_SWARM_CODEC_THREADS=N`` fixes the count instead.
    """

    def __init__(self, max_threads: int, explore_every: int = 16, ema: float = 0.2):
        self.options = (1, max_threads) if max_threads > 1 else (1,)
        self.explore_every, self.ema = explore_every, ema
        self.seconds_per_element: dict[int, float | None] = {n: None for n in self.options}
        self.calls = 0
        self.lock = threading.Lock()

    def pick(self) -> int:
        with self.lock:
            self.calls += 1
            untried = [n for n, v in self.seconds_per_element.items() if v is None]
            if untried:
                return untried[0]
            best = min(self.options, key=lambda n: self.seconds_per_element[n])
            if len(self.options) > 1 and self.calls % self.explore_every == 0:
                return next(n for n in self.options if n != best)
            return best

    def record(self, threads: int, seconds: float, numel: int) -> None:
        value = seconds / max(numel, 1)
        with self.lock:
            old = self.seconds_per_element[threads]
            self.seconds_per_element[threads] = (
                value if old is None else (1 - self.ema) * old + self.ema * value
            )


_FIXED_THREADS = int(os.environ.get("LIGHTNING_SWARM_CODEC_THREADS", "0"))
_tuner = _ThreadTuner(min(torch.get_num_threads(), os.cpu_count() or 1))


def _quantize(source: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bitsandbytes dynamic blockwise quantization: ``(uint8 codes, float32 absmax per block)``."""
    threads = _FIXED_THREADS if _FIXED_THREADS > 0 else _tuner.pick()
    start = time.perf_counter()
    with _threads(threads):
        codes, absmax = torch.ops.bitsandbytes.quantize_blockwise.default(source, _code(), BLOCKSIZE)
    if _FIXED_THREADS <= 0:
        _tuner.record(threads, time.perf_counter() - start, source.numel())
    return codes, absmax


def check_compression(compression: str) -> str:
    """Return ``compression`` if it is one of :data:`COMPRESSIONS`, else raise a ``ValueError`` saying so."""
    if compression not in COMPRESSIONS:
        raise ValueError(f"Unknown boundary compression {compression!r}; use one of {COMPRESSIONS}")
    return compression


def _raw_bytes(t: torch.Tensor) -> bytes:
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: ship the bit pattern
        t = t.view(torch.int16)
    return t.numpy().tobytes()


def encode_tensor(t: torch.Tensor, compression: str) -> runtime_pb2.Tensor:
    """Serialize one tensor (moved to CPU if needed) into a ``runtime_pb2.Tensor``.

    A tensor that :func:`decode_tensor` restored from a lossy message and that was not modified since is sent
    as that same message when asked for the same compression: re-quantizing it would cost time and add no
    information (this is the common case of a stage's output fed to the next stage).

    Args:
        t: the tensor; its ``requires_grad`` flag is recorded in the message.
        compression: one of :data:`COMPRESSIONS`; applies to floating tensors only.
    """
    wire = getattr(t, _WIRE_ATTR, None)
    if wire is not None and wire[0] == t._version and wire[1].compression == _LOSSY_TYPES.get(compression):
        msg = runtime_pb2.Tensor()
        msg.CopyFrom(wire[1])
        msg.requires_grad = t.requires_grad
        return msg
    return _encode_tensor(t, compression)


def remember_wire_format(source: torch.Tensor, target: torch.Tensor) -> None:
    """Let ``target`` (e.g. ``source`` moved to another device) reuse ``source``'s received message."""
    wire = getattr(source, _WIRE_ATTR, None)
    if wire is not None and target is not source and wire[0] == source._version:
        setattr(target, _WIRE_ATTR, (target._version, wire[1]))


def _encode_tensor(t: torch.Tensor, compression: str) -> runtime_pb2.Tensor:
    check_compression(compression)
    if not isinstance(t, torch.Tensor):
        raise CodecError(f"encode_tensor expects a torch.Tensor, got {type(t).__name__}")
    dtype_name = _DTYPE_NAMES.get(t.dtype)
    if dtype_name is None:
        raise CodecError(
            f"Tensors of dtype {t.dtype} cannot cross a stage boundary; use one of {list(_DTYPES)}"
        )
    requires_grad = t.requires_grad
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    msg = runtime_pb2.Tensor(size=t.shape, dtype=dtype_name, requires_grad=requires_grad)
    numel = t.numel()
    if not t.is_floating_point() or numel < LOSSLESS_BELOW or compression == "none":
        msg.buffer = _raw_bytes(t)
    elif compression == "fp16":
        if t.dtype in (torch.float16, torch.bfloat16):
            msg.buffer = _raw_bytes(t)
        else:
            with _threads(1):
                msg.buffer = t.to(torch.float16).numpy().tobytes()
            msg.compression = _FLOAT16
    else:  # 8bit
        source = t if t.dtype in _QUANTIZABLE else t.to(torch.float32)
        codes, absmax = _quantize(source)
        msg.buffer = b"".join(
            (BLOCKSIZE.to_bytes(4, "little"), absmax.numpy().tobytes(), codes.numpy().tobytes())
        )
        msg.compression = _BLOCKWISE_8BIT
    return msg


def _frombuffer(buffer: bytes, dtype: torch.dtype, count: int, offset: int = 0) -> torch.Tensor:
    if count == 0:
        return torch.empty(0, dtype=dtype)
    if len(buffer) < _COPY_BELOW:
        buffer = bytearray(buffer)
    return torch.frombuffer(buffer, dtype=dtype, count=count, offset=offset)


def decode_tensor(msg: runtime_pb2.Tensor) -> torch.Tensor:
    """Restore a tensor (original dtype and shape, on CPU) from :func:`encode_tensor`'s message.

    Raises:
        CodecError: the message is malformed, truncated or inconsistent.
    """
    with _threads(1):  # dequantizing is a cheap table lookup: never worth a parallel region
        t = _decode_tensor(msg)
    if msg.compression != _NONE:
        setattr(t, _WIRE_ATTR, (t._version, msg))  # see encode_tensor
    return t


def _decode_tensor(msg: runtime_pb2.Tensor) -> torch.Tensor:
    if not isinstance(msg, runtime_pb2.Tensor):
        raise CodecError(f"decode_tensor expects a runtime_pb2.Tensor, got {type(msg).__name__}")
    dtype = _DTYPES.get(msg.dtype)
    if dtype is None:
        raise CodecError(f"Received a tensor with unsupported dtype {msg.dtype!r}")
    shape = tuple(msg.size)
    numel = math.prod(shape)
    buffer = msg.buffer
    compression = msg.compression
    if compression == _NONE:
        itemsize = torch.empty((), dtype=dtype).element_size()
        if len(buffer) != numel * itemsize:
            raise CodecError(
                f"Received a {msg.dtype} tensor of shape {list(shape)} with {len(buffer)} bytes, "
                f"expected {numel * itemsize}"
            )
        if dtype == torch.bfloat16:
            return _frombuffer(buffer, torch.int16, numel).view(torch.bfloat16).view(shape)
        return _frombuffer(buffer, dtype, numel).view(shape)
    if not dtype.is_floating_point:
        raise CodecError(
            f"Received a {msg.dtype} tensor with lossy compression {compression}; only floats are"
        )
    if compression == _FLOAT16:
        if len(buffer) != numel * 2:
            raise CodecError(
                f"Received an fp16-compressed tensor of shape {list(shape)} with {len(buffer)} bytes, "
                f"expected {numel * 2}"
            )
        return _frombuffer(buffer, torch.float16, numel).view(shape).to(dtype)
    if compression == _BLOCKWISE_8BIT:
        if len(buffer) < 4:
            raise CodecError(f"Received an 8-bit tensor with a truncated header ({len(buffer)} bytes)")
        blocksize = int.from_bytes(buffer[:4], "little")
        if blocksize not in _VALID_BLOCKSIZES:
            raise CodecError(f"Received an 8-bit tensor with invalid block size {blocksize}")
        num_blocks = -(numel // -blocksize)
        expected = 4 + 4 * num_blocks + numel
        if len(buffer) != expected:
            raise CodecError(
                f"Received an 8-bit tensor of shape {list(shape)} with {len(buffer)} bytes, expected {expected}"
            )
        if numel == 0:
            return torch.empty(shape, dtype=dtype)
        absmax = _frombuffer(buffer, torch.float32, num_blocks, offset=4)
        codes = _frombuffer(buffer, torch.uint8, numel, offset=4 + 4 * num_blocks)
        out_dtype = dtype if dtype in _QUANTIZABLE else torch.float32
        values = torch.ops.bitsandbytes.dequantize_blockwise.default(
            codes, absmax, _code(), blocksize, out_dtype
        )
        return values.view(shape).to(dtype)
    raise CodecError(f"Received a tensor with unsupported compression type {compression}")


def nbytes(msgs: Iterable[runtime_pb2.Tensor]) -> int:
    """Bytes these tensor messages take on the wire."""
    return sum(msg.ByteSize() for msg in msgs)


# ---- call signatures: nested Python structures of tensors and plain values ----
# Metadata nodes: plain scalars as themselves; containers as tagged msgpack arrays:
# ["T", index] tensor, ["t", *items] tuple, ["l", *items] list, ["d", k0, v0, k1, v1, ...] dict.
_SCALARS = (type(None), bool, int, float, str, bytes)


def _flatten(obj: Any, tensors: list[torch.Tensor], depth: int) -> Any:
    if depth > _MAX_DEPTH:
        raise CodecError(f"Call arguments are nested deeper than {_MAX_DEPTH} levels")
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return ["T", len(tensors) - 1]
    if isinstance(obj, _SCALARS):
        return obj
    if isinstance(obj, tuple):
        return ["t", *(_flatten(item, tensors, depth + 1) for item in obj)]
    if isinstance(obj, list):
        return ["l", *(_flatten(item, tensors, depth + 1) for item in obj)]
    if isinstance(obj, dict):
        node: list[Any] = ["d"]
        for key, value in obj.items():
            node.append(_flatten(key, tensors, depth + 1))
            node.append(_flatten(value, tensors, depth + 1))
        return node
    raise CodecError(
        f"Cannot send a {type(obj).__name__} across a stage boundary; stage arguments and outputs may contain "
        f"tensors, None, bool, int, float, str, bytes and tuples/lists/dicts of those"
    )


def _rebuild(node: Any, tensors: Sequence[torch.Tensor], depth: int) -> Any:
    if depth > _MAX_DEPTH:
        raise CodecError(f"Metadata is nested deeper than {_MAX_DEPTH} levels")
    if isinstance(node, _SCALARS):
        return node
    if not isinstance(node, list) or not node or not isinstance(node[0], str):
        raise CodecError(f"Malformed metadata node of type {type(node).__name__}")
    tag = node[0]
    if tag == "T":
        if len(node) != 2 or type(node[1]) is not int or not 0 <= node[1] < len(tensors):
            raise CodecError(f"Malformed tensor reference {node!r} ({len(tensors)} tensors received)")
        return tensors[node[1]]
    if tag == "t":
        return tuple(_rebuild(item, tensors, depth + 1) for item in node[1:])
    if tag == "l":
        return [_rebuild(item, tensors, depth + 1) for item in node[1:]]
    if tag == "d":
        if len(node) % 2 != 1:
            raise CodecError("Malformed dict node in metadata (odd number of keys and values)")
        result = {}
        for i in range(1, len(node), 2):
            key = _rebuild(node[i], tensors, depth + 1)
            try:
                result[key] = _rebuild(node[i + 1], tensors, depth + 1)
            except TypeError as e:  # unhashable key
                raise CodecError(f"Malformed dict key in metadata: {e}") from None
        return result
    raise CodecError(f"Unknown metadata tag {tag!r}")


def flatten_tensors(obj: Any) -> tuple[list[torch.Tensor], Any]:
    """Split a nested structure into its tensors (in order) and a msgpack-able skeleton (no I/O)."""
    tensors: list[torch.Tensor] = []
    skeleton = _flatten(obj, tensors, 0)
    return tensors, skeleton


def rebuild_tensors(skeleton: Any, tensors: Sequence[torch.Tensor]) -> Any:
    """Inverse of :func:`flatten_tensors`."""
    return _rebuild(skeleton, tensors, 0)


def pack(args: tuple, kwargs: dict, compression: str) -> tuple[list[runtime_pb2.Tensor], bytes]:
    """Serialize a call signature ``(*args, **kwargs)``.

    Args:
        args: positional arguments (any nesting of tensors and plain values).
        kwargs: keyword arguments (string keys).
        compression: one of :data:`COMPRESSIONS`, applied to the floating tensors.

    Returns:
        the tensor messages (each records its dtype, shape and ``requires_grad``) and the metadata bytes.
    """
    check_compression(compression)
    tensors: list[torch.Tensor] = []
    skeleton = [_flatten(tuple(args), tensors, 0), _flatten(dict(kwargs), tensors, 0), len(tensors)]
    try:
        metadata = msgpack.packb(skeleton, use_bin_type=True)
    except (OverflowError, ValueError, TypeError) as e:
        raise CodecError(f"Cannot serialize call arguments: {e}") from None
    return [encode_tensor(t, compression) for t in tensors], metadata


def unpack(tensors: Sequence[runtime_pb2.Tensor], metadata: bytes) -> tuple[tuple, dict]:
    """Restore ``(args, kwargs)`` from :func:`pack`'s output.

    Floating tensors that were sent with ``requires_grad`` come back as leaves that require grad.

    Raises:
        CodecError: the metadata or a tensor is malformed, or they do not match each other.
    """
    try:
        skeleton = msgpack.unpackb(metadata, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises many types on garbage
        raise CodecError(f"Malformed call metadata ({type(e).__name__}: {e})") from None
    if not isinstance(skeleton, list) or len(skeleton) != 3 or type(skeleton[2]) is not int:
        raise CodecError("Malformed call metadata: expected [args, kwargs, num_tensors]")
    if skeleton[2] != len(tensors):
        raise CodecError(f"Call metadata describes {skeleton[2]} tensors but {len(tensors)} were received")
    decoded = []
    for msg in tensors:
        t = decode_tensor(msg)
        if msg.requires_grad and t.is_floating_point():
            t.requires_grad_(True)
        decoded.append(t)
    args = _rebuild(skeleton[0], decoded, 0)
    kwargs = _rebuild(skeleton[1], decoded, 0)
    if (
        not isinstance(args, tuple)
        or not isinstance(kwargs, dict)
        or not all(isinstance(k, str) for k in kwargs)
    ):
        raise CodecError("Malformed call metadata: args must be a tuple and kwargs a dict with string keys")
    return args, kwargs
