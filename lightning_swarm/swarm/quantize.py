"""The 8-bit kernel: bitsandbytes' dynamic blockwise quantization, run straight into a wire buffer.

The codec (:mod:`.codec`) calls :func:`quantize_to_buffer` / :func:`dequantize_buffer`; everything about
kernels and threads lives here.

Two kernels give the same bytes:

- the *fast* one (``_q8.c``, ~6x faster than bitsandbytes' on one core): bitsandbytes' quantizer maps each
  value, divided by its block's absmax, to a code with a bucketed search; that mapping depends only on the
  normalised float32 value, so it is tabulated once per process, from bitsandbytes' own kernel, by the value's
  top 16 bits (one threshold per bucket at most; every float in [-1, 1] is checked by
  ``benchmarks/quantizer_exhaustive.py``). The C file is compiled with the system compiler on first use and
  cached under ``~/.cache/lightning-swarm`` (``$XDG_CACHE_HOME``); a self-check against bitsandbytes runs when
  it is loaded. ``LIGHTNING_SWARM_NATIVE_CODEC=0`` turns it off.
- bitsandbytes' CPU kernels, called directly (where no compiler is found, or the fast kernel is turned off).

bitsandbytes' CPU kernel is an OpenMP loop, but OpenMP workers spin for milliseconds after
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
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

__all__ = [
    "BLOCKSIZE",
    "HELPERS_ENV",
    "NATIVE_ENV",
    "dequantize_buffer",
    "helper_count",
    "one_thread",
    "part_bounds",
    "quantize_to_buffer",
    "using_fast_kernel",
]

logger = logging.getLogger(__name__)

BLOCKSIZE = 1024  # absmax overhead 0.4%; accuracy barely depends on it (64..4096 measured within 20%)
VALID_BLOCKSIZES = (64, 128, 256, 512, 1024, 2048, 4096)
HELPERS_ENV = "LIGHTNING_SWARM_CODEC_HELPERS"
NATIVE_ENV = "LIGHTNING_SWARM_NATIVE_CODEC"
_SHARE_ELEMENTS = 32 * BLOCKSIZE  # the unit of work the threads claim


def _import_bitsandbytes() -> None:
    """Import bitsandbytes (on first use) without its import-time notice about an optional package that does not
    concern us (see :mod:`.logs`); every other bitsandbytes message is left as it is."""
    from .logs import quiet_bitsandbytes_import

    quiet_bitsandbytes_import()
    import bitsandbytes  # noqa: F401  (registers torch.ops.bitsandbytes)


@functools.cache
def dynamic_code() -> torch.Tensor:
    """bitsandbytes' dynamic 8-bit code, with ``code[0]`` fixed to -1.0.

    bitsandbytes' CPU quantizer overwrites code[0] (-0.993) with -1.0 in the tensor it is given; fixing it up
    front makes a peer that never quantized decode index 0 like the peer that encoded it.
    """
    _import_bitsandbytes()
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
        return min(_cpu_count() - 1, 3)
    if not value.strip().isdigit():
        raise ValueError(
            f"{HELPERS_ENV} must be a non-negative integer (threads that help quantize; 0 for none), got {value!r}"
        )
    return int(value)


@functools.cache
def _cpu_count() -> int:
    return os.cpu_count() or 1  # ~50 us a call: it reads /sys


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
        _import_bitsandbytes()
        from bitsandbytes.cextension import ErrorHandlerMockBNBNativeLibrary, lib
    except ImportError:
        return None, None
    if isinstance(lib, ErrorHandlerMockBNBNativeLibrary):
        return None, None
    return getattr(lib, "cquantize_blockwise_cpu_fp32", None), getattr(
        lib, "cdequantize_blockwise_cpu_fp32", None
    )


def _run_native(kernel: Any, code: int, source: int, middle: int, out: int, blocksize: int, n: int) -> None:
    """One call of a bitsandbytes CPU kernel on one OpenMP thread of the caller: ``quantize(code, A, absmax, out,
    blocksize, n)`` or ``dequantize(code, codes, absmax, out, blocksize, n)`` (pointers as integers)."""
    with one_thread():
        kernel(
            ctypes.c_void_p(code),
            ctypes.c_void_p(source),
            ctypes.c_void_p(middle),
            ctypes.c_void_p(out),
            ctypes.c_longlong(blocksize),
            ctypes.c_longlong(n),
        )


def part_bounds(numel: int, chunks: int) -> list[int]:
    """Element offsets of ``chunks`` pieces of a flat tensor: block-aligned, as even as possible."""
    units = -(numel // -BLOCKSIZE)
    return [min(numel, (units * i // chunks) * BLOCKSIZE) for i in range(chunks + 1)]


class _Shares:
    """Block-aligned shares of one quantization, done by whichever thread claims them first.

    ``kernel(lo, hi)`` quantizes elements ``[lo, hi)`` (block-aligned) into their final place. The caller waits
    for the shares to be done, not for the helpers: a helper that wakes up after the caller took every share
    (a busy machine) costs the caller nothing.
    """

    def __init__(self, kernel: Any, numel: int, helpers: int):
        shares = min(64, numel // _SHARE_ELEMENTS) if helpers > 0 else 1
        self.kernel, self.helpers = kernel, helpers
        self.bounds = part_bounds(numel, max(1, shares))
        self.total = len(self.bounds) - 1
        self.next = self.done = 0
        self.error: BaseException | None = None
        self.lock = threading.Lock()
        self.finished = threading.Condition(self.lock)

    def run(self) -> None:
        """Do the work with as many idle helper threads as there are spare shares."""
        count = min(self.helpers, self.total - 1)
        for _ in range(count):
            _helpers(self.helpers).submit(self.work)
        self.work()
        with self.lock:
            while self.done < self.total:
                self.finished.wait()
        if self.error is not None:
            raise self.error

    def work(self) -> None:
        while True:
            with self.lock:
                index = self.next
                if index >= self.total:
                    return
                self.next += 1
            try:
                self.kernel(self.bounds[index], self.bounds[index + 1])
            except BaseException as e:  # re-raised by run(), in the caller's thread
                self.error = e
            finally:
                with self.lock:
                    self.done += 1
                    if self.done == self.total:
                        self.finished.notify_all()


# ---- the fast kernel ----

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_q8.c")
_CFLAGS = ("-O3", "-std=c99", "-fPIC", "-shared")
_MAX_BLOCK = 4096  # LS_MAX_BLOCK in _q8.c


class _FastKernel:
    """The compiled ``_q8.c`` and its mapping table."""

    def __init__(self, lib: ctypes.CDLL, table: torch.Tensor, thresholds: torch.Tensor) -> None:
        self.lib, self.table, self.thresholds = lib, table, thresholds
        self.table_ptr = table.data_ptr()
        self.code_ptr = dynamic_code().data_ptr()

    def quantize(self, source: int, absmax: int, codes: int, lo: int, hi: int, blocksize: int) -> None:
        self.lib.ls_quantize(
            source + 4 * lo, hi - lo, blocksize, self.table_ptr, absmax + 4 * (lo // blocksize), codes + lo
        )

    def dequantize(self, codes: int, absmax: int, out: int, numel: int, blocksize: int) -> None:
        self.lib.ls_dequantize(self.code_ptr, codes, absmax, out, numel, blocksize)


def _cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "lightning-swarm")


def _build(compiler: str, target: str) -> str | None:
    """``target`` (built now unless it exists), or ``None`` if it could not be built there."""
    directory = os.path.dirname(target)
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        info = os.stat(directory)
    except OSError as e:
        logger.info(f"Cannot use {directory} for the fast 8-bit kernel: {e}")
        return None
    if info.st_uid != os.getuid() or info.st_mode & 0o022:  # a library others could replace is never loaded
        logger.info(f"Not using {directory} for the fast 8-bit kernel: owned or writable by another user")
        return None
    if os.path.exists(target):
        return target
    partial = f"{target}.{os.getpid()}.{threading.get_ident()}.part"
    try:
        subprocess.run(
            [compiler, *_CFLAGS, "-o", partial, _SOURCE], check=True, capture_output=True, timeout=120
        )
        os.replace(partial, target)  # atomic: concurrent builders each write their own file
        return target
    except (OSError, subprocess.SubprocessError) as e:
        detail = (getattr(e, "stderr", b"") or b"").decode(errors="replace")[:500]
        logger.info(f"Could not build the fast 8-bit kernel in {directory} ({e}; {detail})")
        with contextlib.suppress(OSError):
            os.unlink(partial)
        return None


def _compile() -> ctypes.CDLL | None:
    """Build ``_q8.c`` (once per machine: cached by the hash of source, flags and compiler) and load it."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        logger.info(
            "No C compiler found: the 8-bit codec uses bitsandbytes' kernels (same output, ~6x slower)"
        )
        return None
    with open(_SOURCE, "rb") as f:
        source = f.read()
    key = hashlib.sha256(
        source + repr((_CFLAGS, os.path.realpath(compiler), platform.machine(), sys.platform)).encode()
    ).hexdigest()[:16]
    target = None
    for directory in (_cache_dir(), os.path.join(tempfile.gettempdir(), f"lightning-swarm-{os.getuid()}")):
        target = _build(compiler, os.path.join(directory, f"q8-{key}.so"))
        if target is not None:
            break
    if target is None:
        logger.info("The 8-bit codec uses bitsandbytes' kernels (same output, ~6x slower)")
        return None
    lib = ctypes.CDLL(target)  # CDLL releases the GIL during calls: helper threads run in parallel
    lib.ls_quantize.argtypes = [
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
    ]
    lib.ls_quantize.restype = None
    lib.ls_dequantize.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
    ]
    lib.ls_dequantize.restype = None
    return lib


def _floats(bits: torch.Tensor) -> torch.Tensor:
    """float32 values of the given bit patterns (int64 tensor holding uint32 values)."""
    return torch.from_numpy(bits.numpy().astype(np.uint32).view(np.float32).copy())


def _ordinal(values: torch.Tensor) -> torch.Tensor:
    """float32 -> int64 preserving order (neighbouring floats differ by 1; both zeros map to 0)."""
    bits = values.view(torch.int32).to(torch.int64)
    return torch.where(bits >= 0, bits, -(bits & 0x7FFFFFFF))


def _from_ordinal(ordinals: torch.Tensor) -> torch.Tensor:
    return _floats(torch.where(ordinals >= 0, ordinals, (-ordinals) | 0x80000000))


def _normalised_blocks(values: torch.Tensor) -> torch.Tensor:
    """Blocks holding ``values`` (|v| <= 1) after a leading 1.0 each: every block's absmax is 1, so a quantizer
    divides each value by 1, exactly, and codes the normalised value itself."""
    per_block = BLOCKSIZE - 1
    blocks = max(1, -(values.numel() // -per_block))
    data = torch.zeros(blocks, BLOCKSIZE)
    data[:, 0] = 1.0
    padded = torch.zeros(blocks * per_block)
    padded[: values.numel()] = values
    data[:, 1:] = padded.view(blocks, per_block)
    return data


def _codes_of(quantize_blocks: Any, values: torch.Tensor) -> torch.Tensor:
    """The codes a quantizer gives normalised ``values``; ``quantize_blocks(data, absmax, codes)`` quantizes
    float32 ``data`` (whole blocks) into the tensors ``absmax`` and ``codes``."""
    data = _normalised_blocks(values)
    codes = torch.empty(data.numel(), dtype=torch.uint8)
    quantize_blocks(data, torch.empty(data.shape[0]), codes)
    return codes.view(data.shape)[:, 1:].reshape(-1)[: values.numel()]


def _reference_codes(kernel: Any, values: torch.Tensor) -> torch.Tensor:
    """bitsandbytes' code for each normalised value in ``values``."""

    def run(data: torch.Tensor, absmax: torch.Tensor, codes: torch.Tensor) -> None:
        code = dynamic_code().data_ptr()
        _run_native(
            kernel, code, data.data_ptr(), absmax.data_ptr(), codes.data_ptr(), BLOCKSIZE, data.numel()
        )

    return _codes_of(run, values)


def _fast_codes(fast: _FastKernel, values: torch.Tensor) -> torch.Tensor:
    """The fast kernel's code for each normalised value in ``values``."""

    def run(data: torch.Tensor, absmax: torch.Tensor, codes: torch.Tensor) -> None:
        fast.quantize(data.data_ptr(), absmax.data_ptr(), codes.data_ptr(), 0, data.numel(), BLOCKSIZE)

    return _codes_of(run, values)


def _mapping_table(kernel: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The table ``_q8.c`` looks codes up in, built from bitsandbytes' kernel (~20 ms), and each entry's threshold.

    Entry ``k`` covers the floats whose top 16 bits are ``k``. Those in [-1, 1] (the only normalised values a
    block has, besides NaN) take bitsandbytes' code; where it changes inside the bucket, the first float with
    the new code (in value order) is found by bisection: the bucket's threshold (``inf`` where the code does not
    change). Other buckets hold NaN (from a block of zeros or a NaN input), which bitsandbytes maps to code 0, as
    does every such entry. Returns ``(entries, thresholds)``: see :func:`_pack_entries` for the entries.
    """
    keys = torch.arange(1 << 16, dtype=torch.int64)
    first, last = _floats(keys << 16), _floats((keys << 16) | 0xFFFF)
    negative = keys >= 1 << 15
    low = torch.where(negative, last, first)  # in value order
    high = torch.where(negative, first, last)
    inside = torch.nonzero((low <= 1) & (high >= -1)).reshape(-1)
    low, high = low[inside].clamp(-1, 1), high[inside].clamp(-1, 1)
    below, above = _reference_codes(kernel, low), _reference_codes(kernel, high)
    threshold = torch.full((inside.numel(),), float("inf"))
    changes = torch.nonzero(below != above).reshape(-1)
    lo, hi = _ordinal(low[changes]), _ordinal(high[changes])
    base = below[changes]
    while bool((hi - lo > 1).any()):  # invariant: code(lo) == base != code(hi)
        mid = (lo + hi) // 2
        moved = _reference_codes(kernel, _from_ordinal(mid)) != base
        hi, lo = torch.where(moved, mid, hi), torch.where(moved, lo, mid)
    threshold[changes] = _from_ordinal(hi)
    thresholds = torch.full((1 << 16,), float("inf"))
    codes_below = torch.zeros(1 << 16, dtype=torch.int64)
    codes_above = torch.zeros(1 << 16, dtype=torch.int64)
    thresholds[inside], codes_below[inside], codes_above[inside] = threshold, below.long(), above.long()
    return _pack_entries(thresholds, codes_below, codes_above), thresholds


def _pack_entries(thresholds: torch.Tensor, below: torch.Tensor, above: torch.Tensor) -> torch.Tensor:
    """``_q8.c``'s uint32 entries: ``T | Y << 16 | X << 24``, a value whose low 16 bits are ``>= T`` taking code
    ``X`` and the others ``Y``, for buckets where values ``>=`` the threshold take ``above`` and the others
    ``below``. Within a bucket (same sign, exponent and top mantissa bits) the value order is the order of the
    low 16 bits for positive floats and its reverse for negative ones."""
    keys = torch.arange(1 << 16, dtype=torch.int64)
    finite = torch.isfinite(thresholds)
    bits = thresholds.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    if bool(((bits >> 16) != keys)[finite].any()):
        raise AssertionError("a threshold lies outside its bucket")
    negative = keys >= 1 << 15
    low = bits & 0xFFFF
    # positive: v >= t <=> low16(v) >= low16(t); negative: v >= t <=> low16(v) <= low16(t) < low16(t) + 1
    cut = torch.where(negative, low + 1, low)
    take, other = torch.where(negative, below, above), torch.where(negative, above, below)
    # one code for the whole bucket: no change inside it, or a negative bucket whose threshold is its last float
    single = ~finite | (cut > 0xFFFF)
    code = torch.where(finite, above, below)
    take, other = torch.where(single, code, take), torch.where(single, code, other)
    cut = torch.where(single, torch.zeros_like(cut), cut)
    entries = cut | (other << 16) | (take << 24)
    return torch.from_numpy(entries.numpy().astype(np.uint32).view(np.int32).copy())


def _self_check(fast: _FastKernel, kernel: Any, dekernel: Any) -> bool:
    """Whether the fast kernels give bitsandbytes' bytes on varied data (scales, zeros, NaN, a partial block)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16 * BLOCKSIZE + 77, generator=g) * torch.logspace(-30, 30, 16 * BLOCKSIZE + 77)
    x[BLOCKSIZE : 2 * BLOCKSIZE] = 0.0
    x[3 * BLOCKSIZE + 5] = float("nan")
    x[5 * BLOCKSIZE + 9] = float("inf")
    x[7 * BLOCKSIZE : 7 * BLOCKSIZE + 64] = torch.randn(64, generator=g) * 1e-8
    n, blocks = x.numel(), -(x.numel() // -BLOCKSIZE)
    ours, theirs = torch.empty(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)
    ours_max, theirs_max = torch.empty(blocks), torch.empty(blocks)
    fast.quantize(x.data_ptr(), ours_max.data_ptr(), ours.data_ptr(), 0, n, BLOCKSIZE)
    code = dynamic_code().data_ptr()
    _run_native(kernel, code, x.data_ptr(), theirs_max.data_ptr(), theirs.data_ptr(), BLOCKSIZE, n)
    if not (torch.equal(ours, theirs) and ours_max.view(torch.int32).equal(theirs_max.view(torch.int32))):
        return False
    out_ours, out_theirs = torch.empty(n), torch.empty(n)  # NaN decodes to NaN: compared bit for bit below
    fast.dequantize(ours.data_ptr(), ours_max.data_ptr(), out_ours.data_ptr(), n, BLOCKSIZE)
    _run_native(dekernel, code, ours.data_ptr(), ours_max.data_ptr(), out_theirs.data_ptr(), BLOCKSIZE, n)
    return out_ours.view(torch.int32).equal(out_theirs.view(torch.int32))


_fast_lock = threading.Lock()
_fast_state: dict[str, Any] = {}


def _fast_kernel() -> _FastKernel | None:
    """The fast kernel, built on first use; ``None`` if turned off, not buildable, or not bit-identical here."""
    setting = os.environ.get(NATIVE_ENV, "1").strip()
    if setting not in ("0", "1"):
        raise ValueError(
            f"{NATIVE_ENV} must be 1 (use the fast 8-bit kernel where it builds) or 0, got {setting!r}"
        )
    if setting == "0":
        return None
    with _fast_lock:
        if "kernel" not in _fast_state:
            _fast_state["kernel"] = _load_fast_kernel()
        return _fast_state["kernel"]


def _load_fast_kernel() -> _FastKernel | None:
    kernel, dekernel = _native_kernels()
    if kernel is None or dekernel is None or BLOCKSIZE > _MAX_BLOCK:
        return None
    lib = _compile()
    if lib is None:
        return None
    fast = _FastKernel(lib, *_mapping_table(kernel))
    if not _self_check(fast, kernel, dekernel):
        logger.warning(
            "The fast 8-bit kernel does not reproduce this bitsandbytes' output; using bitsandbytes' kernels "
            "(please report this with your bitsandbytes version)"
        )
        return None
    return fast


def using_fast_kernel() -> bool:
    """Whether 8-bit (de)quantization of float32 tensors runs the fast kernel in this process."""
    return _fast_kernel() is not None


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
    base, data = buffer.data_ptr(), flat.data_ptr()
    absmax, codes = base + 4, base + 4 + 4 * num_blocks
    fast, code = _fast_kernel(), dynamic_code().data_ptr()

    def share(lo: int, hi: int) -> None:
        if fast is not None:
            fast.quantize(data, absmax, codes, lo, hi, BLOCKSIZE)
        else:
            _run_native(
                kernel, code, data + 4 * lo, absmax + 4 * (lo // BLOCKSIZE), codes + lo, BLOCKSIZE, hi - lo
            )

    _Shares(share, numel, helper_count()).run()
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
    assert base is not None
    out = torch.empty(numel, dtype=torch.float32)
    fast = _fast_kernel()
    if fast is not None:
        fast.dequantize(base + 4 + 4 * num_blocks, base + 4, out.data_ptr(), numel, blocksize)
        return out
    # memory-bound: one thread, no helpers
    _run_native(
        kernel,
        dynamic_code().data_ptr(),
        base + 4 + 4 * num_blocks,
        base + 4,
        out.data_ptr(),
        blocksize,
        numel,
    )
    return out
