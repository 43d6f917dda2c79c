"""SWARM against what a user would pick instead, training one Transformer on two CPU "machines" joined by a slow link.

    python benchmarks/swarm_vs_alternatives.py [--quick]      (as root: creates network namespaces)

The model (config in the JSON): token + position embeddings, 8 ``nn.TransformerEncoderLayer`` blocks of hidden
size 1024 (16 heads, FFN 4096, pre-norm, dropout 0),
final LayerNorm and a vocabulary head; ~103M parameters, AdamW. Synthetic token data; every variant trains the
same number of samples at the same global batch, split into the same microbatches (``--quick``: 12 global steps,
the last 9 timed: the throughput of a 3-step window moved by +-15% between runs on the shared box; DDP, whose step
takes ~45 s at 100 Mbit/s, trains ``ddp_global_steps`` = 6, the last 3 timed):

- ``swarm``: ``SwarmStrategy(num_stages=2, compression="8bit", microbatches=M)``, 2 peers: peer A (namespace 0) is
  the trainer (embeddings, head, loss) and serves stage 0 (blocks 0-3); peer B (namespace 1) serves stage 1 (blocks
  4-7). One trainer step is one global batch, cut into the same M microbatches as GPipe's, which flow through the
  two stages at once (stage 1 on microbatch i while stage 0 on i + 1, forward and backward); the stages step when
  the trainer's optimizer steps (``stage_steps="trainer"``: the step of one process, as GPipe's), each as soon as
  its own backwards of the batch are done (early stage steps, as each GPipe rank steps after its own backwards);
- ``gpipe``: ``torch.distributed.pipelining`` with ``ScheduleGPipe`` over gloo, rank 0 = embeddings + blocks 0-3,
  rank 1 = blocks 4-7 + head + loss, same microbatches, fp32 boundaries; ``gpipe_fp16``: the same with the
  boundary cast to fp16 inside the model (the pipelining API has no codec: the stage's output is cast to fp16 and
  cast back on the next rank, so activations and their gradients cross the link as fp16);
- ``ddp``: Lightning's ``"ddp"`` (torch DDP, gloo) of the whole model, 2 ranks, global batch / 2 each.

Each variant's two processes run in two network namespaces joined by a veth pair shaped with ``tc`` (``testbed/netns.py``)
to 100 Mbit/s and to 1 Gbit/s; each side is pinned to one core (``taskset``, with all its helper processes: the
hivemind DHT and p2p daemon of a swarm peer) and computes on one torch thread: two one-core machines. On loopback in
one namespace: ``swarm_local`` is ``Trainer(strategy=SwarmStrategy(num_trainers=1), devices=2)`` (the library's
own local launcher: 2 peers, one trainer, one peer per stage, both cores, each peer's torch threads as the
launcher sets them: its peers take turns, so each gets the 2 cores' threads; the trainer feeds the
whole global batch per step, as the baseline does, unless ``--model '{"local_microbatch": N}'`` asks for N rows)
against plain one-process Lightning on the same 2 cores with the whole global batch per step, with 2 threads (``single``) and with 1 thread
(``single_1thread``: faster on a busy box): ``efficiency_single_box`` = samples/s of ``swarm_local`` / samples/s of
the faster of the two (both ratios are in the JSON too).

Throughput: samples/s between the end of the warm-up global step(s) and the end of the last step, clocked in the
process that feeds the data (swarm trainer, GPipe rank 0, DDP rank 0). Bytes per sample: what crossed the shaped
link (rank 0's veth, sent + received) in that window, divided by the samples. ``calibration`` times, on one pinned
core and one thread, each stage's forward and forward+backward per microbatch, so that the JSON shows where the
time goes: ``compute_ms_per_microbatch``, ``wire_ms_per_microbatch_*`` (measured bytes / link rate) and bounds on
the best speedups these two cores allow (``bound_*``: an ideal swarm whose two stages are perfectly overlapped with
each other and the wire, no framework time). Where a swarm's own time goes: ``cpu_s_per_sample`` (CPU seconds per
sample in the timed window of every process of the run, by kind: peer/rank main processes, hivemind helper processes,
p2p daemons), ``main_process_thread_cpu_s_per_sample`` (the trainer process's Python threads) and
``call_ms_per_microbatch`` (wall time of the trainer's stage calls, summed over concurrent ones;
``trainer_rest_ms_per_microbatch`` the time no stage call was in flight).
The machine is shared: the JSON records the load average; CPU seconds move less with the load than wall times.
Runs of one code on this box move by up to +-15% from one minute to the next (both sides: GPipe's too), so
``--rounds N`` runs the swarm and GPipe variants N times on each link, interleaved (swarm, GPipe, fp16 GPipe,
swarm, ...), takes each variant's median run for the figures and lists every round (``per_link.<link>.rounds``,
with the swarm's ratio to GPipe round by round). ``--split-ablation`` adds ``swarm_whole``, the swarm with every
backward run whole (``LIGHTNING_SWARM_SPLIT_BACKWARD=0``, see ``lightning_swarm/swarm/server/weight_grads.py``),
right after each swarm run: ``speedup_from_split_backward``.

The last stdout line is one JSON object; ``swarm_vs_alternatives.json`` and ``swarm_vs_alternatives.png`` (bar
chart) are written to ``--out`` (default ``runs/swarm_vs_alternatives``). Every process started is ended with the
benchmark (also on Ctrl-C/SIGTERM) and the namespaces are deleted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _harness
from _harness.counters import cpu_snapshot, cpu_split, link_bytes, thread_cpu

REPO = _harness.ROOT
PORT = 31337  # DHT/p2p port of swarm peer A, and the gloo rendezvous port (namespaces have their own ports)

MODEL = {"vocab": 1024, "hidden": 1024, "heads": 16, "ffn": 4096, "layers": 8, "lr": 1e-4}
QUICK = {
    "seq": 16,
    "microbatch": 2,
    "microbatches": 4,
    "global_steps": 12,
    "warmup_steps": 3,
    "ddp_global_steps": 6,
}
FULL = {"seq": 32, "microbatch": 4, "microbatches": 8, "global_steps": 8, "warmup_steps": 3}


# ----------------------------------------------------------------------------------- model (every worker)
def build_model(cfg: dict) -> Any:
    import torch
    from lightning.pytorch import LightningModule
    from torch import nn

    class TransformerLM(LightningModule):
        """Embeddings and head on the trainer; ``blocks`` (an nn.Sequential) is what SwarmStrategy cuts in 2."""

        def __init__(self) -> None:
            super().__init__()
            h = cfg["hidden"]
            self.embed = nn.Embedding(cfg["vocab"], h)
            self.pos = nn.Embedding(cfg["seq"], h)
            self.blocks = nn.Sequential(
                *(
                    nn.TransformerEncoderLayer(
                        h, cfg["heads"], cfg["ffn"], dropout=0.0, batch_first=True, norm_first=True
                    )
                    for _ in range(cfg["layers"])
                )
            )
            self.norm = nn.LayerNorm(h)
            self.head = nn.Linear(h, cfg["vocab"])

        def embed_tokens(self, x: torch.Tensor) -> torch.Tensor:
            return self.embed(x) + self.pos.weight[: x.size(1)]

        def logits(self, h: torch.Tensor) -> torch.Tensor:
            return self.head(self.norm(h))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return _lm_loss(self.logits(self.blocks(self.embed_tokens(x))), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=cfg["lr"])

    return TransformerLM()


def make_data(cfg: dict, num_samples: int) -> Any:
    import torch
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(1234)
    x = torch.randint(0, cfg["vocab"], (num_samples, cfg["seq"]), generator=g)
    return TensorDataset(x, torch.roll(x, -1, dims=1))  # next-token targets of random tokens


def worker_sessions(out: Path) -> set[int]:
    """This worker's session and the other workers' of the run (the harness lists their pids in pids.txt; each
    worker leads its own session)."""
    sessions = {os.getsid(0)}
    try:
        sessions |= {int(p) for p in (out / "pids.txt").read_text().split()}
    except OSError:
        pass
    return sessions


def summarize_clock(times: list[float], wire: list[int | None], warm: int, samples_per_step: int) -> dict:
    steps = len(times) - 1 - warm
    elapsed = times[-1] - times[warm]
    b0, b1 = wire[warm], wire[-1]
    samples = steps * samples_per_step
    return {
        "timed_steps": steps,
        "timed_samples": samples,
        "elapsed_s": elapsed,
        "samples_per_s": samples / elapsed,
        "step_ms": [round(1e3 * (b - a), 1) for a, b in zip(times, times[1:], strict=False)],
        "link_bytes": None if b0 is None or b1 is None else b1 - b0,
        "bytes_per_sample": None if b0 is None or b1 is None else (b1 - b0) / samples,
    }


# ----------------------------------------------------------------------------------- workers
def lightning_worker(args: argparse.Namespace, cfg: dict) -> None:
    """``single``, ``ddp``, ``swarm`` (peer A or B, one namespace each) and ``swarm_local`` (devices=2)."""
    import torch
    from lightning.pytorch import Trainer, seed_everything
    from torch.utils.data import DataLoader

    import lightning_swarm

    if args.threads > 0:  # 0: the library's choice (swarm_local: its launcher's thread policy)
        torch.set_num_threads(args.threads)
    mb, m, steps = cfg["microbatch"], cfg["microbatches"], cfg["global_steps"]
    global_batch = mb * m

    class Clock(_harness.lightning_clock_class()):
        """The step clock with the bytes on the link (``wire``), plus CPU snapshots of every process of the run
        and of this process's threads where the timed window starts and ends, and the trainer's stage calls."""

        def __init__(self) -> None:
            super().__init__(wire=link_bytes)
            self.snapshots: list[dict] = []
            self.threads: list[dict[str, float]] = []
            self.calls: list[tuple[int, str, float, float]] = []  # stage, kind, start, end (swarm trainer)
            self.stats: dict[str, float] = {}
            self.mains: dict[int, str] = {os.getpid(): "peer0_trainer" if args.variant != "ddp" else "rank0"}

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            launcher = getattr(trainer.strategy, "_launcher", None)
            for i, proc in enumerate(getattr(launcher, "procs", None) or [], start=1):
                self.mains[proc.pid] = f"peer{i}_server"  # the local swarm's other peer
            peer = getattr(trainer.strategy, "_peer", None)
            if peer is not None and peer.client is not None and peer.is_trainer:
                client, call = peer.client, peer.client.send  # time every stage call of this trainer

                def timed_call(stage: int, request: Any, *a: Any, **kw: Any) -> Any:
                    start = time.perf_counter()
                    try:
                        return call(stage, request, *a, **kw)
                    finally:
                        self.calls.append((stage, request.kind, start, time.perf_counter()))

                client.send = timed_call

        def mark_with_cpu(self, cpu: bool) -> None:
            # the CPU snapshots (reading /proc) are taken only where the timed window starts and ends
            self.snapshots.append(cpu_snapshot(worker_sessions(Path(args.out))) if cpu else {})
            self.threads.append(thread_cpu() if cpu else {})
            self.mark()

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self.mark_with_cpu(cpu=len(self.times) == warm)

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            self.mark_with_cpu(cpu=True)
            peer = getattr(trainer.strategy, "_peer", None)
            self.stats = peer.stats() if peer is not None else {}

    seed_everything(0)
    model = build_model(cfg)
    data = make_data(cfg, steps * global_batch)
    variant = args.variant
    settings = {
        "pipeline": "blocks",
        "num_stages": 2,
        "compression": "8bit",
        "target_batch_size": global_batch,
        "run_id": "swarm_vs_alternatives",
        "no_peers_timeout": 300.0,
        "request_timeout": 120.0,
        "matchmaking_time": 1.0,
        "averaging_timeout": 10.0,
        "rebalance_period": 0.0,
        "linger_timeout": 120.0,
        # one trainer: the stages step when its optimizer steps (the step of one process, as GPipe's); the peers of
        # the namespace variant are started apart, so "auto" cannot know there is only one trainer
        "stage_steps": "trainer",
        # the global batch per trainer step, cut into the same microbatches as GPipe's, which flow through the
        # stages at once (lightning_swarm/swarm/client/pipelining.py)
        "microbatches": m,
    }
    num_nodes, devices = 1, 1
    if variant in ("single", "single_1thread"):
        strategy: Any = "auto"
        batch, samples_per_step, warm = global_batch, global_batch, cfg["warmup_steps"]
    elif variant == "ddp":
        strategy, num_nodes = "ddp", 2
        batch, samples_per_step, warm = global_batch // 2, global_batch, cfg["warmup_steps"]
    elif variant == "swarm_local":  # the library's own local swarm: 2 peers, peer 0 trains and serves stage 0
        # same batch as the single-process baseline it is compared with: the whole global batch per trainer step,
        # sent whole ("auto": one peer per stage); on one box the stages share the cores, and chunks add calls
        # ``--model '{"same_host": false}'``: stage 1's calls through the p2p daemons instead of the Unix socket
        local = {
            **settings,
            "microbatches": cfg.get("local_microbatches", "auto"),
            "same_host": cfg.get("same_host", True),
        }
        strategy = lightning_swarm.SwarmStrategy(num_trainers=1, **local)
        devices = 2
        local_mb = cfg.get("local_microbatch") or global_batch  # rows per trainer step (target: global_batch)
        batch, samples_per_step, warm = local_mb, local_mb, cfg["warmup_steps"] * global_batch // local_mb
    else:  # "swarm": peer A (trainer + stage 0) or B (stage 1 only), each in its own namespace
        a = args.peer == "A"
        strategy = lightning_swarm.SwarmStrategy(
            role="both" if a else "server",
            stage=0 if a else 1,
            host_maddrs=[f"/ip4/{args.address}/tcp/{PORT}"],
            identity_path=args.identity if a else None,
            initial_peers=[] if a else [args.initial_peer],
            **settings,
        )
        batch, samples_per_step, warm = global_batch, global_batch, cfg["warmup_steps"]
    clock = Clock()
    trainer = Trainer(
        accelerator="cpu",
        devices=devices,
        num_nodes=num_nodes,
        strategy=strategy,
        max_steps=len(data) // batch if variant != "ddp" else len(data) // global_batch,
        **_harness.QUIET_TRAINER,
        limit_val_batches=0,
        callbacks=[clock],
    )
    trainer.fit(model, DataLoader(data, batch_size=batch, shuffle=False))
    if not clock.times or trainer.global_rank != 0 or (variant == "swarm" and args.peer != "A"):
        return  # a serving-only swarm peer, or DDP rank 1
    result = summarize_clock(clock.times, clock.readings["wire"], warm, samples_per_step)
    result["threads"] = torch.get_num_threads()
    other = "peer1_server" if variant == "swarm" else "rank1"
    mains = {pid: other for pid in worker_sessions(Path(args.out)) if pid != os.getpid()} | clock.mains
    split = cpu_split(clock.snapshots[warm], clock.snapshots[-1], mains)
    result["cpu_s_per_sample"] = {k: round(v / result["timed_samples"], 4) for k, v in sorted(split.items())}
    result["cpu_s_per_sample_total"] = round(sum(split.values()) / result["timed_samples"], 4)
    faults = cpu_split(clock.snapshots[warm], clock.snapshots[-1], mains, field=2)
    result["minor_faults_per_sample"] = {
        k: round(v / result["timed_samples"]) for k, v in sorted(faults.items())
    }
    t_a, t_b = clock.threads[warm], clock.threads[-1]
    result["main_process_thread_cpu_s_per_sample"] = {
        name: round((cpu - t_a.get(name, 0.0)) / result["timed_samples"], 4)
        for name, cpu in sorted(t_b.items())
        if cpu - t_a.get(name, 0.0) > 0
    }
    if clock.calls:  # where a swarm trainer's microbatch goes: its stage calls, and the rest (its own work)
        t0 = clock.times[warm]
        timed = [c for c in clock.calls if c[2] >= t0]
        per: dict[str, list[float]] = {}
        for stage, kind, a, b in timed:
            per.setdefault(f"stage{stage}_{kind}", []).append(1e3 * (b - a))
        n = result["timed_steps"]
        result["call_ms_per_microbatch"] = {k: round(sum(v) / n, 1) for k, v in sorted(per.items())}
        # the time no stage call was in flight (chunks run concurrently: a sum of their call times can exceed
        # the wall time, which made this negative before)
        in_flight, reach = 0.0, float("-inf")
        for a, b in sorted((a, b) for _, _, a, b in timed):
            if b > reach:
                in_flight += b - max(a, reach)
                reach = b
        result["trainer_rest_ms_per_microbatch"] = round(1e3 * (result["elapsed_s"] - in_flight) / n, 1)
    if variant.startswith("swarm"):
        stats = clock.stats
        result["swarm_stats"] = {k: v for k, v in stats.items() if isinstance(v, (int, float))}
    (Path(args.out) / "result.json").write_text(json.dumps(result))


def gpipe_worker(args: argparse.Namespace, cfg: dict) -> None:
    import torch
    import torch.distributed as dist
    from lightning.pytorch import seed_everything
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    torch.set_num_threads(args.threads)
    rank = args.rank
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}:{PORT}", rank=rank, world_size=2)
    seed_everything(0)
    full = build_model(cfg)
    half = cfg["layers"] // 2
    fp16 = args.variant == "gpipe_fp16"

    class Stage0(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.pos = full.embed, full.pos
            self.blocks = nn.Sequential(*list(full.blocks)[:half])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.blocks(self.embed(x) + self.pos.weight[: x.size(1)])
            return h.half() if fp16 else h

    class Stage1(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.Sequential(*list(full.blocks)[half:])
            self.norm, self.head = full.norm, full.head

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return self.head(self.norm(self.blocks(h.float())))

    module = Stage0() if rank == 0 else Stage1()
    mb, m, steps = cfg["microbatch"], cfg["microbatches"], cfg["global_steps"]
    act_dtype = torch.float16 if fp16 else torch.float32
    example = (
        torch.zeros(mb, cfg["seq"], dtype=torch.long)
        if rank == 0
        else torch.zeros(mb, cfg["seq"], cfg["hidden"], dtype=act_dtype)
    )
    stage = PipelineStage(module, rank, 2, torch.device("cpu"), input_args=(example,))
    schedule = ScheduleGPipe(stage, n_microbatches=m, loss_fn=_lm_loss)
    optimizer = torch.optim.AdamW(module.parameters(), lr=cfg["lr"])
    data = make_data(cfg, steps * mb * m).tensors
    clock, snapshots = _harness.StepClock(wire=link_bytes), []
    for step in range(steps):
        snapshots.append(cpu_snapshot(worker_sessions(Path(args.out))) if step == cfg["warmup_steps"] else {})
        clock.mark()
        lo, hi = step * mb * m, (step + 1) * mb * m
        if rank == 0:
            schedule.step(data[0][lo:hi])
        else:
            losses: list = []
            schedule.step(target=data[1][lo:hi], losses=losses)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    dist.barrier()
    clock.mark()
    snapshots.append(cpu_snapshot(worker_sessions(Path(args.out))))
    if rank == 0:
        result = summarize_clock(clock.times, clock.readings["wire"], cfg["warmup_steps"], mb * m)
        result["threads"] = torch.get_num_threads()
        mains = {pid: "rank1" for pid in worker_sessions(Path(args.out))} | {os.getpid(): "rank0"}
        split = cpu_split(snapshots[cfg["warmup_steps"]], snapshots[-1], mains)
        result["cpu_s_per_sample"] = {
            k: round(v / result["timed_samples"], 4) for k, v in sorted(split.items())
        }
        result["cpu_s_per_sample_total"] = round(sum(split.values()) / result["timed_samples"], 4)
        faults = cpu_split(snapshots[cfg["warmup_steps"]], snapshots[-1], mains, field=2)
        result["minor_faults_per_sample"] = {
            k: round(v / result["timed_samples"]) for k, v in sorted(faults.items())
        }
        (Path(args.out) / "result.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def _lm_loss(logits: Any, y: Any) -> Any:
    import torch.nn.functional as F

    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def calibrate_worker(args: argparse.Namespace, cfg: dict) -> None:
    """Per microbatch, on this (pinned) core and one thread: each stage's forward, forward+backward, and the
    8-bit encoding of one boundary tensor; per global step: each half's AdamW step."""
    import torch
    from lightning.pytorch import seed_everything

    from lightning_swarm.swarm.wire.codec import encode_tensor, nbytes

    torch.set_num_threads(1)
    seed_everything(0)
    model = build_model(cfg)
    half = cfg["layers"] // 2
    blocks = list(model.blocks)
    mb = cfg["microbatch"]
    x = torch.randint(0, cfg["vocab"], (mb, cfg["seq"]))
    y = torch.randint(0, cfg["vocab"], (mb, cfg["seq"]))
    reps = 3

    def timed(fn: Any) -> float:
        fn()  # warm-up
        out = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            out.append(1e3 * (time.perf_counter() - start))
        return min(out)  # the least disturbed repetition: the box is shared

    def run_blocks(bs: list, h: Any) -> Any:
        for b in bs:
            h = b(h)
        return h

    h0 = model.embed_tokens(x).detach()
    h1 = run_blocks(blocks[:half], h0).detach()

    def s0_fwd() -> None:
        with torch.no_grad():
            run_blocks(blocks[:half], h0)

    def s0_fwd_bwd() -> None:
        h = h0.clone().requires_grad_(True)
        run_blocks(blocks[:half], h).backward(torch.ones_like(h0))

    def s1_fwd() -> None:
        with torch.no_grad():
            run_blocks(blocks[half:], h1)

    def s1_fwd_bwd() -> None:
        h = h1.clone().requires_grad_(True)
        run_blocks(blocks[half:], h).backward(torch.ones_like(h1))

    def trainer_fwd_bwd() -> None:  # embeddings, head and loss: what the swarm trainer computes itself
        h = model.embed_tokens(x)
        hb = h.detach().requires_grad_(True)
        _lm_loss(model.logits(hb), y).backward()
        h.backward(hb.grad)

    result: dict[str, Any] = {
        "stage0_fwd_ms": timed(s0_fwd),
        "stage0_fwd_bwd_ms": timed(s0_fwd_bwd),
        "stage1_fwd_ms": timed(s1_fwd),
        "stage1_fwd_bwd_ms": timed(s1_fwd_bwd),
        "trainer_fwd_bwd_ms": timed(trainer_fwd_bwd),
        "encode_8bit_ms": timed(lambda: encode_tensor(h1, "8bit")),
        "boundary_bytes_fp32": h1.numel() * 4,
        "boundary_bytes_fp16": h1.numel() * 2,
        "boundary_bytes_8bit": nbytes([encode_tensor(h1, "8bit")]),
    }
    for k, params in (
        ("stage0", [p for b in blocks[:half] for p in b.parameters()]),
        ("stage1", [p for b in blocks[half:] for p in b.parameters()]),
    ):
        for p in params:
            p.grad = torch.zeros_like(p)
        opt = torch.optim.AdamW(params, lr=1e-4)
        result[f"{k}_adamw_step_ms"] = timed(opt.step)
        result[f"{k}_params"] = sum(p.numel() for p in params)
    result["total_params"] = sum(p.numel() for p in model.parameters())
    (Path(args.out) / "result.json").write_text(json.dumps(result))


def worker(args: argparse.Namespace) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    cfg = {**MODEL, **json.loads(args.cfg)}
    if args.variant == "calibrate":
        calibrate_worker(args, cfg)
    elif args.variant.startswith("gpipe"):
        gpipe_worker(args, cfg)
    else:
        lightning_worker(args, cfg)


# ----------------------------------------------------------------------------------- harness
def error_lines(out: Path, keep: Path) -> list[str]:
    """ERROR lines and tracebacks (whole) in the run's worker logs; a log that has any is copied to ``keep``."""
    lines = []
    for log in sorted(out.glob("*.log")):
        text = log.read_text(errors="replace").splitlines()
        found = False
        for i, line in enumerate(text):
            if "ERROR" in line:
                lines.append(f"{log.name}: {line.strip()[:300]}")
                found = True
            elif "Traceback" in line:
                block = [line]
                for nxt in text[i + 1 : i + 60]:
                    block.append(nxt)
                    if nxt and not nxt.startswith((" ", "\t")):
                        break  # the exception line ends the traceback
                lines.append(f"{log.name}: " + "\n".join(block)[-2000:])
                found = True
        if found:
            keep.mkdir(parents=True, exist_ok=True)
            (keep / f"{out.name}_{log.name}").write_text("\n".join(text))
    return lines


def run_variant(variant: str, link: float | None, cfg: dict, root: Path, index: int, name: str) -> dict:
    """One run of ``variant`` on a shaped link (``link`` Mbit/s) or on loopback (None), in ``root / name``; returns
    rank 0's result."""
    out = root / name
    out.mkdir(parents=True, exist_ok=True)
    if variant == "ddp":  # a reference, not a target: fewer steps (see the docstring)
        cfg = {**cfg, "global_steps": cfg.get("ddp_global_steps", cfg["global_steps"])}
    # "swarm_whole": the swarm with every backward run whole (no B/W split: lightning_swarm/swarm/server/weight_grads.py)
    whole = variant == "swarm_whole"
    if whole:
        variant = "swarm"
    this = [sys.executable, str(Path(__file__).resolve()), "--worker", "--variant", variant]
    this += ["--cfg", json.dumps(cfg), "--out", str(out)]
    base_env = {"PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    if whole:
        base_env["LIGHTNING_SWARM_SPLIT_BACKWARD"] = "0"
    procs = _harness.Launcher(out)
    started = time.monotonic()

    def start(name: str, cmd: list[str], env: dict[str, str], net: Any = None, rank: int = 0) -> None:
        # each worker leads its own session: the workers' CPU accounting reads their pids in pids.txt
        proc = procs.start(name, cmd, env, net=net, rank=rank, cwd=REPO, start_new_session=True)
        with open(out / "pids.txt", "a") as f:
            f.write(f"{proc.pid}\n")

    try:
        if link is None:
            if variant == "single":
                start("single", [*this, "--threads", "2"], {**base_env, "OMP_NUM_THREADS": "2"})
            elif variant == "single_1thread":
                start("single_1thread", [*this, "--threads", "1"], base_env)
            elif variant == "swarm_local":
                port = str(29400 + os.getpid() % 500)
                # each local peer's torch threads: the library's launcher chooses (its peers take turns here: all
                # the cores each), unless ``--model '{"local_threads": N}'`` sets N
                threads = cfg.get("local_threads")
                env = {k: v for k, v in base_env.items() if k != "OMP_NUM_THREADS"}
                if threads:
                    env["OMP_NUM_THREADS"] = str(threads)
                start("swarm_local", [*this, "--threads", str(threads or 0)], {**env, "MASTER_PORT": port})
            else:  # calibrate: one core, one thread
                start("calibrate", ["taskset", "-c", "0", *this, "--threads", "1"], base_env)
            procs.wait(1800)
            return json.loads((out / "result.json").read_text()) | {"wall_s": time.monotonic() - started}
        with _harness.link(2, link, net=index) as net:
            pin = [["taskset", "-c", "0"], ["taskset", "-c", "1"]]  # one core per "machine"
            if variant == "swarm":
                from lightning_swarm.swarm.dht.identity import PeerIdentity

                key = str(out / "peer_a.key")
                identity = PeerIdentity()
                identity.save(key)
                peer_a = f"/ip4/{net.address(0)}/tcp/{PORT}/p2p/{identity.peer_id.to_base58()}"
                for rank, peer in enumerate("AB"):
                    cmd = [
                        *pin[rank],
                        *this,
                        "--threads",
                        "1",
                        "--peer",
                        peer,
                        "--address",
                        net.address(rank),
                    ]
                    cmd += ["--identity", key, "--initial-peer", peer_a]
                    start(f"swarm_{peer}", cmd, base_env, net=net, rank=rank)
                    if rank == 0:
                        time.sleep(3)  # peer A bootstraps the DHT that B joins (B retries on its own too)
            else:
                for rank in range(2):
                    env = dict(base_env)
                    cmd = [
                        *pin[rank],
                        *this,
                        "--threads",
                        "1",
                        "--rank",
                        str(rank),
                        "--master",
                        net.address(0),
                    ]
                    if variant == "ddp":
                        env |= _harness.rank_env(rank, 2, net.address(0), PORT)
                    start(f"{variant}_{rank}", cmd, env, net=net, rank=rank)
            procs.wait(2400)
        return json.loads((out / "result.json").read_text()) | {"wall_s": time.monotonic() - started}
    finally:
        procs.stop()


def median_rounds(runs: dict, variants: list[str], links: list[float], rounds: int) -> dict[str, dict]:
    """With several rounds: each variant's run of median samples/s takes the variant's plain name (the figures are
    computed from it); returns, per link, every round's samples/s by variant and the swarm's ratio to GPipe round
    by round."""
    if rounds < 2:
        return {}
    out: dict[str, dict] = {}
    for link in links:
        key = f"{link:g}mbit"
        by_variant: dict[str, list] = {}
        for variant in variants:
            names = [f"{variant}_{key}" + ("" if k == 1 else f"_r{k}") for k in range(1, rounds + 1)]
            done = [(runs[n]["samples_per_s"], runs[n]) for n in names if n in runs]
            if not done:
                continue
            by_variant[variant] = [_r(sps) for sps, _ in done]
            ordered = sorted(done, key=lambda pair: pair[0])
            median = ordered[(len(ordered) - 1) // 2][1]
            moved = {n: runs.pop(n) for n in names if n in runs}
            runs[names[0]] = median
            rest = [r for r in moved.values() if r is not median]
            runs.update({f"{names[0]}_other{i + 1}": r for i, r in enumerate(rest)})
        swarm, gpipe = by_variant.get("swarm"), by_variant.get("gpipe")
        if swarm and gpipe:
            by_variant["speedup_vs_gpipe_by_round"] = [_r(a / b) for a, b in zip(swarm, gpipe, strict=False)]
        out[key] = by_variant
    return out


def _r(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(x, nd)


def summarize(runs: dict, cal: dict, cfg: dict, links: list[float]) -> dict:
    mb, m = cfg["microbatch"], cfg["microbatches"]
    # a swarm stage serves a microbatch with a forward that keeps its graph and a backward that reuses it (kept
    # activations, the default): the calibrated forward + backward, as a GPipe rank (a backward that reaches
    # another peer, or comes after a parameter update, recomputes the forward: one forward more)
    g0, g1 = cal["stage0_fwd_bwd_ms"], cal["stage1_fwd_bwd_ms"]
    per_link: dict[str, Any] = {}
    for link in links:
        key = f"{link:g}mbit"
        sw, gp, g16, dd = (runs.get(f"{v}_{key}") for v in ("swarm", "gpipe", "gpipe_fp16", "ddp"))
        whole = runs.get(f"swarm_whole_{key}")  # --split-ablation

        def sps(r: dict | None) -> float | None:
            return r["samples_per_s"] if r else None

        def wire_ms(r: dict | None, samples: int, link: float = link) -> float | None:
            if not r or r.get("bytes_per_sample") is None:
                return None
            return r["bytes_per_sample"] * samples * 8 / (link * 1e6) * 1e3

        entry: dict[str, Any] = {
            "samples_per_s_swarm": _r(sps(sw)),
            "samples_per_s_gpipe": _r(sps(gp)),
            "samples_per_s_gpipe_fp16": _r(sps(g16)),
            "samples_per_s_ddp": _r(sps(dd)),
            "speedup_vs_gpipe": _r(sps(sw) / sps(gp)) if sw and gp else None,
            "speedup_vs_gpipe_fp16": _r(sps(sw) / sps(g16)) if sw and g16 else None,
            "speedup_vs_ddp": _r(sps(sw) / sps(dd)) if sw and dd else None,
            "bytes_per_sample_swarm": _r(sw and sw["bytes_per_sample"], 0),
            "bytes_per_sample_gpipe": _r(gp and gp["bytes_per_sample"], 0),
            "bytes_per_sample_gpipe_fp16": _r(g16 and g16["bytes_per_sample"], 0),
            "bytes_per_sample_ddp": _r(dd and dd["bytes_per_sample"], 0),
            # wire time of what each really sent (both directions, measured on the veth) at the link rate
            "wire_ms_per_microbatch_8bit": _r(wire_ms(sw, mb), 1),
            "wire_ms_per_microbatch_fp32": _r(wire_ms(gp, mb), 1),
            "wire_ms_per_microbatch_fp16": _r(wire_ms(g16, mb), 1),
            "wire_ms_per_step_ddp": _r(wire_ms(dd, mb * m), 1),
            "step_ms_swarm": _r(sw and 1e3 * mb * m / sw["samples_per_s"], 1),
            "step_ms_gpipe": _r(gp and 1e3 * mb * m / gp["samples_per_s"], 1),
            "step_ms_gpipe_fp16": _r(g16 and 1e3 * mb * m / g16["samples_per_s"], 1),
            "step_ms_ddp": _r(dd and 1e3 * mb * m / dd["samples_per_s"], 1),
        }
        w8 = wire_ms(sw, mb) or 0.0
        a0, a1 = cal["stage0_adamw_step_ms"], cal["stage1_adamw_step_ms"]
        # the best any swarm of these two stages could do on these two cores: per global step each core serves M
        # microbatches of its stage (forward + backward, kept activations) and steps AdamW once, the two
        # cores perfectly overlapped with each other and with the wire (measured 8-bit bytes at the link rate);
        # no trainer, codec or framework time at all
        ideal = max(m * g0 + a0, m * g1 + a1, m * w8)
        entry["ideal_swarm_step_ms"] = _r(ideal, 1)
        if gp:
            gstep = 1e3 * mb * m / gp["samples_per_s"]
            entry["bound_speedup_vs_gpipe_ideal_swarm"] = _r(gstep / ideal)
            # the same against GPipe's own floor from the calibration: (M + 1) slots of the slower stage's
            # forward + backward (or of the fp32 wire), then the slower stage's AdamW step
            floor = (m + 1) * max(g0, g1, wire_ms(gp, mb) or 0.0) + max(a0, a1)
            entry["gpipe_floor_step_ms"] = _r(floor, 1)
            entry["bound_speedup_vs_gpipe_calibrated"] = _r(floor / ideal)
            # one trainer (what ran): its microbatches cross stage 0, the link and stage 1 one after the other
            entry["bound_speedup_vs_gpipe_one_trainer"] = _r(gstep / (m * (g0 + g1 + w8)))
        if dd:
            dstep = 1e3 * mb * m / dd["samples_per_s"]
            entry["bound_speedup_vs_ddp_ideal_swarm"] = _r(dstep / ideal)
        if sw:
            stats = sw.get("swarm_stats", {})
            total = cfg["global_steps"] * m * mb
            entry["swarm_payload_bytes_per_sample"] = _r(
                (stats.get("swarm/bytes_sent", 0) + stats.get("swarm/bytes_recv", 0)) / total, 0
            )
            entry["swarm_ms_per_microbatch"] = _r(1e3 / sw["samples_per_s"] * mb, 1)
            entry["swarm_call_ms_per_microbatch"] = sw.get("call_ms_per_microbatch")
            entry["swarm_trainer_rest_ms_per_microbatch"] = sw.get("trainer_rest_ms_per_microbatch")
        if whole:
            entry["samples_per_s_swarm_whole_backward"] = _r(sps(whole))
            entry["speedup_from_split_backward"] = _r(sps(sw) / sps(whole)) if sw else None
        entry["cpu_s_per_sample"] = {
            name: r.get("cpu_s_per_sample") for name, r in (("swarm", sw), ("gpipe", gp), ("ddp", dd)) if r
        }
        entry["minor_faults_per_sample"] = {
            name: r.get("minor_faults_per_sample")
            for name, r in (("swarm", sw), ("gpipe", gp), ("ddp", dd))
            if r
        }
        per_link[key] = entry
    single, single1, local = (runs.get(f"{v}_loopback") for v in ("single", "single_1thread", "swarm_local"))
    singles = [r for r in (single, single1) if r]
    best = max(singles, key=lambda r: r["samples_per_s"]) if singles else None
    eff = local["samples_per_s"] / best["samples_per_s"] if best and local else None
    compute = {
        "stage0": {
            "fwd": _r(cal["stage0_fwd_ms"], 1),
            "fwd_bwd": _r(g0, 1),
            "swarm_fwd_refwd_bwd": _r(cal["stage0_fwd_ms"] + g0, 1),  # when a backward recomputes
        },
        "stage1": {
            "fwd": _r(cal["stage1_fwd_ms"], 1),
            "fwd_bwd": _r(g1, 1),
            "swarm_fwd_refwd_bwd": _r(cal["stage1_fwd_ms"] + g1, 1),
        },
        "trainer_embed_head_loss_fwd_bwd": _r(cal["trainer_fwd_bwd_ms"], 1),
        "encode_8bit_one_boundary_tensor": _r(cal["encode_8bit_ms"], 2),
    }
    local_rows = cfg.get("local_microbatch") or mb * m  # rows per trainer step of swarm_local
    return {
        "per_link": per_link,
        # against the faster of the two single-process configurations (2 threads, or 1 thread) on the same box
        "efficiency_single_box": _r(eff),
        "efficiency_vs_single_2threads": _r(local["samples_per_s"] / single["samples_per_s"])
        if local and single
        else None,
        "efficiency_vs_single_1thread": _r(local["samples_per_s"] / single1["samples_per_s"])
        if local and single1
        else None,
        # CPU seconds per sample move much less with the box's load than wall times: on an idle box a 2-peer swarm
        # needs at least (its CPU per sample) / (2 cores) of wall time per sample, one 1-thread process its CPU
        # per sample, so 2 x single / swarm bounds the efficiency an idle box would show
        "cpu_s_per_sample_swarm_local": local and local.get("cpu_s_per_sample_total"),
        "cpu_s_per_sample_single_1thread": single1 and single1.get("cpu_s_per_sample_total"),
        "bound_efficiency_idle_box_from_cpu": _r(
            min(1.0, 2 * single1["cpu_s_per_sample_total"] / local["cpu_s_per_sample_total"])
        )
        if local and single1 and local.get("cpu_s_per_sample_total")
        else None,
        "samples_per_s_single": _r(single and single["samples_per_s"]),
        "samples_per_s_single_1thread": _r(single1 and single1["samples_per_s"]),
        "samples_per_s_swarm_local": _r(local and local["samples_per_s"]),
        "swarm_local_rows_per_trainer_step": local_rows,
        "swarm_local_ms_per_trainer_step": _r(local and 1e3 / local["samples_per_s"] * local_rows, 1),
        "swarm_local_call_ms_per_trainer_step": local and local.get("call_ms_per_microbatch"),
        "swarm_local_trainer_rest_ms_per_trainer_step": local and local.get("trainer_rest_ms_per_microbatch"),
        "cpu_s_per_sample_single_box": {
            name: r.get("cpu_s_per_sample") for name, r in (("swarm_local", local), ("single", single)) if r
        },
        "compute_ms_per_microbatch": compute,
        "adamw_step_ms": {
            "stage0": _r(cal["stage0_adamw_step_ms"], 1),
            "stage1": _r(cal["stage1_adamw_step_ms"], 1),
        },
        "boundary_tensor_bytes": {
            "fp32": cal["boundary_bytes_fp32"],
            "fp16": cal["boundary_bytes_fp16"],
            "8bit": cal["boundary_bytes_8bit"],
        },
    }


def plot(summary: dict, path: Path) -> str | None:
    try:
        import matplotlib
    except ImportError:
        return "matplotlib is not installed: no chart"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(summary["per_link"].items())
    fig, axes = plt.subplots(1, len(groups) + 1, figsize=(4.2 * (len(groups) + 1), 4))
    names = [("swarm", "SWARM 8-bit"), ("gpipe", "GPipe fp32"), ("gpipe_fp16", "GPipe fp16"), ("ddp", "DDP")]
    for ax, (link, entry) in zip(axes, groups, strict=False):
        vals = [entry.get(f"samples_per_s_{k}") or 0 for k, _ in names]
        bars = ax.bar([label for _, label in names], vals, color=["C0", "C1", "C2", "C3"])
        ax.bar_label(bars, fmt="%.2f")
        ax.set_title(f"{link} link, 2 x 1 core")
        ax.set_ylabel("samples/s")
        ax.tick_params(axis="x", labelsize=8)
    ax = axes[-1]
    vals = [summary.get(f"samples_per_s_{k}") or 0 for k in ("swarm_local", "single", "single_1thread")]
    bars = ax.bar(
        ["SWARM 2 peers", "1 process\n2 threads", "1 process\n1 thread"], vals, color=["C0", "C4", "C5"]
    )
    ax.bar_label(bars, fmt="%.2f")
    ax.set_title(f"one box (2 cores): efficiency {summary.get('efficiency_single_box')}")
    fig.suptitle(summary.get("model_label", ""), fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    return None


def main() -> None:
    parser = _harness.parser(
        "swarm_vs_alternatives", __doc__, quick="shorter sequences, fewer steps (a few minutes)", raw=True
    )
    parser.add_argument("--links", default="100,1000", help="link rates in Mbit/s, comma-separated")
    parser.add_argument("--only", default="", help="comma-separated variants to run (debugging)")
    parser.add_argument(
        "--split-ablation",
        action="store_true",
        help="also run the swarm with whole backwards (variant swarm_whole: LIGHTNING_SWARM_SPLIT_BACKWARD=0) after "
        "the swarm on each link, and report speedup_from_split_backward",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the swarm and GPipe variants this many times on each link, interleaved; the figures come from "
        "each variant's median run, and per_link.<link>.rounds lists every round",
    )
    parser.add_argument("--model", default="{}", help="JSON overrides of the model/run config (debugging)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", default="", help=argparse.SUPPRESS)
    parser.add_argument("--cfg", default="{}", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--master", default="127.0.0.1", help=argparse.SUPPRESS)
    parser.add_argument("--peer", default="A", help=argparse.SUPPRESS)
    parser.add_argument("--address", default="127.0.0.1", help=argparse.SUPPRESS)
    parser.add_argument("--identity", default="", help=argparse.SUPPRESS)
    parser.add_argument("--initial-peer", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if os.geteuid() != 0:
        raise SystemExit("swarm_vs_alternatives.py needs root (network namespaces and tc); run it as root.")
    # SIGTERM unwinds like an exception: the `finally` blocks stop the workers and delete the namespaces
    _harness.exit_on_sigterm()
    report = _harness.Report("swarm_vs_alternatives", args.out)
    cfg = {**MODEL, **(QUICK if args.quick else FULL), **json.loads(args.model)}
    links = [float(x) for x in args.links.split(",") if x]
    if args.rounds < 1:
        raise SystemExit(f"--rounds {args.rounds}: give 1 or more")
    only = {v for v in args.only.split(",") if v}
    load_start = os.getloadavg()
    out_dir = report.dir
    plan: list[tuple[str, float | None]] = [("calibrate", None), ("single", None), ("single_1thread", None)]
    plan += [("swarm_local", None)]
    plan = [(v, link, "") for v, link in plan]
    timed = ["swarm", *(["swarm_whole"] if args.split_ablation else []), "gpipe", "gpipe_fp16"]
    for link in links:  # --rounds: the timed variants again, interleaved (round k's runs are named ..._rk)
        for k in range(1, args.rounds + 1):
            plan += [(v, link, "" if k == 1 else f"_r{k}") for v in timed]
        plan += [("ddp", link, "")]
    runs: dict[str, dict] = {}
    errors: list[str] = []
    with tempfile.TemporaryDirectory(prefix="swarm_vs_alt_") as tmp:
        for index, (variant, link, suffix) in enumerate(plan):
            if only and variant not in only and variant != "calibrate":
                continue
            name = f"{variant}_{'loopback' if link is None else f'{link:g}mbit'}{suffix}"
            res = run_variant(variant, link, cfg, Path(tmp), index, name)
            runs[name] = res
            errors += error_lines(Path(tmp) / name, out_dir / "logs")
            sps = res.get("samples_per_s")
            extra = f"{sps:.3f} samples/s" if sps else ""
            if res.get("bytes_per_sample") is not None:
                extra += f", {res['bytes_per_sample']:,.0f} B/sample on the link"
            print(f"[{name}] {extra} (wall {res['wall_s']:.0f} s, load {os.getloadavg()[0]:.1f})", flush=True)
    cal = runs.pop("calibrate_loopback")
    rounds = median_rounds(runs, timed, links, args.rounds)
    summary = summarize(runs, cal, cfg, links)
    for key, by_variant in rounds.items():
        summary["per_link"][key]["rounds"] = by_variant
    params = cal["total_params"]
    summary["model"] = {**cfg, "params": params, "stage_params": [cal["stage0_params"], cal["stage1_params"]]}
    summary["model_label"] = (
        f"{cfg['layers']} blocks x hidden {cfg['hidden']}, {params / 1e6:.0f}M params, seq {cfg['seq']}, "
        f"global batch {cfg['microbatch'] * cfg['microbatches']} = {cfg['microbatches']} x {cfg['microbatch']}"
    )
    summary["setup"] = (
        "two namespaces joined by a tc-shaped veth; each side pinned to one core (taskset, helpers included), "
        "1 torch thread per process; swarm: peer A = trainer + stage 0, peer B = stage 1, 8-bit boundaries; "
        "GPipe: torch.distributed.pipelining ScheduleGPipe over gloo, same split and microbatches; DDP: "
        "Lightning 'ddp' over gloo, global batch / 2 per rank; single box: swarm = Trainer(devices=2, "
        "num_trainers=1) (1 thread per peer, unpinned) vs one Lightning process with 2 threads, unpinned"
    )
    summary["global_batch"] = cfg["microbatch"] * cfg["microbatches"]
    summary["samples_per_run"] = summary["global_batch"] * cfg["global_steps"]
    summary["timed_samples_per_run"] = summary["global_batch"] * (cfg["global_steps"] - cfg["warmup_steps"])
    ddp_steps = cfg.get("ddp_global_steps", cfg["global_steps"])
    summary["timed_samples_per_run_ddp"] = summary["global_batch"] * (ddp_steps - cfg["warmup_steps"])
    per_link = summary["per_link"]
    summary["targets"] = {  # the registry's targets
        **{
            f"speedup_vs_gpipe_{name}>=1": (per_link.get(name, {}).get("speedup_vs_gpipe") or 0) >= 1
            for name in per_link
        },
        "speedup_vs_ddp_100mbit>=3": (per_link.get("100mbit", {}).get("speedup_vs_ddp") or 0) >= 3,
        "efficiency_single_box>=0.85": (summary["efficiency_single_box"] or 0) >= 0.85,
    }
    summary["calibration"] = cal
    summary["runs"] = {
        k: {kk: vv for kk, vv in v.items() if kk != "step_ms"} | {"step_ms": v.get("step_ms")}
        for k, v in runs.items()
    }
    summary["error_lines_in_worker_logs"] = errors[:20]
    summary["load_average_1min"] = {"start": round(load_start[0], 2), "end": round(os.getloadavg()[0], 2)}
    summary["cpu_count"] = os.cpu_count()
    summary["quick"] = args.quick
    note = plot(summary, report.png)
    summary["chart"] = note or str(report.png)
    report.finish(summary)


if __name__ == "__main__":
    main()
