"""The 8-bit kernel: bitsandbytes' dynamic blockwise quantization, run straight into a wire buffer.

The codec (:mod:`.codec`) calls :func:`quantize_to_buffer` / :func:`dequantize_buffer`; everything about
threads lives here. bitsandbytes' CPU kernel is an OpenMP loop, but OpenMP workers spin for milliseconds after
each parallel region and so starve the p2p daemons and peers sharing the cores (while choosing this design, a
1 MiB hop measured 19 ms with two OpenMP threads against 11 ms with one). So every kernel call runs on one
OpenMP thread of its caller, and a large tensor is cut at block boundaries into *shares* that the caller and
idle helper threads (which sleep when idle) claim one by one, each writing into the final buffer: the result
is bit-identical to one call on the whole tensor.

Nothing happens at import: the OpenMP runtime, the native kernels and ``LIGHTNING_SWARM_CODEC_HELPERS`` are
looked up on first use.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

__all__ = [
    "BLOCKSIZE",
    "HELPERS_ENV",
    "dequantize_buffer",
    "helper_count",
    "one_thread",
    "part_bounds",
    "quantize_to_buffer",
]

BLOCKSIZE = 1024  # absmax overhead 0.4%; accuracy barely depends on it (64..4096 measured within 20%)
VALID_BLOCKSIZES = (64, 128, 256, 512, 1024, 2048, 4096)
HELPERS_ENV = "LIGHTNING_SWARM_CODEC_HELPERS"
_SHARE_ELEMENTS = 32 * BLOCKSIZE  # the unit of work the threads claim


@functools.cache
def dynamic_code() -> torch.Tensor:
    """bitsandbytes' dynamic 8-bit code, with ``code[0]`` fixed to -1.0.

    bitsandbytes' CPU quantizer overwrites code[0] (-0.993) with -1.0 in the tensor it is given; fixing it up
    front makes a peer that never quantized decode index 0 like the peer that encoded it.
    """
    import bitsandbytes.functional as bnb_functional

    code = bnb_functional.create_dynamic_map().to(torch.float32)
    code[0] = -1.0
    return code


@functools.cache
def _omp() -> Any:
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


@contextlib.contextmanager
def one_thread(count: int = 1) -> Iterator[None]:
    """Run torch/bitsandbytes kernels on ``count`` OpenMP threads in this thread only.

    ``torch.set_num_threads`` also changes a process-wide default that new threads start from, so the OpenMP
    setting of the calling thread is changed directly where the runtime is found.
    """
    previous = torch.get_num_threads()  # also lets torch initialise this thread's setting before we change it
    if previous == count:
        yield
        return
    omp = _omp()
    setter = torch.set_num_threads if omp is None else omp.omp_set_num_threads
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


quantizations = _QuantizeCounter()


def helper_count() -> int:
    """Idle threads that help quantize large tensors: ``LIGHTNING_SWARM_CODEC_HELPERS``, else cores - 1 (max 3).

    Read on every call (cheap), so the setting may change while the process runs.
    """
    value = os.environ.get(HELPERS_ENV)
    if value is None:
        return min((os.cpu_count() or 1) - 1, 3)
    if not value.strip().isdigit():
        raise ValueError(
            f"{HELPERS_ENV} must be a non-negative integer (threads that help quantize; 0 for none), got {value!r}"
        )
    return int(value)


_pool: ThreadPoolExecutor | None = None
_pool_pid: int | None = None
_pool_lock = threading.Lock()


def _helpers(count: int) -> ThreadPoolExecutor:
    global _pool, _pool_pid
    with _pool_lock:
        # a forked child has none of its parent's threads; a larger setting needs a larger pool
        if _pool is None or _pool_pid != os.getpid() or _pool._max_workers < count:
            _pool = ThreadPoolExecutor(max_workers=max(1, count), thread_name_prefix="swarm-codec")
            _pool_pid = os.getpid()
        return _pool


@functools.cache
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


def part_bounds(numel: int, chunks: int) -> list[int]:
    """Element offsets of ``chunks`` pieces of a flat tensor: block-aligned, as even as possible."""
    units = -(numel // -BLOCKSIZE)
    return [min(numel, (units * i // chunks) * BLOCKSIZE) for i in range(chunks + 1)]


class _Shares:
    """Block-aligned shares of one quantization, done by whichever thread claims them first."""

    def __init__(self, kernel: Any, numel: int, source: int, absmax: int, codes: int, helpers: int):
        shares = min(64, numel // _SHARE_ELEMENTS) if helpers > 0 else 1
        self.kernel, self.helpers = kernel, helpers
        self.bounds = part_bounds(numel, max(1, shares))
        self.pointers = (source, absmax, codes, dynamic_code().data_ptr())
        self.next = 0
        self.lock = threading.Lock()

    def run(self) -> None:
        """Do the work with as many idle helper threads as there are spare shares."""
        count = min(self.helpers, len(self.bounds) - 2)
        helping = [_helpers(self.helpers).submit(self.work) for _ in range(count)] if count > 0 else []
        self.work()
        for future in helping:
            future.result()

    def work(self) -> None:
        source, absmax, codes, code = self.pointers
        with one_thread():
            while True:
                with self.lock:
                    index = self.next
                    if index >= len(self.bounds) - 1:
                        return
                    self.next += 1
                lo, hi = self.bounds[index], self.bounds[index + 1]
                self.kernel(  # (code, A, absmax, out, blocksize, n)
                    ctypes.c_void_p(code),
                    ctypes.c_void_p(source + 4 * lo),
                    ctypes.c_void_p(absmax + 4 * (lo // BLOCKSIZE)),
                    ctypes.c_void_p(codes + lo),
                    ctypes.c_longlong(BLOCKSIZE),
                    ctypes.c_longlong(hi - lo),
                )


def quantize_to_buffer(source: torch.Tensor) -> bytes:
    """The 8-bit buffer of a float tensor: ``uint32 blocksize | float32 absmax[blocks] | uint8 codes[numel]``."""
    quantizations.add()
    flat = source.reshape(-1)
    numel = flat.numel()
    num_blocks = -(numel // -BLOCKSIZE)
    header = BLOCKSIZE.to_bytes(4, "little")
    kernel, _ = _native_kernels()
    if kernel is None or flat.dtype != torch.float32:
        with one_thread():
            codes, absmax = torch.ops.bitsandbytes.quantize_blockwise.default(flat, dynamic_code(), BLOCKSIZE)
        return b"".join((header, absmax.numpy().tobytes(), codes.numpy().tobytes()))
    flat = flat.contiguous()
    buffer = torch.empty(4 + 4 * num_blocks + numel, dtype=torch.uint8)
    buffer[:4] = torch.tensor(list(header), dtype=torch.uint8)
    base = buffer.data_ptr()
    _Shares(kernel, numel, flat.data_ptr(), base + 4, base + 4 + 4 * num_blocks, helper_count()).run()
    return buffer.numpy().tobytes()


def dequantize_buffer(buffer: bytes, blocksize: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`quantize_to_buffer` (the caller has validated the buffer's length and block size)."""
    num_blocks = -(numel // -blocksize)
    _, kernel = _native_kernels()
    if kernel is None or dtype != torch.float32:
        view = memoryview(buffer)
        absmax = torch.frombuffer(bytearray(view[4 : 4 + 4 * num_blocks]), dtype=torch.float32)
        codes = torch.frombuffer(bytearray(view[4 + 4 * num_blocks :]), dtype=torch.uint8)
        out_dtype = dtype if dtype in (torch.float32, torch.float16, torch.bfloat16) else torch.float32
        with one_thread():
            return torch.ops.bitsandbytes.dequantize_blockwise.default(
                codes, absmax, dynamic_code(), blocksize, out_dtype
            )
    # bytes objects are immutable: read them through a pointer (no copy, no writable view of them)
    base = ctypes.cast(ctypes.c_char_p(buffer), ctypes.c_void_p).value
    out = torch.empty(numel, dtype=torch.float32)
    with one_thread():  # memory-bound: one thread, no helpers
        kernel(  # (code, codes, absmax, out, blocksize, n)
            ctypes.c_void_p(dynamic_code().data_ptr()),
            ctypes.c_void_p(base + 4 + 4 * num_blocks),
            ctypes.c_void_p(base + 4),
            ctypes.c_void_p(out.data_ptr()),
            ctypes.c_longlong(blocksize),
            ctypes.c_longlong(numel),
        )
    return out
