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
- ``lightning-swarm doctor --initial-peers ADDR ... [--host-maddrs ...] [--run-id RUN] [--json]``: whether peers
  of the swarm can dial this machine, and how (directly, hole-punched, or through a relay at the initial peers),
  the round-trip time and throughput to every online stage peer (a small echo RPC), and what to change if it
  cannot join. Exits with 1 if it cannot.
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
    for key in ("run_id", "num_stages", "stage", "compression", "reachability"):
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


def doctor(args: argparse.Namespace) -> None:
    """Say whether this machine can join the swarm and how the swarm reaches it (direct, hole-punched, relayed),
    the round-trip time and throughput to each stage, and what to change if it cannot join."""
    import json
    import tempfile

    from hivemind.p2p import PeerID

    from lightning_swarm.swarm.dht.auth import SECRET_ENV, protect
    from lightning_swarm.swarm.dht.bootstrap import INITIAL_PEERS_ENV, env_peers
    from lightning_swarm.swarm.dht.identity import PeerIdentity
    from lightning_swarm.swarm.dht.process import SwarmDHT
    from lightning_swarm.swarm.dht.reachability import (
        ask_dial_back,
        circuit_addrs,
        daemon_options,
        dial_relayed,
        is_local,
        measure_link,
        serve_dial_back,
    )
    from lightning_swarm.swarm.loop import replicate_p2p, run_coroutine

    initial = args.initial_peers or env_peers()
    if not initial:
        raise SystemExit(
            f"error: doctor needs the address of a peer of the swarm: --initial-peers ADDR, or {INITIAL_PEERS_ENV}."
        )
    host_maddrs = args.host_maddrs or ["/ip4/127.0.0.1/tcp/0"]
    relays = [p for p in initial if not is_local(p) and "/p2p/" in p]
    askable = relays or [p for p in initial if "/p2p/" in p]
    run_id = args.run_id or "lightning_swarm"
    report: dict[str, Any] = {"run_id": run_id, "host_maddrs": host_maddrs, "initial_peers": initial}
    identity = PeerIdentity()
    secret = args.secret or os.environ.get(SECRET_ENV) or None
    if secret is not None:
        protect(identity.peer_id, secret)

    def ask(dht: Any, addrs: list[str]) -> dict[str, Any] | None:
        async def go() -> dict[str, Any] | None:
            p2p = await replicate_p2p(dht)
            try:
                for peer in askable:
                    try:
                        return await ask_dial_back(p2p, PeerID.from_base58(peer.rsplit("/p2p/", 1)[1]), addrs)
                    except Exception as e:
                        report.setdefault("unanswered", []).append(f"{peer}: {e!r}"[:300])
                return None
            finally:
                await p2p.shutdown()

        return run_coroutine(go(), timeout=120)

    dht = None
    with tempfile.TemporaryDirectory(prefix="swarm-doctor-") as tmp:
        key = os.path.join(tmp, "identity.key")
        identity.save(key)

        def start(options: dict[str, Any]) -> Any:
            return SwarmDHT(
                start=True,
                initial_peers=initial,
                host_maddrs=host_maddrs,
                identity_path=key,
                check_if_identity_free=False,
                **options,
            )

        try:
            dht = start(daemon_options("direct", relays))
            serve_dial_back(dht)
            own = [str(a) for a in dht.get_visible_maddrs(latest=True)]
            report["own_addrs"] = own
            direct = ask(dht, own)
            report["direct"] = direct
            if direct is None:
                report["reached"] = "no answer"
            elif direct.get("reachable"):
                report["reached"] = "direct"
            elif relays:
                dht.shutdown()
                dht = start(daemon_options("relay", relays))
                serve_dial_back(dht)
                relayed = ask(dht, list(circuit_addrs(relays)))
                report["relayed"] = relayed
                ok = relayed is not None and relayed.get("reachable")
                report["reached"] = relayed.get("via", "relay") if ok and relayed else "unreachable"
            else:
                report["reached"] = "unreachable"
            peers, num_stages = list_swarm(dht, run_id, args.num_stages)
            report["num_stages"] = num_stages
            links = []

            async def measure_all() -> None:
                p2p = await replicate_p2p(dht)
                try:
                    await dial_relayed(p2p, [(p.peer_id, p.relay_addrs) for p in peers if p.relay_addrs])
                    for p in peers:
                        if p.state != "online":
                            continue
                        row: dict[str, Any] = {"stage": p.stage, "peer": str(p.peer_id), "relayed": p.relayed}
                        try:
                            row.update(await measure_link(p2p, p.peer_id, nbytes=args.probe_bytes))
                            if p.relayed:
                                row["relay_limited"] = False
                        except Exception as e:
                            row["error"] = (str(e).strip().splitlines() or [repr(e)])[-1][:200]
                            if (
                                p.relayed
                            ):  # a relay on go-libp2p's default limits cuts a connection at 128 KiB
                                await dial_relayed(p2p, [(p.peer_id, p.relay_addrs)])
                                try:
                                    row.update(await measure_link(p2p, p.peer_id, nbytes=32 << 10))
                                    row["relay_limited"] = True
                                    del row["error"]
                                except Exception:
                                    pass
                        links.append(row)
                finally:
                    await p2p.shutdown()

            run_coroutine(measure_all(), timeout=60 + 30 * len(peers))
            report["stages"] = links
        except Exception as e:
            report["reached"] = report.get("reached", "cannot start")
            report["error"] = (str(e).strip().splitlines() or [repr(e)])[-1][:300]
        finally:
            if dht is not None:
                dht.shutdown()
    report["advice"] = _doctor_advice(report)
    if args.json:
        print(json.dumps(report))
    else:
        print(_format_doctor(report))
    if report["reached"] not in ("direct", "relay", "hole-punched"):
        raise SystemExit(1)


def _doctor_advice(report: dict[str, Any]) -> list[str]:
    reached, advice = report["reached"], []
    listening = report["host_maddrs"]
    if reached == "direct":
        advice.append("Nothing to change: peers dial this machine directly.")
    elif reached in ("relay", "hole-punched"):
        advice.append(
            "This machine can join: the swarm reaches it through a relay at its initial peers (reachability='auto' "
            "finds this by itself). Relayed calls are slower; to be dialled directly, listen on a public interface "
            f"(now {listening}; e.g. --host-maddrs /ip4/0.0.0.0/tcp/31337) and forward that TCP port on the router "
            "or firewall, then run doctor again."
        )
    elif reached == "no answer":
        advice.append(
            "No initial peer answered the reachability check: check that the addresses are current (with their "
            "/p2p/<peer id>) and that those peers run lightning-swarm with this check; for a private swarm pass "
            "--secret."
        )
    elif reached == "cannot start":
        advice.append(
            "This machine could not reach the swarm: check --initial-peers, outbound TCP to their ports, and "
            "--host-maddrs."
        )
    else:
        advice.append(
            "Peers cannot dial this machine and no relay could carry its calls: give initial peers that are public "
            "(not on this host), listen on a public interface and forward its port, or check that outbound TCP "
            "to the initial peers is allowed."
        )
    limited = [row for row in report.get("stages", []) if row.get("relay_limited")]
    if limited:
        advice.append(
            f"{len(limited)} relayed stage peer(s) are reached through a relay that cuts each connection after "
            "128 KiB (its p2p daemon kept go-libp2p's default relay limits): restart that relay peer, or give "
            "the NAT'd peers more public initial peers to reserve relay slots at."
        )
    slow = [row for row in report.get("stages", []) if "error" in row]
    if slow:
        advice.append(
            f"{len(slow)} stage peer(s) did not answer the link probe (older versions, or unreachable from here)."
        )
    return advice


def _format_doctor(report: dict[str, Any]) -> str:
    reached = report["reached"]
    how = {
        "direct": "yes, directly",
        "relay": "yes, through a relay",
        "hole-punched": "yes, directly after hole punching",
    }.get(reached, f"no ({reached})")
    lines = [f"run {report['run_id']!r}: can peers reach this machine? {how}"]
    if report.get("own_addrs"):
        lines.append(f"  listening on: {' '.join(report['own_addrs'])}")
    direct = report.get("direct") or {}
    if direct and not direct.get("reachable"):
        lines.append(f"  a direct dial failed: {direct.get('error')}")
    if report.get("error"):
        lines.append(f"  error: {report['error']}")
    rows = report.get("stages", [])
    if rows:
        lines += ["", f"{'stage':>5}  {'via':<6}  {'rtt ms':>7}  {'up Mbit/s':>9}  {'down Mbit/s':>11}  peer"]
        for row in sorted(rows, key=lambda r: (r["stage"], r["peer"])):
            via = ("relay!" if row.get("relay_limited") else "relay") if row["relayed"] else "direct"
            if "error" in row:
                lines.append(
                    f"{row['stage']:>5}  {via:<6}  {'-':>7}  {'-':>9}  {'-':>11}  {row['peer']} ({row['error']})"
                )
            else:
                lines.append(
                    f"{row['stage']:>5}  {via:<6}  {row['rtt_ms']:>7.1f}  {row['up_mbit']:>9.1f}  "
                    f"{row['down_mbit']:>11.1f}  {row['peer']}"
                )
    elif "num_stages" in report:
        lines.append(f"  no online stage peer of run {report['run_id']!r} found (check --run-id)")
    lines += ["", *report["advice"]]
    return "\n".join(lines)


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
    p_serve.add_argument(
        "--reachability",
        choices=["auto", "direct", "relay"],
        default=None,
        help="how peers reach this one: auto (default: asks an initial peer to dial it back, else through relays), "
        "direct (a public address or forwarded port), relay (behind NAT: through the initial peers)",
    )
    p_doctor = sub.add_parser(
        "doctor",
        help="can this machine join the swarm, how is it reached, and how fast is each stage from here",
    )
    p_doctor.add_argument("--initial-peers", nargs="*", default=[], help="multiaddrs of peers of the swarm")
    p_doctor.add_argument("--run-id", dest="run_id", default=None)
    p_doctor.add_argument("--num-stages", dest="num_stages", type=int, default=None)
    p_doctor.add_argument(
        "--host-maddrs",
        nargs="*",
        default=[],
        help="the addresses a peer here would listen on (as for serve)",
    )
    p_doctor.add_argument("--secret", default=None, help="a private swarm's secret")
    p_doctor.add_argument(
        "--probe-bytes",
        dest="probe_bytes",
        type=int,
        default=1 << 20,
        help="bytes of the throughput probe each way",
    )
    p_doctor.add_argument("--json", action="store_true", help="print the report as one JSON object")
    args = parser.parse_args(argv)
    {"serve": serve, "status": status, "doctor": doctor}[args.command](args)


if __name__ == "__main__":
    main(sys.argv[1:])
