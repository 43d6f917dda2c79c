"""The fast 8-bit kernel (``_q8.c``, ~6x faster than bitsandbytes' on one core): bitsandbytes' mapping of a
normalised value to a code, tabulated once per process from bitsandbytes' own kernel by the value's top 16 bits;
compiled with the system compiler on first use, cached, and self-checked against bitsandbytes when loaded."""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from typing import Any

import numpy as np
import torch

from lightning_swarm.swarm.wire.quantize.blocks import BLOCKSIZE
from lightning_swarm.swarm.wire.quantize.bnb import dynamic_code, native_kernels, run_native

logger = logging.getLogger(__name__)


NATIVE_ENV = "LIGHTNING_SWARM_NATIVE_CODEC"


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
        run_native(
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
    run_native(kernel, code, x.data_ptr(), theirs_max.data_ptr(), theirs.data_ptr(), BLOCKSIZE, n)
    if not (torch.equal(ours, theirs) and ours_max.view(torch.int32).equal(theirs_max.view(torch.int32))):
        return False
    out_ours, out_theirs = torch.empty(n), torch.empty(n)  # NaN decodes to NaN: compared bit for bit below
    fast.dequantize(ours.data_ptr(), ours_max.data_ptr(), out_ours.data_ptr(), n, BLOCKSIZE)
    run_native(dekernel, code, ours.data_ptr(), ours_max.data_ptr(), out_theirs.data_ptr(), BLOCKSIZE, n)
    return out_ours.view(torch.int32).equal(out_theirs.view(torch.int32))


_fast_lock = threading.Lock()


_fast_state: dict[str, Any] = {}


def fast_kernel() -> _FastKernel | None:
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
    kernel, dekernel = native_kernels()
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
    return fast_kernel() is not None
