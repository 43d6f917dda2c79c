"""Check the fast 8-bit kernel against bitsandbytes' on every float32 value a block can normalise to.

bitsandbytes' quantizer divides each value by its block's absmax and maps the result v (a float32 in [-1, 1],
or NaN) to a code. The fast kernel (``lightning_swarm/swarm/wire/quantize/_q8.c``) looks that mapping up in a table built from
bitsandbytes' own kernel, assuming that the code changes at most once among the floats sharing their top 16
bits. This script checks the assumption where it matters: all 2,130,706,434 floats in [-1, 1] (both zeros
included), quantized in blocks whose absmax is 1, by both kernels. Unit tests check random data, edge values and
whole tensors; this is the exhaustive proof for the machine it runs on (~2 minutes on 2 cores).

It also times both kernels side by side on 1 MiB of Gaussian float32 (one thread, no helpers; best of 30 rounds
of 10 calls): ``fast_quantize_ms``, ``bitsandbytes_quantize_ms``, their ratio, and the same for dequantizing.

Usage: ``python benchmarks/quantizer_exhaustive.py [--speed-only]`` (``--quick`` changes nothing: the whole check
takes about 2 minutes on 2 cores). The last stdout line is JSON: values checked, mismatches (must be 0), the largest
mismatching |v| if any, seconds, and the timings; it is also written to
``runs/quantizer_exhaustive/quantizer_exhaustive.json`` (``--speed-only``: ``runs/quantizer_speed/quantizer_speed.json``,
the timings alone).
"""

from __future__ import annotations

import os
import time

import _harness
import torch

from lightning_swarm.swarm.wire import quantize
from lightning_swarm.swarm.wire.quantize import bnb as quantize_bnb
from lightning_swarm.swarm.wire.quantize import fast as quantize_fast

CHUNK = 1 << 24  # values per round (64 MB of float32)
ONE = 0x3F800000  # bit pattern of 1.0: the non-negative floats <= 1 are the patterns 0..ONE


def best_ms(fn, calls: int = 10, rounds: int = 30) -> float:
    fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e3)
    return round(best, 3)


def speeds() -> dict:
    """Both kernels through the codec's own entry points, on the same 1 MiB."""
    os.environ[quantize.HELPERS_ENV] = "0"
    x = torch.randn(64, 4096, generator=torch.Generator().manual_seed(0))
    buffer = quantize.quantize_to_buffer(x)
    times = {}
    for name, setting in (("fast", "1"), ("bitsandbytes", "0")):
        os.environ[quantize.NATIVE_ENV] = setting
        assert quantize.quantize_to_buffer(x) == buffer  # the same bytes either way
        times[f"{name}_quantize_ms"] = best_ms(lambda: quantize.quantize_to_buffer(x))
        times[f"{name}_dequantize_ms"] = best_ms(
            lambda: quantize.dequantize_buffer(buffer, quantize.BLOCKSIZE, x.numel(), torch.float32)
        )
    os.environ[quantize.NATIVE_ENV] = "1"
    times["quantize_speedup"] = round(times["bitsandbytes_quantize_ms"] / times["fast_quantize_ms"], 2)
    times["dequantize_speedup"] = round(times["bitsandbytes_dequantize_ms"] / times["fast_dequantize_ms"], 2)
    times["load_avg_1m"] = round(os.getloadavg()[0], 2)
    return times


def main() -> None:
    parser = _harness.parser(
        "quantizer_exhaustive",
        __doc__.split("\n\n")[0],
        quick="no effect: the whole check takes about 2 minutes on 2 cores (--speed-only: the timings alone)",
    )
    parser.add_argument("--speed-only", action="store_true", help="only time the kernels (a few seconds)")
    args = parser.parse_args()
    report = _harness.Report("quantizer_speed" if args.speed_only else "quantizer_exhaustive", args.out)
    fast = quantize_fast.fast_kernel()
    if fast is None:
        raise SystemExit(
            "the fast kernel is not available here (no C compiler, or LIGHTNING_SWARM_NATIVE_CODEC=0)"
        )
    timings = speeds()
    if args.speed_only:
        report.finish(timings)
        return
    kernel, _ = quantize_bnb.native_kernels()
    start = time.time()
    checked = mismatches = 0
    worst = None
    for sign in (0, 0x80000000):
        for first in range(0, ONE + 1, CHUNK):
            bits = torch.arange(first, min(first + CHUNK, ONE + 1), dtype=torch.int64) | sign
            values = quantize_fast._floats(bits)
            bad = quantize_fast._fast_codes(fast, values) != quantize_fast._reference_codes(kernel, values)
            checked += values.numel()
            if bool(bad.any()):
                mismatches += int(bad.sum())
                largest = float(values[bad].abs().max())
                worst = largest if worst is None else max(worst, largest)
        print(f"{'negative' if sign else 'non-negative'} values done: {mismatches} mismatches", flush=True)
    report.finish(
        {
            "values_checked": checked,
            "mismatches": mismatches,
            "largest_mismatching_abs": worst,
            "seconds": round(time.time() - start, 1),
            **timings,
        }
    )


if __name__ == "__main__":
    main()
