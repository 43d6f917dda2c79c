"""bitsandbytes' dynamic blockwise 8-bit kernels on the CPU, called directly (one OpenMP thread per call, see
:mod:`.threads`): the reference the fast kernel (:mod:`.fast`) is checked against."""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

from lightning_swarm.swarm.wire.quantize.threads import (
    one_thread,
)


def _import_bitsandbytes() -> None:
    """Import bitsandbytes (on first use) without its import-time notice about an optional package that does not
    concern us (see :mod:`.logs`); every other bitsandbytes message is left as it is."""
    from lightning_swarm.swarm.logs import quiet_bitsandbytes_import

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
def native_kernels() -> tuple[Any, Any]:
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


def run_native(kernel: Any, code: int, source: int, middle: int, out: int, blocksize: int, n: int) -> None:
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
