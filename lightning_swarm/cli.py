"""The ``lightning-swarm`` command.

- ``lightning-swarm serve MODULE_CLASS [--config cfg.yaml] --initial-peers ADDR ...``: a server-only peer that
  hosts one stage of the swarm for the LightningModule class ``MODULE_CLASS`` (``package.module.ClassName``),
  built with the ``model:`` section of a LightningCLI config and the ``SwarmStrategy`` settings of its
  ``trainer.strategy.init_args``. Runs until interrupted.
- ``lightning-swarm status --initial-peers ADDR ... [--run-id RUN] [--num-stages K]``: lists each stage's peers and
  their announced throughput.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
import threading
from typing import Any

import yaml


def _load_class(path: str) -> type:
    module_name, _, class_name = path.replace(":", ".").rpartition(".")
    if not module_name:
        raise SystemExit(f"error: {path!r} is not an import path like 'package.module.ClassName'.")
    try:
        return getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as e:
        raise SystemExit(f"error: cannot import {path!r} ({e}). Is the package on PYTHONPATH?") from e


def _read_config(path: str | None) -> dict[str, Any]:
    if not path:
        return {}
    with open(path) as f:
        config = yaml.safe_load(f) or {}
    if not isinstance(config, dict):
        raise SystemExit(f"error: {path} must hold a YAML mapping (a LightningCLI config).")
    return config


def _strategy_settings(config: dict[str, Any], args: argparse.Namespace) -> Any:
    from lightning_swarm.swarm.peer import SwarmSettings

    strategy = (config.get("trainer") or {}).get("strategy") or {}
    init_args = dict(strategy.get("init_args") or {}) if isinstance(strategy, dict) else {}
    known = set(SwarmSettings.__dataclass_fields__)
    settings = SwarmSettings(**{k: v for k, v in init_args.items() if k in known})
    for key in ("run_id", "num_stages", "stage", "compression"):
        value = getattr(args, key, None)
        if value is not None:
            setattr(settings, key, value)
    if args.initial_peers:
        settings.initial_peers = list(args.initial_peers)
    if args.host_maddrs:
        settings.host_maddrs = list(args.host_maddrs)
    settings.role = "server"
    settings.validate()
    return settings


def serve(args: argparse.Namespace) -> None:
    """Run a server-only peer until SIGINT/SIGTERM."""
    import torch

    from lightning_swarm.swarm.peer import SwarmPeer

    config = _read_config(args.config)
    module_cls = _load_class(args.module)
    seed = config.get("seed_everything")
    if isinstance(seed, int):
        torch.manual_seed(seed)
    module = module_cls(**(config.get("model") or {}))
    optimizer = module.configure_optimizers()
    if isinstance(optimizer, (list, tuple)):
        optimizer = optimizer[0]
    if isinstance(optimizer, dict):
        optimizer = optimizer["optimizer"]
    peer = SwarmPeer(_strategy_settings(config, args))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    peer.start_dht()
    try:
        peer.join(module, [optimizer], training=True)
        addrs = " ".join(str(a) for a in peer.dht.get_visible_maddrs())
        print(
            f"Serving stage {peer.stage} of run {peer.settings.run_id!r}. Peers can join with: {addrs}",
            flush=True,
        )
        stop.wait()
    finally:
        peer.shutdown()


def status(args: argparse.Namespace) -> None:
    """Print each stage's peers."""
    import hivemind

    from lightning_swarm.swarm.records import get_stage_peers

    if not args.initial_peers:
        raise SystemExit("error: status needs --initial-peers (the multiaddr of any peer of the swarm).")
    dht = hivemind.DHT(start=True, initial_peers=args.initial_peers, client_mode=True)
    try:
        for stage in range(args.num_stages or 1):
            peers = get_stage_peers(dht, args.run_id or "lightning_swarm", stage)
            total = sum(p.throughput for p in peers)
            print(f"stage {stage}: {len(peers)} peers, {total:.1f} samples/s")
            for p in peers:
                print(f"  {p.peer_id}  {p.throughput:.1f} samples/s")
    finally:
        dht.shutdown()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="lightning-swarm", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_serve = sub.add_parser("serve", help="host one stage of a swarm (server-only peer)")
    p_serve.add_argument("module", help="LightningModule class, e.g. examples.albert.model.Albert")
    p_serve.add_argument("--config", help="LightningCLI YAML with model: and trainer.strategy.init_args:")
    p_status = sub.add_parser("status", help="list the peers of each stage")
    for p in (p_serve, p_status):
        p.add_argument(
            "--initial-peers", nargs="*", default=[], help="multiaddrs of peers already in the swarm"
        )
        p.add_argument("--run-id", dest="run_id", default=None)
        p.add_argument("--num-stages", dest="num_stages", type=int, default=None)
    p_serve.add_argument("--stage", type=int, default=None, help="stage to serve (default: the least served)")
    p_serve.add_argument("--compression", choices=["8bit", "fp16", "none"], default=None)
    p_serve.add_argument("--host-maddrs", nargs="*", default=[], help="addresses to listen on")
    args = parser.parse_args(argv)
    {"serve": serve, "status": status}[args.command](args)


if __name__ == "__main__":
    main(sys.argv[1:])
