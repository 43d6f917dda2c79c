"""Check the fast 8-bit kernel against bitsandbytes' on every float32 value a block can normalise to.

bitsandbytes' quantizer divides each value by its block's absmax and maps the result v (a float32 in [-1, 1],
or NaN) to a code. The fast kernel (``lightning_swarm/swarm/_q8.c``) looks that mapping up in a table built from
bitsandbytes' own kernel, assuming that the code changes at most once among the floats sharing their top 16
bits. This script checks the assumption where it matters: all 2,130,706,434 floats in [-1, 1] (both zeros
included), quantized in blocks whose absmax is 1, by both kernels. Unit tests check random data, edge values and
whole tensors; this is the exhaustive proof for the machine it runs on (~2 minutes on 2 cores).

Usage: ``python benchmarks/quantizer_exhaustive.py``. The last stdout line is JSON: values checked, mismatches
(must be 0), the largest mismatching |v| if any, seconds.
"""

from __future__ import annotations

import json
import time

import torch

from lightning_swarm.swarm import quantize

CHUNK = 1 << 24  # values per round (64 MB of float32)
ONE = 0x3F800000  # bit pattern of 1.0: the non-negative floats <= 1 are the patterns 0..ONE


def main() -> None:
    fast = quantize._fast_kernel()
    if fast is None:
        raise SystemExit(
            "the fast kernel is not available here (no C compiler, or LIGHTNING_SWARM_NATIVE_CODEC=0)"
        )
    kernel, _ = quantize._native_kernels()
    start = time.time()
    checked = mismatches = 0
    worst = None
    for sign in (0, 0x80000000):
        for first in range(0, ONE + 1, CHUNK):
            bits = torch.arange(first, min(first + CHUNK, ONE + 1), dtype=torch.int64) | sign
            values = quantize._floats(bits)
            bad = quantize._fast_codes(fast, values) != quantize._reference_codes(kernel, values)
            checked += values.numel()
            if bool(bad.any()):
                mismatches += int(bad.sum())
                largest = float(values[bad].abs().max())
                worst = largest if worst is None else max(worst, largest)
        print(f"{'negative' if sign else 'non-negative'} values done: {mismatches} mismatches", flush=True)
    print(
        json.dumps(
            {
                "values_checked": checked,
                "mismatches": mismatches,
                "largest_mismatching_abs": worst,
                "seconds": round(time.time() - start, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
