"""The ``lightning-swarm`` command.

- ``lightning-swarm serve MODULE_CLASS [--config cfg.yaml] --initial-peers ADDR ...``: a server-only peer that
  hosts one stage of the swarm for the LightningModule class ``MODULE_CLASS`` (``package.module.ClassName``),
  built with the ``model:`` section of a LightningCLI config and the ``SwarmStrategy`` settings of its
  ``trainer.strategy.init_args``. It waits for trainers to appear, serves them, and runs until interrupted; on
  SIGINT/SIGTERM it announces that it is leaving and finishes its calls in flight before it goes.
- ``lightning-swarm status --initial-peers ADDR ... [--run-id RUN]``: a table of the whole swarm: every stage
  with its peers, their state (joining, online, leaving) and announced throughput (marked as an estimate until the
  peer has measured calls it served, with the age of the figure), and the pipeline's bottleneck.
  The number of stages is read from the peers' records (``--num-stages`` only for peers that do not announce it).
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import threading
from typing import Any

import yaml


def _load_class(path: str) -> type:
    """The class at ``package.module.ClassName``, looked up as ``python -m`` would: the current directory first."""
    module_name, _, class_name = path.replace(":", ".").rpartition(".")
    if not module_name:
        raise SystemExit(f"error: {path!r} is not an import path like 'package.module.ClassName'.")
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    try:
        return getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as e:
        raise SystemExit(
            f"error: cannot import {path!r} ({e}). Run this command from the directory that holds the package "
            f"{module_name.split('.')[0]!r} (now: {cwd}), or put that directory on PYTHONPATH."
        ) from e


def _read_config(path: str | None) -> dict[str, Any]:
    if not path:
        return {}
    with open(path) as f:
        config = yaml.safe_load(f) or {}
    if not isinstance(config, dict):
        raise SystemExit(f"error: {path} must hold a YAML mapping (a LightningCLI config).")
    return config


def _strategy_settings(config: dict[str, Any], args: argparse.Namespace) -> Any:
    from lightning_swarm.swarm import SwarmSettings

    strategy = (config.get("trainer") or {}).get("strategy") or {}
    init_args = dict(strategy.get("init_args") or {}) if isinstance(strategy, dict) else {}
    known = set(SwarmSettings.__dataclass_fields__)
    values = {k: v for k, v in init_args.items() if k in known}
    for key in ("run_id", "num_stages", "stage", "compression"):
        value = getattr(args, key, None)
        if value is not None:
            values[key] = value
    if args.initial_peers:
        values["initial_peers"] = args.initial_peers
    if args.host_maddrs:
        values["host_maddrs"] = args.host_maddrs
    try:
        return SwarmSettings(**{**values, "role": "server"})
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None


def serve(args: argparse.Namespace) -> None:
    """Run a server-only peer until SIGINT/SIGTERM."""
    import torch

    from lightning_swarm.swarm import SwarmPeer

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
        assert peer.dht is not None
        addrs = " ".join(str(a) for a in peer.dht.get_visible_maddrs())
        print(
            f"Serving stage {peer.stage} of run {peer.settings.run_id!r}. Peers can join with: {addrs}",
            flush=True,
        )
        stop.wait()
    finally:
        peer.shutdown(drain=True)


def status(args: argparse.Namespace) -> None:
    """Print a table of the swarm: stages, peers, states, throughput and the bottleneck."""

    import tempfile

    from lightning_swarm.swarm.dht.auth import SECRET_ENV, protect, unprotect
    from lightning_swarm.swarm.dht.bootstrap import INITIAL_PEERS_ENV, env_peers

    args.initial_peers = args.initial_peers or env_peers()
    if not args.initial_peers:
        raise SystemExit(
            f"error: status needs the address of any peer of the swarm: --initial-peers ADDR, or {INITIAL_PEERS_ENV}."
        )
    from lightning_swarm.swarm.dht.identity import PeerIdentity
    from lightning_swarm.swarm.dht.process import SwarmDHT

    run_id = args.run_id or "lightning_swarm"
    identity = PeerIdentity()
    secret = args.secret or os.environ.get(SECRET_ENV) or None
    if secret is not None:  # a private swarm: this client proves the secret to the peers it asks
        protect(identity.peer_id, secret)
    with tempfile.TemporaryDirectory(prefix="swarm-status-") as tmp:
        identity.save(os.path.join(tmp, "identity.key"))
        try:
            dht = SwarmDHT(
                start=True,
                initial_peers=args.initial_peers,
                client_mode=True,
                identity_path=os.path.join(tmp, "identity.key"),
                check_if_identity_free=False,
            )
        except Exception as e:
            unprotect(identity.peer_id)
            raise SystemExit(
                f"error: could not reach the swarm through {args.initial_peers}: {e}. Check the addresses; for a "
                f"private swarm pass --secret (or set {SECRET_ENV})."
            ) from None
    try:
        peers, num_stages = list_swarm(dht, run_id, args.num_stages)
    finally:
        dht.shutdown()
    if not peers:
        raise SystemExit(
            f"error: no peer of run {run_id!r} is announced in the DHT reached through {args.initial_peers}. "
            "Check --run-id (the SwarmStrategy's run_id) and that the swarm is running."
        )
    print(format_status(run_id, peers, num_stages))


def list_swarm(
    dht: Any, run_id: str, num_stages: int | None = None, max_stages: int = 1024
) -> tuple[list, int]:
    """Every announced peer of run ``run_id`` (all states) and the number of stages: ``num_stages`` if given,
    else the largest one the peers announce, else the stages up to the first one without any peer."""
    from lightning_swarm.swarm.dht.records import get_stage_peers
    from lightning_swarm.swarm.states import STATES

    peers: list = []
    stage = 0
    while stage < (num_stages or max_stages):
        found = get_stage_peers(dht, run_id, stage, states=STATES)
        peers += found
        if num_stages is None:
            announced = [p.num_stages for p in peers if p.num_stages is not None]
            if announced:
                num_stages = max(announced)
            elif not found:
                num_stages = stage
                break
        stage += 1
    return peers, num_stages or 0


def _figure(peers: list) -> str:
    """How ``peers``' throughputs were obtained: all measured on calls served, all estimated, or a mix."""
    kinds = {"measured" if p.measured else "estimate" if p.measured is False else "unknown" for p in peers}
    return kinds.pop() if len(kinds) == 1 else "mixed" if kinds else "-"


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{max(0.0, seconds):.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.0f} h"


def format_status(run_id: str, peers: list, num_stages: int, now: float | None = None) -> str:
    """The ``status`` table for ``peers`` (``PeerInfo`` records of every state). A throughput that a peer has not
    measured on calls yet is marked as an estimate, and every peer's row says how old its figure is (``now``: the
    DHT time to count from, by default the current one)."""
    from hivemind.utils.timed_storage import get_dht_time

    from lightning_swarm.swarm.states import ONLINE

    now = get_dht_time() if now is None else now
    online_at = [[p for p in peers if p.stage == k and p.state == ONLINE] for k in range(num_stages)]
    totals = [sum(p.throughput for p in here) for here in online_at]
    bottleneck = min(range(num_stages), key=lambda k: totals[k]) if num_stages else None
    online = sum(p.state == ONLINE for p in peers)
    estimated = bottleneck is not None and _figure(online_at[bottleneck]) != "measured"
    lines = [
        f"run {run_id!r}: {num_stages} stages, {len(peers)} peers ({online} online); pipeline "
        f"{min(totals, default=0.0):.1f} samples/s{' (not measured yet)' if estimated else ''}, "
        f"bottleneck: stage {bottleneck}",
        "",
        f"{'stage':>5}  {'peers':>5}  {'online':>6}  {'samples/s':>10}  figure",
    ]
    for k in range(num_stages):
        here = [p for p in peers if p.stage == k]
        mark = "  <- bottleneck" if k == bottleneck else ""
        lines.append(
            f"{k:>5}  {len(here):>5}  {len(online_at[k]):>6}  {totals[k]:>10.1f}  "
            f"{_figure(online_at[k]):<8}{mark}".rstrip()
        )
    lines += ["", f"{'stage':>5}  {'state':<8}  {'samples/s':>10}  {'figure':<8}  {'age':>6}  peer"]
    for p in sorted(peers, key=lambda p: (p.stage, p.peer_id.to_base58())):
        age = "?" if p.figure_time is None else _age(now - p.figure_time)
        lines.append(
            f"{p.stage:>5}  {p.state:<8}  {p.throughput:>10.1f}  {_figure([p]):<8}  {age:>6}  {p.peer_id}"
        )
    if any(p.measured is False for p in peers):
        lines += [
            "",
            "estimate: a peer's guess from a matmul benchmark, until it has measured the calls it serves.",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="lightning-swarm", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_serve = sub.add_parser("serve", help="host one stage of a swarm (server-only peer)")
    p_serve.add_argument("module", help="LightningModule class, e.g. examples.albert.model.Albert")
    p_serve.add_argument("--config", help="LightningCLI YAML with model: and trainer.strategy.init_args:")
    p_status = sub.add_parser("status", help="print a table of the swarm's stages and peers")
    for p in (p_serve, p_status):
        p.add_argument(
            "--initial-peers",
            nargs="*",
            default=[],
            help="multiaddrs of peers already in the swarm (default: the LIGHTNING_SWARM_INITIAL_PEERS variable)",
        )
        p.add_argument("--run-id", dest="run_id", default=None)
        p.add_argument(
            "--num-stages",
            dest="num_stages",
            type=int,
            default=None,
            help="number of stages (serve: overrides the config; status: only needed for peers that do not announce it)",
        )
    p_status.add_argument(
        "--secret",
        default=None,
        help="a private swarm's secret (default: the LIGHTNING_SWARM_SECRET variable)",
    )
    p_serve.add_argument("--stage", type=int, default=None, help="stage to serve (default: the least served)")
    p_serve.add_argument("--compression", choices=["8bit", "fp16", "none"], default=None)
    p_serve.add_argument("--host-maddrs", nargs="*", default=[], help="addresses to listen on")
    args = parser.parse_args(argv)
    {"serve": serve, "status": status}[args.command](args)


if __name__ == "__main__":
    main(sys.argv[1:])
