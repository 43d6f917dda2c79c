"""Boundary codec: how activations and gradients cross stage boundaries.

Every tensor that travels between a trainer and a stage server is one or more ``runtime_pb2.Tensor`` *parts*
(:func:`encode_parts`): block-aligned slices of the flattened tensor, each decodable on its own, so that large
tensors can be streamed with encoding, transfer and decoding overlapped. Payloads that travel in one message
use one part per tensor. Floating tensors are compressed with one of :data:`COMPRESSIONS`:

- ``"8bit"``: bitsandbytes dynamic blockwise quantization (SWARM's boundary compression), about 1/4 of the
  fp32 bytes. Buffer layout: ``uint32 blocksize | float32 absmax[num_blocks] | uint8 codes[numel]``. The
  kernel is bitsandbytes' own, run in block-aligned shares by this thread and idle helper threads.
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
import ctypes
import math
import os
import threading
import warnings
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import bitsandbytes.functional as bnb_functional
import msgpack
import torch
from hivemind.proto import runtime_pb2

__all__ = [
    "COMPRESSIONS",
    "CodecError",
    "LazyPack",
    "PartsDecoder",
    "decode_parts",
    "decode_tensor",
    "encode_parts",
    "encode_tensor",
    "nbytes",
    "pack",
    "rebuild_call",
    "unpack",
]

COMPRESSIONS = ("8bit", "fp16", "none")
BLOCKSIZE = 1024  # absmax overhead 0.4%; accuracy barely depends on it (64..4096 measured within 20%)
LOSSLESS_BELOW = 1024  # floating tensors with fewer elements are sent as they are
_VALID_BLOCKSIZES = (64, 128, 256, 512, 1024, 2048, 4096)
PART_ELEMENTS = 64 * BLOCKSIZE  # elements per part of a large tensor: the unit of pipelined sending
_MAX_CHUNKS = 1 << 20
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
        code = bnb_functional.create_dynamic_map().to(torch.float32)
        # bitsandbytes' CPU quantizer overwrites code[0] (-0.993) with -1.0 in the tensor it is given; fix it
        # up front so that a peer that never quantized decodes index 0 like the peer that encoded it
        code[0] = -1.0
        _dynamic_code = code
    return _dynamic_code


def _find_omp() -> Any:
    """The OpenMP runtime torch uses (bitsandbytes shares it), for per-thread settings; None if not found."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line or "libiomp" in line}
        for path in sorted(paths):
            # PyDLL keeps the GIL: releasing it around a 10 ns call may cost a thread switch
            lib = ctypes.PyDLL(path)
            lib.omp_set_num_threads  # noqa: B018 (raises AttributeError if this is not an OpenMP runtime)
            return lib
    except (OSError, AttributeError):
        pass
    return None


_omp = _find_omp()


@contextlib.contextmanager
def _threads(count: int) -> Iterator[None]:
    """Run torch/bitsandbytes kernels on ``count`` OpenMP threads in this thread only.

    ``torch.set_num_threads`` also changes a process-wide default that new threads start from, so the OpenMP
    setting of the calling thread is changed directly where the runtime is found.
    """
    previous = torch.get_num_threads()  # also lets torch initialise this thread's setting before we change it
    setter = torch.set_num_threads if _omp is None else _omp.omp_set_num_threads
    if previous == count:
        yield
        return
    setter(count)
    try:
        yield
    finally:
        setter(previous)


class _QuantizeCounter:
    """Counts quantizations (tests use it to check that a message was re-sent, not re-quantized)."""

    def __init__(self) -> None:
        self.calls = 0
        self.lock = threading.Lock()

    def add(self) -> None:
        with self.lock:
            self.calls += 1


_quantizations = _QuantizeCounter()


def _helper_count() -> int:
    value = os.environ.get("LIGHTNING_SWARM_CODEC_HELPERS")
    if value is None:
        return min((os.cpu_count() or 1) - 1, 3)
    if not value.strip().isdigit():
        raise ValueError(
            f"LIGHTNING_SWARM_CODEC_HELPERS must be a non-negative integer (threads that help quantize; 0 for "
            f"none), got {value!r}"
        )
    return int(value)


# Idle threads that help quantize large tensors (0 turns them off); see _quantize_to_buffer.
_HELPERS = _helper_count()
_SHARE_ELEMENTS = 32 * BLOCKSIZE  # the unit of work the threads claim
_pool: ThreadPoolExecutor | None = None
_pool_pid: int | None = None
_pool_lock = threading.Lock()


def _helpers() -> ThreadPoolExecutor:
    global _pool, _pool_pid
    with _pool_lock:
        if _pool is None or _pool_pid != os.getpid():  # a forked child has none of its parent's threads
            _pool = ThreadPoolExecutor(max_workers=_HELPERS, thread_name_prefix="swarm-codec")
            _pool_pid = os.getpid()
        return _pool


def _native_kernels() -> tuple[Any, Any]:
    """bitsandbytes' CPU kernels for float32 blockwise (de)quantization; ``(None, None)`` where unavailable."""
    try:
        from bitsandbytes.cextension import ErrorHandlerMockBNBNativeLibrary, lib
    except ImportError:
        return None, None
    if isinstance(lib, ErrorHandlerMockBNBNativeLibrary):
        return None, None
    return getattr(lib, "cquantize_blockwise_cpu_fp32", None), getattr(
        lib, "cdequantize_blockwise_cpu_fp32", None
    )


_native_quantize, _native_dequantize = _native_kernels()


class _Shares:
    """Block-aligned shares of one quantization, done by whichever thread claims them first.

    Each share runs bitsandbytes' kernel on a range of whole blocks, writing codes and block scales straight
    into the final buffer, so the result is bit-identical to one call on the whole tensor.
    """

    def __init__(self, numel: int, source: int, absmax: int, codes: int):
        shares = min(64, numel // _SHARE_ELEMENTS) if _HELPERS > 0 else 1
        self.bounds = part_bounds(numel, max(1, shares))
        self.pointers = (source, absmax, codes, _code().data_ptr())
        self.next = 0
        self.lock = threading.Lock()

    def run(self) -> None:
        """Do the work with as many idle helper threads as there are spare shares."""
        helping = [_helpers().submit(self.work) for _ in range(min(_HELPERS, len(self.bounds) - 2))]
        self.work()
        for future in helping:
            future.result()

    def work(self) -> None:
        source, absmax, codes, code = self.pointers
        with _threads(1):
            while True:
                with self.lock:
                    index = self.next
                    if index >= len(self.bounds) - 1:
                        return
                    self.next += 1
                lo, hi = self.bounds[index], self.bounds[index + 1]
                _native_quantize(  # (code, A, absmax, out, blocksize, n)
                    ctypes.c_void_p(code),
                    ctypes.c_void_p(source + 4 * lo),
                    ctypes.c_void_p(absmax + 4 * (lo // BLOCKSIZE)),
                    ctypes.c_void_p(codes + lo),
                    ctypes.c_longlong(BLOCKSIZE),
                    ctypes.c_longlong(hi - lo),
                )


def _quantize_to_buffer(source: torch.Tensor) -> bytes:
    """The 8-bit wire buffer of ``source``: ``uint32 blocksize | float32 absmax[blocks] | uint8 codes[numel]``.

    bitsandbytes' dynamic blockwise quantization, always on one OpenMP thread per caller: its kernel is an
    OpenMP loop, but OpenMP workers spin for milliseconds after each parallel region and so starve the p2p
    daemons and peers that share the cores (while choosing this design, a 1 MiB hop measured
    19 ms with two OpenMP threads against 11 ms with one).
    Instead, blocks are independent: a large tensor is cut at block boundaries into shares that this thread and
    idle helper threads (which sleep when idle) claim one by one, each writing into the final buffer.
    """
    _quantizations.add()
    flat = source.reshape(-1)
    numel = flat.numel()
    num_blocks = -(numel // -BLOCKSIZE)
    header = BLOCKSIZE.to_bytes(4, "little")
    if _native_quantize is None or flat.dtype != torch.float32:
        with _threads(1):
            codes, absmax = torch.ops.bitsandbytes.quantize_blockwise.default(flat, _code(), BLOCKSIZE)
        return b"".join((header, absmax.numpy().tobytes(), codes.numpy().tobytes()))
    flat = flat.contiguous()
    buffer = torch.empty(4 + 4 * num_blocks + numel, dtype=torch.uint8)
    buffer[:4] = torch.frombuffer(bytearray(header), dtype=torch.uint8)
    base = buffer.data_ptr()
    _Shares(numel, flat.data_ptr(), base + 4, base + 4 + 4 * num_blocks).run()
    return buffer.numpy().tobytes()


def _dequantize_buffer(buffer: bytes, blocksize: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`_quantize_to_buffer` (the buffer is already validated)."""
    num_blocks = -(numel // -blocksize)
    if _native_dequantize is None or dtype != torch.float32:
        absmax = _frombuffer(buffer, torch.float32, num_blocks, offset=4)
        codes = _frombuffer(buffer, torch.uint8, numel, offset=4 + 4 * num_blocks)
        out_dtype = dtype if dtype in _QUANTIZABLE else torch.float32
        with _threads(1):
            return torch.ops.bitsandbytes.dequantize_blockwise.default(
                codes, absmax, _code(), blocksize, out_dtype
            )
    view = _frombuffer(buffer, torch.uint8, len(buffer))  # zero-copy; keeps ``buffer`` alive during the call
    base = view.data_ptr()
    out = torch.empty(numel, dtype=torch.float32)
    with _threads(1):  # memory-bound: one thread, no helpers
        _native_dequantize(  # (code, codes, absmax, out, blocksize, n)
            ctypes.c_void_p(_code().data_ptr()),
            ctypes.c_void_p(base + 4 + 4 * num_blocks),
            ctypes.c_void_p(base + 4),
            ctypes.c_void_p(out.data_ptr()),
            ctypes.c_longlong(blocksize),
            ctypes.c_longlong(numel),
        )
    return out


def check_compression(compression: str) -> str:
    """Return ``compression`` if it is one of :data:`COMPRESSIONS`, else raise a ``ValueError`` saying so."""
    if compression not in COMPRESSIONS:
        raise ValueError(f"Unknown boundary compression {compression!r}; use one of {COMPRESSIONS}")
    return compression


def _raw_bytes(t: torch.Tensor) -> bytes:
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: ship the bit pattern
        t = t.view(torch.int16)
    return t.numpy().tobytes()


def num_parts(numel: int) -> int:
    """How many parts a tensor of ``numel`` elements is sent in (see :func:`encode_parts`)."""
    return max(1, min(_MAX_CHUNKS, -(numel // -PART_ELEMENTS)))


def part_bounds(numel: int, chunks: int) -> list[int]:
    """Element offsets of the ``chunks`` parts of a flat tensor: block-aligned, as even as possible."""
    units = -(numel // -BLOCKSIZE)
    return [min(numel, (units * i // chunks) * BLOCKSIZE) for i in range(chunks + 1)]


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
    if wire is None or wire[0] != t._version or wire[1][0].compression != _LOSSY_TYPES.get(compression):
        return None
    first = runtime_pb2.Tensor()
    first.CopyFrom(wire[1][0])
    first.requires_grad = t.requires_grad
    return [first, *wire[1][1:]]


def remember_wire_format(source: torch.Tensor, target: torch.Tensor) -> None:
    """Let ``target`` (e.g. ``source`` moved to another device) reuse ``source``'s received parts."""
    wire = getattr(source, _WIRE_ATTR, None)
    if wire is not None and target is not source and wire[0] == source._version:
        setattr(target, _WIRE_ATTR, (target._version, wire[1]))


def _encode_parts(t: torch.Tensor, compression: str, chunks: int | None) -> Iterator[runtime_pb2.Tensor]:
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
    flat = t.contiguous().view(-1)
    numel = flat.numel()
    if not t.is_floating_point() or numel < LOSSLESS_BELOW or compression == "none":
        mode = "none"
    elif compression == "fp16" and t.dtype in (torch.float16, torch.bfloat16):
        mode = "none"  # already 16-bit (bfloat16 would overflow in fp16)
    else:
        mode = compression
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
            with _threads(1):
                msg.buffer = part.to(torch.float16).numpy().tobytes()
            msg.compression = _FLOAT16
        else:  # 8bit
            source = part if part.dtype in _QUANTIZABLE else part.to(torch.float32)
            msg.buffer = _quantize_to_buffer(source)
            msg.compression = _BLOCKWISE_8BIT
        yield msg


def _frombuffer(buffer: bytes, dtype: torch.dtype, count: int, offset: int = 0) -> torch.Tensor:
    if count == 0:
        return torch.empty(0, dtype=dtype)
    if len(buffer) < _COPY_BELOW:
        buffer = bytearray(buffer)
    return torch.frombuffer(buffer, dtype=dtype, count=count, offset=offset)


def decode_tensor(msg: runtime_pb2.Tensor) -> torch.Tensor:
    """Restore a tensor (original dtype and shape, on CPU) from :func:`encode_tensor`'s message.

    Raises:
        CodecError: the message is malformed, truncated, inconsistent or only the first of several parts.
    """
    return decode_parts([msg])[0]


def decode_parts(parts: Iterable[runtime_pb2.Tensor]) -> list[torch.Tensor]:
    """Restore every tensor from a sequence of parts (see :func:`encode_parts`); raises ``CodecError``."""
    decoder = PartsDecoder()
    for part in parts:
        decoder.feed(part)
    return decoder.finish()


class PartsDecoder:
    """Decodes a stream of tensor parts one part at a time, as they arrive.

    ``feed`` each received part in order; ``finish`` returns the tensors. Floating tensors sent with
    ``requires_grad`` come back as leaves that require grad. Anything malformed raises :class:`CodecError`.
    """

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self._first: runtime_pb2.Tensor | None = None
        self._dtype = torch.float32
        self._shape: tuple[int, ...] = ()
        self._bounds: list[int] = []
        self._parts: list[runtime_pb2.Tensor] = []
        self._decoded: list[torch.Tensor] = []

    def feed(self, msg: runtime_pb2.Tensor) -> None:
        """Decode one part (the first part of a tensor starts a new one)."""
        if not isinstance(msg, runtime_pb2.Tensor):
            raise CodecError(f"decode_tensor expects a runtime_pb2.Tensor, got {type(msg).__name__}")
        if self._first is None:
            self._start(msg)
        elif msg.compression != self._first.compression:
            raise CodecError("Received a tensor whose parts use different compressions")
        index = len(self._decoded)
        numel = self._bounds[index + 1] - self._bounds[index]
        with _threads(1):  # dequantizing is a cheap table lookup: never worth a parallel region
            self._decoded.append(
                _decode_part(msg.buffer, msg.compression, self._dtype, self._first.dtype, numel)
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
        if msg.compression not in (_NONE, _FLOAT16, _BLOCKWISE_8BIT):
            raise CodecError(f"Received a tensor with unsupported compression type {msg.compression}")
        shape = tuple(msg.size)
        numel = math.prod(shape)
        chunks = max(1, msg.chunks)
        if chunks > max(1, -(numel // -BLOCKSIZE)):
            raise CodecError(f"Received a tensor of shape {list(shape)} in an impossible {chunks} parts")
        self._first, self._dtype, self._shape = msg, dtype, shape
        self._bounds = part_bounds(numel, chunks)

    def _complete(self) -> None:
        first, decoded, parts = self._first, self._decoded, self._parts
        assert first is not None
        if len(decoded) == 1:
            t = decoded[0]
        else:
            with _threads(1):
                t = torch.cat(decoded)
        t = t.view(self._shape)
        if first.compression != _NONE:
            setattr(t, _WIRE_ATTR, (t._version, parts))  # see encode_parts
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
                f"Received an 8-bit part of {numel} elements with {len(buffer)} bytes, expected {expected}"
            )
        if numel == 0:
            return torch.empty(0, dtype=dtype)
        return _dequantize_buffer(buffer, blocksize, numel, dtype).to(dtype)
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
        the tensor parts (see :func:`encode_parts`) and the metadata bytes.
    """
    call = LazyPack(args, kwargs, compression, split_above=math.inf)
    return list(call.parts()), call.metadata


class LazyPack:
    """A call signature whose metadata is ready at once and whose tensor parts are encoded on demand.

    :meth:`parts` yields the parts in order, encoding each the first time it is reached and replaying it
    afterwards (a retry re-sends what was already encoded). Not thread-safe: one thread iterates at a time.

    Args:
        args, kwargs, compression: as for :func:`pack`.
        split_above: large tensors are cut into :func:`num_parts` parts (for streaming) when the payload's
            estimated size exceeds this many bytes; otherwise every tensor is one part.
    """

    def __init__(self, args: tuple, kwargs: dict, compression: str, split_above: float = 0.0):
        check_compression(compression)
        tensors: list[torch.Tensor] = []
        skeleton = [_flatten(tuple(args), tensors, 0), _flatten(dict(kwargs), tensors, 0), len(tensors)]
        try:
            self.metadata: bytes = msgpack.packb(skeleton, use_bin_type=True)
        except (OverflowError, ValueError, TypeError) as e:
            raise CodecError(f"Cannot serialize call arguments: {e}") from None
        self.num_tensors = len(tensors)
        self.estimated_bytes = len(self.metadata) + sum(_estimated_bytes(t, compression) for t in tensors)
        split = self.estimated_bytes > split_above
        self._pending = (part for t in tensors for part in encode_parts(t, compression, split))
        self._done: list[runtime_pb2.Tensor] = []
        self._complete = False

    def parts(self) -> Iterator[runtime_pb2.Tensor]:
        """Every part, in order (encoded lazily the first time)."""
        index = 0
        while True:
            if index == len(self._done):
                part = None if self._complete else next(self._pending, None)
                if part is None:
                    self._complete = True
                    return
                self._done.append(part)
            yield self._done[index]
            index += 1


def _estimated_bytes(t: torch.Tensor, compression: str) -> int:
    """About how many bytes ``t`` takes on the wire (before encoding it)."""
    numel = t.numel()
    if not t.is_floating_point() or numel < LOSSLESS_BELOW or compression == "none":
        return numel * t.element_size()
    if compression == "fp16":
        return numel * 2
    return numel + 4 * -(numel // -BLOCKSIZE) + 4


def unpack(tensors: Sequence[runtime_pb2.Tensor], metadata: bytes) -> tuple[tuple, dict]:
    """Restore ``(args, kwargs)`` from :func:`pack`'s output.

    Floating tensors that were sent with ``requires_grad`` come back as leaves that require grad.

    Raises:
        CodecError: the metadata or a tensor is malformed, or they do not match each other.
    """
    skeleton = _parse_metadata(metadata)
    return rebuild_call(skeleton, decode_parts(tensors))


def _parse_metadata(metadata: bytes) -> Any:
    try:
        skeleton = msgpack.unpackb(metadata, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises many types on garbage
        raise CodecError(f"Malformed call metadata ({type(e).__name__}: {e})") from None
    if not isinstance(skeleton, list) or len(skeleton) != 3 or type(skeleton[2]) is not int:
        raise CodecError("Malformed call metadata: expected [args, kwargs, num_tensors]")
    return skeleton


def rebuild_call(metadata: bytes | Any, decoded: Sequence[torch.Tensor]) -> tuple[tuple, dict]:
    """``(args, kwargs)`` from call metadata (bytes, or already parsed) and the decoded tensors."""
    skeleton = _parse_metadata(metadata) if isinstance(metadata, bytes) else metadata
    if skeleton[2] != len(decoded):
        raise CodecError(f"Call metadata describes {skeleton[2]} tensors but {len(decoded)} were received")
    args = _rebuild(skeleton[0], decoded, 0)
    kwargs = _rebuild(skeleton[1], decoded, 0)
    if (
        not isinstance(args, tuple)
        or not isinstance(kwargs, dict)
        or not all(isinstance(k, str) for k in kwargs)
    ):
        raise CodecError("Malformed call metadata: args must be a tuple and kwargs a dict with string keys")
    return args, kwargs
