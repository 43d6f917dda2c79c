"""One swarm peer of an internet-like swarm on the test bed (``testbed.netns`` namespaces, some behind NAT): the
job that ``tests/test_nat.py`` and ``benchmarks/swarm_internet.py`` start in each host's namespace.

``python testbed/internet_peer.py '<json>'`` with ``"role"``:

- ``"server"``: serves ``stage`` of the small MLP pipeline of ``testbed/stage_peer.py`` (``width``, ``blocks``) with
  a ``StageServer``, its DHT started per ``reachability`` (``lightning_swarm.swarm.dht.reachability``) on
  ``listen`` (an address of its host). Prints one JSON line once it serves (``peer_id``, ``maddrs``, ``reached``,
  ``relay_addrs``), then serves until its stdin closes or it is killed; then prints ``{"served": <the server's
  info()>}`` (samples, optimizer steps, averaging rounds) and shuts down.
- ``"trainer"``: a ``SwarmClient`` that trains a head and a tail around the pipeline for ``seconds`` (or ``steps``)
  with batches of ``batch`` rows (or from wall time ``begin`` to ``until``; a step every ``step_s`` s at most), then
  prints one JSON line: steps, samples, losses, each step's end and length, failed steps' times, and per stage peer
  the calls it took, their busy seconds, whether the connection to it went through a relay and whether its
  record says so. With ``wait_go``: prints ``{"ready": true}`` once it can train and reads ``<begin> <until>``
  from stdin first. With ``command_steps`` (servers with ``stage_steps`` ``"trainer"``): after each of its steps
  it commands every stage's step (ids from ``step_id_base`` on), as a trainer of the strategy's synchronous mode
  does: the stage's peers sum their gradients in one round among all of them, then step.

Dies with its parent (``die_with_parent``): a SIGKILLed test takes its peers along.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections import defaultdict
from typing import Any

import hivemind
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning_swarm.swarm.client.client import SwarmClient  # noqa: E402
from lightning_swarm.swarm.dht.reachability import relay_addrs_of, start_reachable  # noqa: E402
from lightning_swarm.swarm.lifetime import die_with_parent  # noqa: E402
from lightning_swarm.swarm.logs import quiet_routine_logs  # noqa: E402
from lightning_swarm.swarm.loop import run_coroutine  # noqa: E402
from lightning_swarm.swarm.server import StageServer  # noqa: E402
from lightning_swarm.swarm.settings import SwarmSettings  # noqa: E402
from lightning_swarm.swarm.training.stepping import StepCommand  # noqa: E402
from lightning_swarm.swarm.wire.protocol import stage_uid  # noqa: E402
from testbed.stage_peer import job_settings, serve_stage, stage_module  # noqa: E402

# An internet peer's settings where its config names none (the rest: testbed/stage_peer.py's DEFAULTS).
_NAMES = dict(
    run_id="internet", compression="8bit", target_batch_size=256, reachability="auto", same_host=True
)
_TIMES = dict(
    matchmaking_time=2.0, averaging_timeout=10.0, request_timeout=10.0, expiration=6.0, ban_base_s=5.0
)


def _settings(cfg: dict[str, Any]) -> SwarmSettings:
    return job_settings(cfg, **_NAMES, **_TIMES, no_peers_timeout=60.0)


def _start_dht(cfg: dict[str, Any], settings: SwarmSettings) -> tuple[hivemind.DHT, str]:
    listen = cfg.get("listen", "127.0.0.1")

    def create(options: dict[str, Any]) -> hivemind.DHT:
        return hivemind.DHT(
            start=True,
            initial_peers=cfg.get("initial_peers", []),
            host_maddrs=[f"/ip4/{listen}/tcp/{cfg.get('port', 0)}"],
            **options,
        )

    return start_reachable(create, settings.reachability, cfg.get("initial_peers", []))


def serve(cfg: dict[str, Any]) -> None:
    settings = _settings(cfg)
    t0 = time.monotonic()
    dht, reached = _start_dht(cfg, settings)
    print(f"DHT up in {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
    server = None
    if cfg.get("stage") is not None:
        module = stage_module(cfg["stage"], cfg["width"], cfg["blocks"])
        server = serve_stage(StageServer, cfg, module, dht, settings)
    print(
        json.dumps(
            {
                "peer_id": str(dht.peer_id),
                "maddrs": [str(a) for a in dht.get_visible_maddrs()],
                "reached": reached,
                "relay_addrs": list(relay_addrs_of(dht)),
            }
        ),
        flush=True,
    )
    sys.stdin.read()  # serve until the parent closes our stdin (or dies: die_with_parent)
    if server is not None:
        print(json.dumps({"served": server.info()}), flush=True)
        server.shutdown()
    dht.shutdown()


def train(cfg: dict[str, Any]) -> None:
    settings = _settings(cfg)
    dht, reached = _start_dht(cfg, settings)
    client = SwarmClient(dht, settings)
    calls: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    lock = threading.Lock()
    for router in client.routers:  # count each peer's timed calls as the router records them
        observe = router.observe

        def counted(peer_id: Any, samples: float, seconds: float, observe: Any = observe) -> None:
            with lock:
                calls[str(peer_id)][0] += 1
                calls[str(peer_id)][1] += seconds
            observe(peer_id, samples, seconds)

        router.observe = counted
    width, batch = cfg["width"], cfg.get("batch", 16)
    torch.manual_seed(cfg.get("seed", 0))
    head, tail = nn.Linear(8, width), nn.Linear(width, 1)
    optimizer = torch.optim.Adam([*head.parameters(), *tail.parameters()], lr=1e-3)
    losses: list[float] = []
    steps_at: list[tuple[float, float]] = []  # (wall time at its end, seconds) of every step done
    errors: list[str] = []
    errors_at: list[float] = []
    relayed: dict[str, bool] = {}
    epochs: dict[int, int] = {}  # with command_steps: each stage's epoch as this trainer last saw it
    start = time.monotonic()
    deadline = cfg["until"] if "until" in cfg else time.time() + cfg.get("seconds", 30.0)  # wall time
    if cfg.get(
        "wait_go"
    ):  # say it is ready, then wait for the wall times to train between: "<begin> <until>"
        print(json.dumps({"ready": True}), flush=True)
        cfg["begin"], cfg["until"] = (float(v) for v in sys.stdin.readline().split())
        deadline = cfg["until"]
    if "begin" in cfg:  # trainers of one run start together, once every peer is up
        time.sleep(max(0.0, cfg["begin"] - time.time()))
        start = time.monotonic()
    while time.time() < deadline and len(losses) < cfg.get("steps", 10**9):
        x = torch.randn(batch, 8)
        y = torch.sin(x[:, :1]) + x[:, 1:2]
        began = time.time()
        try:
            h = head(x)
            for stage in range(settings.num_stages):
                h = client.call_stage(stage, h)
            loss = nn.functional.mse_loss(tail(h), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if cfg.get("command_steps"):  # synchronous steps: this trainer commands every stage's step
                step_id = int(cfg.get("step_id_base", 0)) + len(losses)
                for stage in range(settings.num_stages):
                    command = StepCommand(
                        stage_uid(settings.run_id, stage),
                        step_id,
                        groups={0: {"lr": cfg.get("lr", 1e-3)}},
                        epoch=epochs.get(stage, 0),
                    )
                    replies = client.commands.step_stage(stage, command)
                    epochs[stage] = max([epochs.get(stage, 0), *(int(r.get("epoch", 0)) for r in replies)])
            losses.append(loss.item())
            steps_at.append((time.time(), time.time() - began))
        except Exception as e:  # reported, not hidden: the test asserts there are none
            errors.append(repr(e)[:300])
            errors_at.append(time.time())
            time.sleep(0.5)
        time.sleep(
            max(0.0, began + cfg.get("step_s", 0.0) - time.time())
        )  # paced: a step every step_s at most
        if len(losses) % 5 == 1 and client._p2p is not None:  # how the daemon is connected to each peer
            for info in run_coroutine(client._p2p.list_peers(), timeout=10):
                relayed[str(info.peer_id)] = all("p2p-circuit" in str(a) for a in info.addrs)
    elapsed = time.monotonic() - start
    records = {str(p.peer_id): p.relayed for k in range(settings.num_stages) for p in client.peers(k)}
    result = {
        "reached": reached,
        "steps": len(losses),
        "samples": len(losses) * batch,
        "seconds": elapsed,
        "losses": losses,
        "errors": errors,
        "errors_at": errors_at,
        "steps_at": steps_at,
        "batch": batch,
        "peers": {p: {"calls": n, "busy_s": s, "relayed": relayed.get(p)} for p, (n, s) in calls.items()},
        "records_relayed": records,
        "stats": client.stats(),
    }
    client.shutdown()
    print(json.dumps(result), flush=True)
    dht.shutdown()


def main() -> None:
    cfg = json.loads(sys.argv[1])
    die_with_parent()
    quiet_routine_logs()
    torch.set_num_threads(cfg.get("threads", 1))
    {"server": serve, "trainer": train}[cfg["role"]](cfg)


if __name__ == "__main__":
    main()
