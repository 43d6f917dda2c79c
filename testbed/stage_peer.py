"""A server-only swarm peer as a real process, for the chaos test (``tests/test_chaos.py``) and
``benchmarks/swarm_faults.py``.

``python testbed/stage_peer.py '<json>'`` serves one stage of a small MLP pipeline (``width``, ``blocks`` per stage,
the same initial weights on every peer of a stage) until it is killed or its stdin closes. It prints its peer id
and multiaddrs as one JSON line once it serves. With ``"kill": "forward"|"backward"|"averaging"`` it SIGKILLs itself
in the middle of its ``kill_after``-th forward or backward (inside the stage's compute), or while its first averaging
round is under way (``kill_delay`` seconds after the round began: in matchmaking or in the all-reduce).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from typing import Any

import hivemind
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning_swarm.swarm.lifetime import die_with_parent  # noqa: E402
from lightning_swarm.swarm.logs import quiet_routine_logs  # noqa: E402
from lightning_swarm.swarm.server import StageServer  # noqa: E402
from lightning_swarm.swarm.settings import SwarmSettings  # noqa: E402

# What a job's settings are where its JSON config names none ("stage_steps": "trainer" steps only when a trainer
# commands it).
DEFAULTS: dict[str, Any] = {
    "compression": "none",
    "target_batch_size": 64,
    "matchmaking_time": 1.0,
    "averaging_timeout": 5.0,
    "request_timeout": 5.0,
    "announce_period": 1.0,
    "expiration": 4.0,
    "stage_steps": "auto",
}


def job_settings(cfg: dict[str, Any], **defaults: Any) -> SwarmSettings:
    """The ``SwarmSettings`` of a job from its JSON config: ``num_stages`` and ``run_id`` (``defaults`` may give
    it), and each of ``DEFAULTS`` (updated by ``defaults``) as the config names it, else its default."""
    chosen = {**DEFAULTS, **defaults}
    run_id = cfg.get("run_id", chosen.pop("run_id", None))
    return SwarmSettings(
        run_id=run_id, num_stages=cfg["num_stages"], **{k: cfg.get(k, v) for k, v in chosen.items()}
    )


def serve_stage(
    cls: type[StageServer], cfg: dict[str, Any], module: nn.Module, dht: Any, settings: SwarmSettings
) -> StageServer:
    """Starts ``cls`` serving ``cfg["stage"]`` with ``module`` (Adam at ``cfg["lr"]``, default 1e-3)."""
    return cls(
        cfg["stage"],
        module,
        dht=dht,
        settings=settings,
        optimizer_factory=lambda groups: torch.optim.Adam(groups, lr=cfg.get("lr", 1e-3)),
        throughput=cfg.get("throughput", 100.0),
    ).start()


def stage_module(stage: int, width: int, blocks: int) -> nn.Module:
    """The blocks of ``stage``: identical on every peer of the stage (seeded by the stage index)."""
    torch.manual_seed(1000 + stage)
    return nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(blocks)))


class _Killer(nn.Module):
    """Wraps the stage: SIGKILLs this process inside its ``after``-th forward (a run of the module) or backward (as
    the gradient enters the stage's graph, kept from the forward or recomputed)."""

    def __init__(self, inner: nn.Module, when: str | None, after: int) -> None:
        super().__init__()
        self.inner, self.when, self.after, self.calls = inner, when, after, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.when == "forward":
            self.calls += 1
            if self.calls >= self.after:
                self.inner(x)  # halfway through: the work has started
                os.kill(os.getpid(), signal.SIGKILL)
        out = self.inner(x)
        if self.when == "backward" and out.requires_grad:
            out.register_hook(self._in_backward)
        return out

    def _in_backward(self, grad: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls >= self.after:
            os.kill(os.getpid(), signal.SIGKILL)
        return grad


class _KillDuringAveraging(StageServer):
    """SIGKILLs this process ``kill_delay`` seconds after it began its first gradient averaging round with partners
    (hivemind begins one only when the stage has other peers)."""

    kill_delay = 0.5

    def start(self) -> StageServer:
        super().start()
        averager = self.optimizer.grad_averager
        begin = averager.step

        def step(*args, **kwargs):
            threading.Timer(self.kill_delay, os.kill, (os.getpid(), signal.SIGKILL)).start()
            return begin(*args, **kwargs)

        averager.step = step
        return self


def main() -> None:
    cfg = json.loads(sys.argv[1])
    die_with_parent()
    quiet_routine_logs()
    torch.set_num_threads(1)
    dht = hivemind.DHT(
        start=True, initial_peers=cfg.get("initial_peers", []), host_maddrs=["/ip4/127.0.0.1/tcp/0"]
    )
    settings = job_settings(cfg)
    module = stage_module(cfg["stage"], cfg["width"], cfg["blocks"])
    when = cfg.get("kill")
    cls = _KillDuringAveraging if when == "averaging" else StageServer
    if when in ("forward", "backward"):
        module = _Killer(module, when, cfg.get("kill_after", 5))
    _KillDuringAveraging.kill_delay = cfg.get("kill_delay", 0.5)
    server = serve_stage(cls, cfg, module, dht, settings)
    print(
        json.dumps({"peer_id": str(dht.peer_id), "maddrs": [str(a) for a in dht.get_visible_maddrs()]}),
        flush=True,
    )
    sys.stdin.read()  # serve until the parent closes our stdin (or dies: die_with_parent in the launcher)
    server.shutdown()
    dht.shutdown()


if __name__ == "__main__":
    main()
