"""The 8-bit kernel's entry points: :func:`quantize_to_buffer` and :func:`dequantize_buffer` (the fast kernel where
it loaded, else bitsandbytes', each on shares of the tensor claimed by the caller and helper threads)."""

from __future__ import annotations

import ctypes
import logging

import torch

from lightning_swarm.swarm.wire.quantize.blocks import BLOCKSIZE
from lightning_swarm.swarm.wire.quantize.bnb import dynamic_code, native_kernels, run_native
from lightning_swarm.swarm.wire.quantize.fast import (
    fast_kernel,
)
from lightning_swarm.swarm.wire.quantize.threads import (
    Shares,
    helper_count,
    one_thread,
    quantizations,
)

__all__ = ["dequantize_buffer", "quantize_to_buffer"]

logger = logging.getLogger(__name__)


def quantize_to_buffer(source: torch.Tensor) -> bytes:
    """The 8-bit buffer of a float tensor: ``uint32 blocksize | float32 absmax[blocks] | uint8 codes[numel]``."""
    quantizations.add()
    flat = source.reshape(-1)
    numel = flat.numel()
    num_blocks = -(numel // -BLOCKSIZE)
    header = BLOCKSIZE.to_bytes(4, "little")
    kernel, _ = native_kernels()
    if kernel is None or flat.dtype != torch.float32:
        with one_thread():
            codes, absmax = torch.ops.bitsandbytes.quantize_blockwise.default(flat, dynamic_code(), BLOCKSIZE)
        return b"".join((header, absmax.numpy().tobytes(), codes.numpy().tobytes()))
    flat = flat.contiguous()
    buffer = torch.empty(4 + 4 * num_blocks + numel, dtype=torch.uint8)
    buffer[:4] = torch.tensor(list(header), dtype=torch.uint8)
    base, data = buffer.data_ptr(), flat.data_ptr()
    absmax, codes = base + 4, base + 4 + 4 * num_blocks
    fast, code = fast_kernel(), dynamic_code().data_ptr()

    def share(lo: int, hi: int) -> None:
        if fast is not None:
            fast.quantize(data, absmax, codes, lo, hi, BLOCKSIZE)
        else:
            run_native(
                kernel, code, data + 4 * lo, absmax + 4 * (lo // BLOCKSIZE), codes + lo, BLOCKSIZE, hi - lo
            )

    Shares(share, numel, helper_count()).run()
    return buffer.numpy().tobytes()


def dequantize_buffer(buffer: bytes, blocksize: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`quantize_to_buffer` (the caller has validated the buffer's length and block size)."""
    num_blocks = -(numel // -blocksize)
    _, kernel = native_kernels()
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
    fast = fast_kernel()
    if fast is not None:
        fast.dequantize(base + 4 + 4 * num_blocks, base + 4, out.data_ptr(), numel, blocksize)
        return out
    # memory-bound: one thread, no helpers
    run_native(
        kernel,
        dynamic_code().data_ptr(),
        base + 4 + 4 * num_blocks,
        base + 4,
        out.data_ptr(),
        blocksize,
        numel,
    )
    return out
