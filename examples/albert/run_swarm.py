"""The main job: start a local swarm that trains ALBERT, follow it, and compare it with one plain process.

    python examples/albert/run_swarm.py                       # 2 stages x 2 peers; the first also trains
    python examples/albert/run_swarm.py --kill-peer-halfway   # kill one server peer halfway, start a replacement
    python examples/albert/run_swarm.py -- --trainer.max_steps=30   # after `--`: LightningCLI arguments for every peer

Every peer is its own process running ``train.py fit --config configs/peer.yaml`` (what a peer on another machine
runs), joined through a small bootstrap DHT node that this launcher holds: ``stages x peers_per_stage`` server peers
(each serves one stage), of which the first ``trainers`` also feed data (role ``both``; the first one's progress bar
is shown). With ``--separate-trainers`` the trainers are peers of their own (role ``trainer``) instead: one more
process each on the same cores (in 20-step runs, about 15% slower than
trainers that serve a stage).
Because the launcher owns each peer's process, one can die without taking the others down.

When the trainers are done, the same model, data, seed, global batch and number of optimizer steps are trained in
one plain Lightning process (``configs/single.yaml``), and the launcher prints a summary (steps, samples,
throughput, bytes on the wire and saved by 8-bit compression, held-out MLM loss of both) and writes ``loss.png``
with both loss curves and ``summary.json`` to ``--out``. Peer logs are in ``--out/logs``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

from lightning_swarm.swarm.allocator import allocator_env
from lightning_swarm.swarm.lifetime import dies_with_this_process

warnings.filterwarnings("ignore", category=FutureWarning)  # torch.jit deprecation notes from dependencies

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
HERE = Path(__file__).resolve().parent
TRAIN = HERE / "train.py"
S = "--trainer.strategy.init_args"


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--config", default=str(HERE / "configs" / "peer.yaml"), help="LightningCLI config of a peer"
    )
    p.add_argument("--baseline-config", default=str(HERE / "configs" / "single.yaml"))
    p.add_argument("--stages", type=int, default=2, help="pipeline stages (= model.num_groups)")
    p.add_argument("--peers-per-stage", type=int, default=2, help="server peers started for each stage")
    p.add_argument("--trainers", type=int, default=1, help="how many peers feed data")
    p.add_argument(
        "--separate-trainers",
        dest="trainers_serve",
        action="store_false",
        help="run the trainers as peers of their own (role trainer) instead of as the first server peers (role "
        "both, the default: one process fewer per trainer on the same cores, and its calls to its own stage stay "
        "in the process)",
    )
    p.add_argument("--trainers-serve", dest="trainers_serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument(
        "--steps", type=int, default=None, help="optimizer steps (default: the config's max_steps)"
    )
    p.add_argument(
        "--kill-peer-halfway",
        action="store_true",
        help="at half of the steps, kill a server peer of the last stage (SIGKILL) and start a replacement",
    )
    p.add_argument("--no-baseline", action="store_true", help="skip the single-process baseline")
    p.add_argument("--out", default=str(ROOT / "runs" / "albert"), help="where results and logs go")
    p.add_argument("--run-id", default=None, help="swarm run id (default: albert_<pid>)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds before the run is stopped")
    args = p.parse_args(argv)
    if args.stages < 1 or args.peers_per_stage < 1 or args.trainers < 1:
        p.error("--stages, --peers-per-stage and --trainers must be at least 1")
    if args.kill_peer_halfway and args.peers_per_stage < 2:
        p.error("--kill-peer-halfway needs --peers-per-stage >= 2 (a stage must keep a live peer)")
    if args.trainers_serve and args.trainers > args.stages * args.peers_per_stage:
        p.error(
            "with --trainers-serve, --trainers cannot exceed the number of peers (stages x peers-per-stage)"
        )
    if (
        args.kill_peer_halfway
        and args.trainers_serve
        and args.trainers > args.stages * (args.peers_per_stage - 1)
    ):
        p.error("--kill-peer-halfway kills a server-only peer of the last stage: use fewer --trainers")
    return args, extra


class Peer:
    """One peer process, in its own process group (so its hivemind daemons go down with it)."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log: Path | None) -> None:
        self.name, self.cmd, self.log = name, cmd, log
        out = open(log, "w") if log is not None else None  # noqa: SIM115 (closed in stop)
        self._out = out
        self.proc = subprocess.Popen(
            cmd,
            env=env,
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
            start_new_session=True,
            preexec_fn=dies_with_this_process(),  # gone with the launcher, even when it is SIGKILLed
        )

    def poll(self) -> int | None:
        return self.proc.poll()

    def kill(self) -> None:
        """SIGKILL the whole process group: what a preempted machine looks like to the swarm."""
        self._signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.proc.wait()
        self._signal(signal.SIGKILL)  # anything left in its group (daemons) goes too
        if self._out is not None:
            self._out.close()
            self._out = None

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def peer_cmd(config: str, role: str, stage: int | None, history: Path | None, extra: list[str]) -> list[str]:
    cmd = [sys.executable, str(TRAIN), "fit", "--config", config, f"{S}.role={role}"]
    if stage is not None:
        cmd.append(f"{S}.stage={stage}")
    if history is not None:
        callbacks = [
            {
                "class_path": "examples.albert.callbacks.TrainingHistory",
                "init_args": {"path": str(history), "progress_every": 1},  # the launcher follows the steps
            },
        ]
        cmd.append(f"--trainer.callbacks={json.dumps(callbacks)}")
    else:
        cmd += ["--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]
    return cmd + extra


def config_value(config: str, extra: list[str], key: str) -> object:
    """The value of ``key`` (dotted) for a peer: the last ``--key=value`` override in ``extra``, else the config."""
    import yaml

    for arg in reversed(extra):
        if arg.startswith(f"--{key}="):
            return yaml.safe_load(arg.split("=", 1)[1])
    node: object = yaml.safe_load(open(config)) or {}
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            raise RuntimeError(f"{config} has no {key}; pass --{key}=VALUE after `--`.")
        node = node[part]
    return node


def prepare_data(config: str, extra: list[str]) -> None:
    """Train (or load) the tokenizer once before the peers start, so they do not all train it at the same time."""
    import yaml

    from examples.albert.data import AlbertDataModule

    data = dict((yaml.safe_load(open(config)) or {}).get("data") or {})
    for arg in extra:
        if arg.startswith("--data.") and "=" in arg:
            key, value = arg[len("--data.") :].split("=", 1)
            data[key] = yaml.safe_load(value)
    AlbertDataModule(**data).setup()


def run_swarm(args: argparse.Namespace, extra: list[str]) -> dict:
    import hivemind

    out = Path(args.out)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    run_id = args.run_id or f"albert_{os.getpid()}"
    # the trainers step together (as DDP's ranks): a global step is every trainer's batches of one optimizer step
    target = int(config_value(args.config, extra, "trainer.strategy.init_args.target_batch_size"))
    extra = [
        f"{S}.run_id={run_id}",
        f"{S}.num_stages={args.stages}",
        f"--model.num_groups={args.stages}",
        f"{S}.stage_steps=trainer",
        f"{S}.num_trainers={args.trainers}",
        f"{S}.target_batch_size={args.trainers * target}",
        *extra,
    ]
    if args.steps is not None:
        extra.append(f"--trainer.max_steps={args.steps}")
    print("Preparing the corpus and the tokenizer (cached after the first run) ...", flush=True)
    prepare_data(args.config, extra)
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    env = dict(os.environ)
    env["LIGHTNING_SWARM_INITIAL_PEERS"] = ",".join(str(a) for a in dht.get_visible_maddrs())
    env["OMP_NUM_THREADS"] = "1"  # several peers share the cores: one compute thread each
    env.update(allocator_env(env))  # what the strategy's own launcher gives its peers (see swarm.allocator)
    env["ALBERT_QUIET"] = "1"
    env.setdefault("PYTHONWARNINGS", "ignore::FutureWarning,ignore::UserWarning")
    peers: list[Peer] = []
    servers: dict[str, tuple[Peer, int]] = {}
    trainers: list[tuple[Peer, Path]] = []
    events: list[str] = []
    started = time.monotonic()
    try:
        index = 0
        for j in range(args.peers_per_stage):
            for k in range(args.stages):
                # the first `trainers` peers of the swarm also train, unless trainers run as peers of their own
                trains = args.trainers_serve and index < args.trainers
                role = "both" if trains else "server"
                name = f"{'trainer' if trains else 'server'}{len(trainers) if trains else ''}-s{k}-{j}"
                history = out / f"trainer{len(trainers)}.json" if trains else None
                seed = [f"--data.seed={len(trainers)}"] if trains else []
                log = None if trains and not trainers else logs / f"{name}.log"
                peer = Peer(name, peer_cmd(args.config, role, k, history, extra + seed), env, log)
                peers.append(peer)
                if trains:
                    history.unlink(missing_ok=True)
                    trainers.append((peer, history))
                else:
                    servers[name] = (peer, k)
                index += 1
        for t in range(args.trainers if (not args.trainers_serve) else 0):
            history = out / f"trainer{t}.json"
            history.unlink(missing_ok=True)
            cmd = peer_cmd(args.config, "trainer", None, history, extra + [f"--data.seed={t}"])
            peer = Peer(f"trainer{t}", cmd, env, None if t == 0 else logs / f"trainer{t}.log")
            peers.append(peer)
            trainers.append((peer, history))
        print(
            f"Started a swarm of {len(peers)} peers: {args.stages} stages x {args.peers_per_stage} servers, "
            f"{args.trainers} trainer(s){' among them' if args.trainers_serve else ''}; logs in {logs}",
            flush=True,
        )
        kill_at = None
        replaced = False
        deadline = time.monotonic() + args.timeout
        while any(p.poll() is None for p, _ in trainers):
            if time.monotonic() > deadline:
                raise TimeoutError(f"The swarm run did not finish within {args.timeout:.0f} s (see {logs}).")
            for p, _ in trainers:
                if p.poll() not in (None, 0):
                    raise RuntimeError(
                        f"{p.name} failed with exit code {p.poll()} (see {p.log or 'the output'})."
                    )
            progress = read_json(trainers[0][1]) or {}
            if kill_at is None and progress.get("max_steps"):
                kill_at = progress["max_steps"] // 2
            step = progress.get("step", [0])[-1] if progress.get("step") else 0
            if args.kill_peer_halfway and not replaced and kill_at is not None and step >= kill_at:
                name = [n for n, (_, k) in servers.items() if k == args.stages - 1][0]
                victim, stage = servers[name]
                victim.kill()
                new = f"server-s{stage}-replacement"
                cmd = peer_cmd(args.config, "server", stage, None, extra)
                peer = Peer(new, cmd, env, logs / f"{new}.log")
                peers.append(peer)
                servers[new] = (peer, stage)
                replaced = True
                events.append(f"step {step}: killed {name} (SIGKILL) and started {new}")
                print(
                    f"\n[run_swarm] step {step}: killed {name} (SIGKILL); started {new} to replace it",
                    flush=True,
                )
            time.sleep(0.5)
        # server peers leave on their own once every trainer is done; one that never saw a trainer (a replacement
        # that came up after the trainers had finished) keeps waiting for trainers to appear, so it is stopped
        linger = min(deadline, time.monotonic() + 60.0)
        for name, (p, _) in servers.items():
            try:
                p.proc.wait(timeout=max(1.0, linger - time.monotonic()))
            except subprocess.TimeoutExpired:
                events.append(f"{name} did not leave on its own; stopped")
    finally:
        for p in peers:
            p.stop()
        dht.shutdown()
    for p, _ in trainers:
        if p.poll() != 0:
            raise RuntimeError(
                f"{p.name} failed with exit code {p.poll()} (see {p.log or 'its output above'})."
            )
    histories = [read_json(h) for _, h in trainers]
    if not all(h and h.get("done") for h in histories):
        raise RuntimeError(f"A trainer ended without writing its results (see {logs}).")
    return {"histories": histories, "events": events, "wall_s": time.monotonic() - started}


def run_baseline(args: argparse.Namespace, extra: list[str], steps: int) -> dict:
    history = Path(args.out) / "single.json"
    history.unlink(missing_ok=True)
    keep = [a for a in extra if not a.startswith(S)]
    cmd = [
        sys.executable,
        str(TRAIN),
        "fit",
        "--config",
        args.baseline_config,
        "--trainer.enable_model_summary=false",
    ]
    callbacks = [
        {"class_path": "examples.albert.callbacks.TrainingHistory", "init_args": {"path": str(history)}},
    ]
    cmd += [f"--trainer.callbacks={json.dumps(callbacks)}", f"--model.num_groups={args.stages}", *keep]
    # the same global batch as the swarm's optimizer steps: every trainer's target_batch_size samples, in
    # microbatches
    target = args.trainers * int(
        config_value(args.config, extra, "trainer.strategy.init_args.target_batch_size")
    )
    batch = int(config_value(args.config, extra, "data.batch_size"))
    if target % batch:
        raise RuntimeError(f"target_batch_size={target} must be a multiple of data.batch_size={batch}.")
    cmd.append(f"--trainer.accumulate_grad_batches={target // batch}")
    cmd.append(f"--trainer.max_steps={steps}")
    print(
        f"\nTraining the same model in one plain Lightning process for {steps} optimizer steps ...",
        flush=True,
    )
    env = dict(os.environ)
    env.setdefault("PYTHONWARNINGS", "ignore::FutureWarning,ignore::UserWarning")
    env["ALBERT_QUIET"] = "1"
    # the swarm has finished: the single process gets every core (the fair baseline for samples/s)
    env["OMP_NUM_THREADS"] = str(os.cpu_count() or 1)
    env.update(allocator_env(env))  # the peers' allocator settings: equal terms
    started = time.monotonic()
    subprocess.run(
        cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL, preexec_fn=dies_with_this_process()
    )
    result = read_json(history)
    if not result or not result.get("done"):
        raise RuntimeError("The single-process baseline did not write its results.")
    result["wall_s"] = time.monotonic() - started
    return result


def summarize(args: argparse.Namespace, swarm: dict, baseline: dict | None) -> dict:
    from examples.albert.plot import plot_losses

    hs = swarm["histories"]
    steps = max(h["step"][-1] for h in hs) if hs else 0
    samples = sum(h["samples"][-1] for h in hs)
    train_s = max(h["time"][-1] for h in hs)
    sent = sum(h.get("swarm", {}).get("swarm/bytes_sent", 0.0) for h in hs)
    recv = sum(h.get("swarm", {}).get("swarm/bytes_recv", 0.0) for h in hs)
    fp32 = sum(h.get("fp32_boundary_bytes", 0.0) for h in hs)
    summary = {
        "steps": steps,
        "samples": samples,
        "train_seconds": round(train_s, 1),
        "samples_per_second": round(samples / train_s, 1) if train_s else None,
        "wire_bytes": sent + recv,
        "fp32_wire_bytes": fp32,
        "bytes_saved_by_compression": max(0.0, fp32 - (sent + recv)),
        "stage_steps": hs[0].get("stage_steps"),
        "eval_loss_swarm": hs[0].get("eval_loss"),
        "eval_loss_single": baseline.get("eval_loss") if baseline else None,
        "events": swarm["events"],
        "swarm_wall_s": round(swarm["wall_s"], 1),
    }
    if baseline and baseline.get("time") and baseline["time"][-1] > 0:
        single_sps = baseline["samples"][-1] / baseline["time"][-1]
        summary["single_samples_per_second"] = round(single_sps, 1)
        summary["efficiency"] = round(summary["samples_per_second"] / single_sps, 3) if train_s else None
    if baseline:
        summary["relative_gap"] = (
            abs(summary["eval_loss_swarm"] - summary["eval_loss_single"]) / summary["eval_loss_single"]
        )
    out = Path(args.out)
    curves = {f"swarm (trainer {i})": h for i, h in enumerate(hs)}
    if baseline:
        curves["single process"] = baseline
    plot_losses(curves, out / "loss.png", events=swarm["events"])
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    mb = 1e6
    print("\n================ ALBERT in a swarm: summary ================")
    stage_steps = "" if not summary["stage_steps"] else f"; the stages stepped {summary['stage_steps']} times"
    trainers = f"{len(hs)} trainers' batches" if len(hs) > 1 else "the trainer's batches"
    print(f"optimizer steps       {steps} (global batch = {trainers} of one step{stage_steps})")
    print(f"samples               {samples} in {train_s:.0f} s: {summary['samples_per_second']} samples/s")
    if summary.get("efficiency") is not None:
        print(
            f"one process, same box  {summary['single_samples_per_second']} samples/s (all cores): the swarm runs at "
            f"{summary['efficiency']:.2f} of its speed"
        )
    print(f"bytes on the wire     {(sent + recv) / mb:.1f} MB (8-bit boundaries)")
    if fp32:
        print(
            f"saved by compression  {summary['bytes_saved_by_compression'] / mb:.1f} MB (fp32 would be {fp32 / mb:.1f} MB)"
        )
    print(f"held-out MLM loss     swarm {summary['eval_loss_swarm']:.3f}", end="")
    if baseline:
        print(
            f"  |  single process {summary['eval_loss_single']:.3f} (same steps and global batch; "
            f"relative gap {summary['relative_gap']:.3f})"
        )
    else:
        print()
    for event in swarm["events"]:
        print(f"event                 {event}")
    print(f"plot                  {out / 'loss.png'}")
    print("=============================================================")
    return summary


def main(argv: list[str] | None = None) -> None:
    args, extra = parse_args(argv)
    # `kill` stops the peers as Ctrl-C does
    signal.signal(signal.SIGTERM, functools.partial(_interrupt, os.getpid()))
    try:
        run(args, extra)
    except (RuntimeError, TimeoutError, subprocess.CalledProcessError) as e:
        raise SystemExit(f"run_swarm: {e}") from None
    except KeyboardInterrupt:
        raise SystemExit("run_swarm: interrupted; every peer was stopped.") from None


def _interrupt(launcher_pid: int, signum: int, frame: object) -> None:
    if os.getpid() != launcher_pid:  # a child forked by the launcher (its bootstrap DHT): end quietly
        os._exit(128 + signum)
    raise KeyboardInterrupt


def run(args: argparse.Namespace, extra: list[str]) -> None:
    swarm = run_swarm(args, extra)
    steps = max(h["step"][-1] for h in swarm["histories"])
    baseline = None if args.no_baseline else run_baseline(args, extra, steps)
    summarize(args, swarm, baseline)


if __name__ == "__main__":
    main()
