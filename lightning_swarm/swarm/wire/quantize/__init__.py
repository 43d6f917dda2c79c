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

The package: :mod:`.api` (the two entry points), :mod:`.threads` (one OpenMP thread per call, helper threads),
:mod:`.bnb` (bitsandbytes' kernels), :mod:`.fast` (the fast kernel and its self-check), :mod:`.blocks` (the block
size).

Nothing happens at import: the OpenMP runtime, the native kernels and ``LIGHTNING_SWARM_CODEC_HELPERS`` are
looked up on first use.
"""

from lightning_swarm.swarm.wire.quantize.api import dequantize_buffer, quantize_to_buffer
from lightning_swarm.swarm.wire.quantize.blocks import BLOCKSIZE, VALID_BLOCKSIZES
from lightning_swarm.swarm.wire.quantize.bnb import dynamic_code
from lightning_swarm.swarm.wire.quantize.fast import NATIVE_ENV, using_fast_kernel
from lightning_swarm.swarm.wire.quantize.threads import (
    HELPERS_ENV,
    helper_count,
    one_thread,
    part_bounds,
    quantizations,
)

__all__ = [
    "BLOCKSIZE",
    "HELPERS_ENV",
    "NATIVE_ENV",
    "VALID_BLOCKSIZES",
    "dequantize_buffer",
    "dynamic_code",
    "helper_count",
    "one_thread",
    "part_bounds",
    "quantizations",
    "quantize_to_buffer",
    "using_fast_kernel",
]
