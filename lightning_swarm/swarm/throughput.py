"""How fast a stage server trains: samples per second of forward + backward, the one unit peers announce.

Routing (:mod:`.routing`) charges each peer ``task_size / throughput``, so every announced figure must be in
the same unit. Before a server has served a backward call it announces :func:`estimate_throughput` (a matmul
benchmark divided by the ~6 FLOPs per parameter that forward + backward take per sample); the first measured
backward (which recomputes the forward, so it times exactly one forward + backward) replaces that estimate,
later ones are averaged in. Forward-only calls are not counted: they would announce a different unit.
"""

from __future__ import annotations

import threading
import time

import torch
from torch import nn

__all__ = ["Throughput", "estimate_throughput", "measure_flops"]


class Throughput:
    """Samples per second of forward + backward: an estimate until measured, then a moving average.

    Args:
        estimate: the figure to announce before the first measurement (samples/s of forward + backward).
        smoothing: weight of each new measurement in the moving average.
    """

    def __init__(self, estimate: float, smoothing: float = 0.1) -> None:
        if not estimate > 0:
            raise ValueError(f"Throughput estimate must be positive, got {estimate}")
        self.value = float(estimate)
        self.measured = False
        self.at = time.time()  # when the figure was made: the estimate, then the latest measurement
        self.smoothing = smoothing
        self._lock = threading.Lock()

    def record(self, samples: int, seconds: float) -> None:
        """Count one forward + backward of ``samples`` samples that took ``seconds``."""
        if seconds <= 0 or samples <= 0:
            return
        measured = samples / seconds
        with self._lock:
            if not self.measured:
                self.value, self.measured = measured, True
            else:
                self.value = (1 - self.smoothing) * self.value + self.smoothing * measured
            self.at = time.time()


def measure_flops(device: torch.device, size: int = 512, repeats: int = 3) -> float:
    """Floating-point operations per second of a square fp32 matmul on ``device`` (best of ``repeats``)."""
    a = torch.randn(size, size, device=device)
    best = float("inf")
    for i in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        a @ a
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:
            best = min(best, time.perf_counter() - start)
    return 2 * size**3 / max(best, 1e-9)


def estimate_throughput(module: nn.Module, device: torch.device) -> float:
    """A first guess of the samples per second of forward + backward of ``module`` on ``device`` (~6 FLOPs per
    parameter per sample), announced until the server has measured a real backward call."""
    params = sum(p.numel() for p in module.parameters()) or 1
    return measure_flops(device) / (6 * params)
