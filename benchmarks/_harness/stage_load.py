"""One stage server under load: trainer processes call it forward + backward as fast as they can.

``batched_stage.py`` and ``kept_activations.py`` both host a stack of :class:`Block` s in a ``StageServer`` in the
benchmark's process and measure it under the load of :func:`drive`: ``trainers`` processes (spawned, each its own
DHT node, p2p daemon and ``SwarmClient``, one torch thread, dying with the benchmark) that wait for each other,
then call stage 0 with microbatches of ``shape`` for ``warmup + seconds`` and report the rows completed in the
``seconds`` after the warm-up.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from collections.abc import Callable
from typing import Any

import hivemind
import torch
from torch import nn

from .procs import set_parent_death_signal


class Block(nn.Module):
    """A Transformer MLP block: ``x + down(gelu(up(norm(x))))``, FFN 4x."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up, self.down = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def _trainer(
    parent: int,
    maddrs: list[str],
    settings: dict[str, Any],
    shape: tuple[int, ...],
    warmup: float,
    seconds: float,
    start: Any,
    results: mp.Queue,
    verbose: bool,
) -> None:
    from lightning_swarm.swarm import SwarmClient, SwarmSettings

    set_parent_death_signal(parent)
    torch.set_num_threads(1)
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=maddrs)
    client = SwarmClient(dht, SwarmSettings(**settings))
    done: list[float] = []
    results.put("ready")
    start.wait(600)
    start_at = time.time()
    end = start_at + warmup + seconds
    try:
        while time.time() < end:
            x = torch.randn(*shape, requires_grad=True)
            client.call_stage(0, x).pow(2).mean().backward()
            done.append(time.time())
    finally:
        client.shutdown()
        dht.shutdown()
    window = [t for t in done if start_at + warmup <= t < end]
    if verbose:
        print(f"trainer: {len(done)} calls, first at {done[0] - start_at if done else None}", flush=True)
    results.put(len(window) * shape[0])


def drive(
    server: Any,
    server_dht: hivemind.DHT,
    trainers: int,
    settings: dict[str, Any],
    shape: tuple[int, ...],
    warmup: float,
    seconds: float,
    counters: Callable[[], dict[str, int]],
    verbose: bool = False,
) -> tuple[int, dict[str, int]]:
    """Load the started ``server`` with ``trainers`` trainer processes (``SwarmSettings(**settings)``); returns the
    rows they completed in the ``seconds`` after the warm-up and how much each of ``counters()`` (read from the
    server) grew over the same seconds. The server is shut down at the end."""
    ctx = mp.get_context("spawn")
    results: mp.Queue = ctx.Queue()
    start = ctx.Event()
    maddrs = [str(m) for m in server_dht.get_visible_maddrs()]
    args = (os.getpid(), maddrs, settings, shape, warmup, seconds, start, results, verbose)
    procs = [ctx.Process(target=_trainer, args=args) for _ in range(trainers)]
    try:
        for p in procs:
            p.start()
        for _ in procs:  # importing torch and starting a DHT takes a while on a busy machine
            assert results.get(timeout=600) == "ready"
        start.set()
        time.sleep(warmup)
        before = counters()
        time.sleep(seconds)
        after = counters()
        samples = sum(results.get(timeout=120) for _ in procs)
        for p in procs:
            p.join(60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        server.shutdown()
    return samples, {k: after[k] - before[k] for k in after}
