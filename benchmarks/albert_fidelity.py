"""Does a swarm train ALBERT as well as one process, and what do boundaries compressed beyond 8 bit cost? The same
model, data, seed, global batch and number of optimizer steps, trained (a) in one process with plain Lightning and
(b) in a local swarm whose stage boundaries are compressed, side by side; both evaluated with the same held-out
masked-LM loss.

The swarm: 2 server peers (one per stage, each in its own process; ``--peers-per-stage 2``: two per stage, as in
the main job, whose peers sum their gradients at every step) and 1 trainer peer, started by
``examples/albert/run_swarm.py``; the global batch is 4 microbatches of 32, the trainer accumulates them
(``accumulate_grad_batches=4``) and ``target_batch_size`` is 128, so every optimizer step of the stages and of the
trainer uses the samples of one single-process step (the single process accumulates the same 4 microbatches; the
JSON's ``stage_steps`` shows the stages' own step count). One microbatch per step is not used: hivemind's progress
tracker learns of a finished epoch from the DHT a moment later, so back-to-back one-microbatch epochs merge. What
differs from single-process training is what the swarm does to the tensors crossing stage boundaries (``--compression``:
8-bit blockwise quantization of activations and gradients by default; ``--boundary maxout|bottleneck``: a
compression-aware layer pair between the two groups, ``--boundary-factor`` times narrower, see
``lightning_swarm/swarm/boundary.py``) and the server-side recomputation of the forward pass (the same arithmetic).
The single process always trains the plain model (no boundary layers, nothing quantized): the gap is what the
compressed swarm costs against the model one would otherwise train. Held-out loss: ``Albert.evaluate`` on the data
module's validation windows (from the last 5% of the text, never trained on), computed in each trainer process on
the final, whole model (boundary layers included, unquantized).

    python benchmarks/albert_fidelity.py [--quick] [--boundary {none,maxout,bottleneck}] [--compression 8bit]
        [--peers-per-stage 2]
    python benchmarks/albert_fidelity.py --matrix [--link-mbit 100] [--quick]

``--matrix`` trains four swarms in turn (``none``: uncompressed; ``8bit``; ``maxout`` and ``bottleneck``: factor
``--boundary-factor`` on top of 8 bit) against one single-process run shared by all.

Figures (per configuration under ``configs``; in ``--matrix`` mode also as ``{configuration: value}`` dicts):

- ``relative_gap``: ``|held-out loss swarm - single| / single`` after the same ``steps`` (target <= 0.03);
- ``bytes_vs_fp32``: bytes the trainer sent and received in its stage calls (every boundary tensor crosses the
  network between the trainer and a stage: the trainer's counters see all of them) / what the *plain* model's
  boundary tensors weigh as fp32 for the same samples, in the same protocol: per training microbatch and stage,
  the forward's input and output and the backward's input (re-sent for the recomputation), output gradient and
  input gradient, each ``microbatch x seq_len x hidden_size`` (``fp32_boundary_bytes_plain``; for the plain model
  it equals the trainer's own count, ``fp32_boundary_bytes``, which for a boundary model counts its narrower
  tensors). Only the tensors between the two stages are narrowed by a boundary: the first stage's input and the
  last stage's output (the trainer's embeddings and head) stay ``hidden_size`` wide, so with 2 stages and 8 bit a
  boundary of factor f gives at best about ``(0.5 + 0.5 / f) / 4`` (0.156 for f = 4, never below 0.125);
- ``bytes_per_sample``: those bytes / the samples the trainer trained on;
- ``time_to_target_s``: the swarm's training time (the trainer's history ``time``: seconds since training started,
  after the swarm was joined) at which its training loss, averaged over the last 10 optimizer steps, first reaches
  the single process's final training loss, the mean of its last 10 steps of a ``target_step``-step run. Both train
  ``steps`` = 1.5 x ``target_step`` steps, so a slightly slower configuration can still reach the target; the
  learning rate is constant and the data order fixed by the seed, so the single process's first ``target_step``
  steps are the ``target_step``-step run. ``null``: never reached. ``time_to_target_s_single``: the single
  process's own time to it (about its time for ``target_step`` steps, on every core, without a network);
- ``target_met``: some configuration has ``bytes_vs_fp32`` <= 0.1 at ``relative_gap`` <= 0.03.

``--link-mbit R`` (root): the swarm half runs in a fresh network namespace whose only device is its loopback,
shaped to R Mbit/s with ``tc`` (token bucket, MTU 1500): every peer of the swarm and its daemons talk over that one
link, so the peers *share* R Mbit/s, which is stricter than one link of R Mbit/s per host. Nothing inside can reach
anything outside the namespace. A short transfer measures the shaped rate first (``link_measured_mbit``). The
namespace is deleted when the benchmark ends (also on Ctrl-C and SIGTERM). The single process needs no network and
runs outside it.

Last stdout line: one JSON object with the figures, also written to ``runs/<name>/<name>.json`` (name:
``albert_fidelity``, ``albert_fidelity_maxout`` with a boundary, ``albert_fidelity_matrix`` with ``--matrix``, each
with ``_<R>mbit`` for a shaped link; ``--out``: that folder, which also gets each swarm's ``summary.json``-style
result, histories and logs under ``<configuration>/``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import _harness

from examples.albert import run_swarm
from testbed import netns

TARGET_GAP = 0.03
TARGET_BYTES = 0.1
SMOOTH = 10  # optimizer steps averaged for the training loss of time_to_target_s
STEPS_FACTOR = 1.5  # steps trained / target_step
# --matrix: name -> (compression, boundary)
MATRIX = {
    "none": ("none", "none"),
    "8bit": ("8bit", "none"),
    "maxout": ("8bit", "maxout"),
    "bottleneck": ("8bit", "bottleneck"),
}
SCRIPT = Path(__file__).resolve()


class SharedLink(netns.VirtualCluster):
    """One network namespace with nothing but its loopback, shaped to ``rate_mbit`` (MTU 1500, the token bucket of
    ``testbed.netns``): processes started in it share one link. Deleted like a ``VirtualCluster`` (``close()``,
    at exit, on SIGINT/SIGTERM/SIGHUP)."""

    def __init__(self, rate_mbit: float) -> None:
        super().__init__(1, rate_mbit=rate_mbit, net=0)
        self.prefix = f"lsw-{os.getpid()}-fid"
        self.name = self.rank_ns(0)

    def open(self) -> None:
        netns._install_handlers()
        netns._LIVE.append(self)
        try:
            self._add_ns(self.name)
            netns._run("ip", "-n", self.name, "link", "set", "lo", "mtu", "1500")
            netns._run("ip", "-n", self.name, "link", "set", "lo", "up")
            self._shape(self.name, "lo")
        except BaseException:
            self.close()
            raise

    def prefix_cmd(self) -> list[str]:
        return ["ip", "netns", "exec", self.name]

    def measure_mbit(self, nbytes: int = 10_000_000) -> float:
        """The rate one TCP stream gets on the link: ``nbytes`` sent to a receiver in the namespace, timed to its
        one-byte acknowledgement."""
        code = (
            "import socket, threading, time\n"
            "srv = socket.socket(); srv.bind(('127.0.0.1', 0)); srv.listen(1)\n"
            f"n = {nbytes}\n"
            "def recv():\n"
            "    c, _ = srv.accept(); got = 0\n"
            "    while got < n:\n"
            "        b = c.recv(1 << 20)\n"
            "        if not b: break\n"
            "        got += len(b)\n"
            "    c.sendall(b'k')\n"
            "t = threading.Thread(target=recv); t.start()\n"
            "s = socket.create_connection(srv.getsockname()); t0 = time.perf_counter()\n"
            "s.sendall(bytes(n)); s.recv(1); dt = time.perf_counter() - t0\n"
            "print(n * 8 / dt / 1e6)\n"
        )
        cmd = [*self.prefix_cmd(), sys.executable, "-c", code]
        out = _harness.run(cmd, timeout=60, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        if out.returncode != 0:
            raise RuntimeError(f"the link measurement failed: {out.stderr.decode().strip()}")
        return float(out.stdout.decode().split()[-1])


def step_losses(history: dict) -> tuple[list[float], list[float]]:
    """(mean training loss, time at its end) of every optimizer step of a TrainingHistory, in order."""
    losses: dict[int, list[float]] = {}
    times: dict[int, float] = {}
    for step, loss, t in zip(history["step"], history["loss"], history["time"], strict=True):
        losses.setdefault(step, []).append(loss)
        times[step] = t
    steps = sorted(losses)
    return [sum(losses[s]) / len(losses[s]) for s in steps], [times[s] for s in steps]


def time_to_loss(history: dict, target: float, window: int = SMOOTH) -> float | None:
    """The first time the mean training loss of the last ``window`` optimizer steps is <= ``target``; None if
    never."""
    losses, times = step_losses(history)
    for i in range(window - 1, len(losses)):
        if sum(losses[i - window + 1 : i + 1]) / window <= target:
            return times[i]
    return None


def swarm_part(spec_path: str) -> None:
    """The child's job (``--swarm-part SPEC``, inside the shaped namespace when there is one): one swarm run, its
    result written where the spec says."""
    spec = json.loads(Path(spec_path).read_text())
    launcher_args, extra = run_swarm.parse_args(spec["argv"])
    result = run_swarm.run_swarm(launcher_args, extra)
    Path(spec["result"]).write_text(json.dumps(result))


def run_swarm_config(argv: list[str], out: Path, link: SharedLink | None, timeout: float) -> dict:
    """One swarm run (``run_swarm.run_swarm`` with ``argv``) in a child process, in ``link``'s namespace if any."""
    spec, result = out / "spec.json", out / "result.json"
    out.mkdir(parents=True, exist_ok=True)
    result.unlink(missing_ok=True)
    spec.write_text(json.dumps({"argv": argv, "result": str(result)}))
    cmd = [*(link.prefix_cmd() if link else []), sys.executable, str(SCRIPT), "--swarm-part", str(spec)]
    proc = _harness.popen(cmd, cwd=_harness.ROOT)
    try:
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:  # interrupted (or too slow): the child's finally stops its peers
            _harness.procs.signal_group(proc, signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                _harness.kill_group(proc)
    if proc.returncode != 0 or not result.is_file():
        raise RuntimeError(
            f"the swarm run in {out} failed (exit code {proc.returncode}; logs in {out / 'logs'})"
        )
    return json.loads(result.read_text())


def figures(
    compression: str,
    boundary: str,
    swarm: dict,
    single: dict,
    target_loss: float,
    fp32_per_sample: float,
    window: int,
) -> dict:
    h = swarm["histories"][0]
    loss_swarm, loss_single = h["eval_loss"], single["eval_loss"]
    gap = abs(loss_swarm - loss_single) / loss_single
    stats = h.get("swarm", {})
    wire = stats.get("swarm/bytes_sent", 0.0) + stats.get("swarm/bytes_recv", 0.0)
    samples = h["samples"][-1]
    plain = fp32_per_sample * samples
    ttt = time_to_loss(h, target_loss, window)
    return {
        "compression": compression,
        "boundary": boundary,
        "loss_swarm": round(loss_swarm, 4),
        "relative_gap": round(gap, 4),
        "bytes_vs_fp32": round(wire / plain, 4),
        "bytes_per_sample": round(wire / samples),
        "time_to_target_s": None if ttt is None else round(ttt, 1),
        "wire_bytes_swarm": wire,
        "wire_bytes_per_stage": [
            stats.get(f"swarm/stage{k}/bytes_sent", 0.0) + stats.get(f"swarm/stage{k}/bytes_recv", 0.0)
            for k in range(h.get("num_stages", 2))
        ],
        "fp32_boundary_bytes_plain": plain,
        "fp32_boundary_bytes": h.get("fp32_boundary_bytes"),
        "samples": samples,
        "steps_swarm": h["step"][-1],
        "stage_steps": h.get("stage_steps"),
        "final_train_loss_swarm": round(sum(step_losses(h)[0][-window:]) / window, 3),
        "train_seconds": round(h["time"][-1], 1),
        "swarm_wall_s": round(swarm["wall_s"], 1),
        "events": swarm.get("events", []),
    }


def main() -> None:
    p = _harness.parser(
        "albert_fidelity",
        __doc__.split("\n\n")[0],
        quick="fewer steps (30, target at step 20): 1-3 minutes per swarm, the matrix on a 100 Mbit/s link 7 minutes",
    )
    p.add_argument(
        "--steps", type=int, default=None, help="optimizer steps of every run (default 90, --quick 30)"
    )
    p.add_argument("--batch", type=int, default=32, help="microbatch size")
    p.add_argument("--accumulate", type=int, default=4, help="microbatches per optimizer step")
    p.add_argument("--compression", default="8bit", choices=["8bit", "fp16", "none"])
    p.add_argument("--boundary", default="none", choices=["none", "maxout", "bottleneck"])
    p.add_argument("--boundary-factor", type=int, default=4)
    p.add_argument(
        "--matrix",
        action="store_true",
        help="uncompressed, 8bit, maxout and bottleneck (on top of 8 bit) against one single process",
    )
    p.add_argument(
        "--link-mbit",
        type=float,
        default=None,
        help="run the swarms on one shared loopback of this rate (root)",
    )
    p.add_argument(
        "--peers-per-stage",
        type=int,
        default=1,
        help="server peers of each stage (2: the main job's layout, the stages' peers summing their gradients)",
    )
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds one swarm run may take")
    p.add_argument("--swarm-part", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.swarm_part:
        swarm_part(args.swarm_part)
        return
    _harness.exit_on_sigterm()
    name = "albert_fidelity" + ("_matrix" if args.matrix else "")
    if not args.matrix and args.boundary != "none":
        name += f"_{args.boundary}"
    if args.link_mbit is not None:
        name += f"_{args.link_mbit:g}mbit"
    if args.peers_per_stage != 1:
        name += f"_{args.peers_per_stage}peers"
    report = _harness.Report(name, args.out)
    steps = args.steps or (30 if args.quick else 90)
    target_step = max(1, round(steps / STEPS_FACTOR))
    window = min(SMOOTH, target_step)  # fewer only in a smoke run of a few steps
    configs = dict(MATRIX) if args.matrix else {args.boundary: (args.compression, args.boundary)}
    if not args.matrix and args.boundary == "none":
        configs = {args.compression: (args.compression, "none")}
    b = args.batch
    common = [
        f"--data.batch_size={b}",
        f"--trainer.accumulate_grad_batches={args.accumulate}",
        f"--trainer.strategy.init_args.target_batch_size={b * args.accumulate}",
        "--trainer.val_check_interval=1000000",  # no validation during training: the comparison is at the end
        "--trainer.limit_val_batches=0",
    ]

    def launcher_argv(out: Path, run_id: str) -> list[str]:
        return [
            "--stages",
            "2",
            "--peers-per-stage",
            str(args.peers_per_stage),
            "--trainers",
            "1",
            "--steps",
            str(steps),
            "--out",
            str(out),
            "--run-id",
            run_id,
            "--timeout",
            str(args.timeout),
        ]

    # the single process: the plain model (run_baseline keeps no strategy argument), the same steps
    base_args, _ = run_swarm.parse_args(launcher_argv(report.path("single"), "single"))
    started = time.monotonic()
    single = run_swarm.run_baseline(base_args, common, steps)
    single_s = time.monotonic() - started
    losses_single, _ = step_losses(single)
    target_loss = sum(losses_single[target_step - window : target_step]) / window
    hidden = int(run_swarm.config_value(base_args.config, common, "model.hidden_size"))
    seq_len = int(run_swarm.config_value(base_args.config, common, "data.seq_len"))
    # per sample, per stage: forward input + output, backward input + output gradient + input gradient
    fp32_per_sample = 4.0 * 5 * seq_len * hidden * base_args.stages

    results: dict[str, dict] = {}
    link = SharedLink(args.link_mbit) if args.link_mbit is not None else None
    measured = None
    try:
        if link is not None:
            link.open()
            measured = round(link.measure_mbit(), 1)
            print(f"[albert_fidelity] shared loopback {link.name}: measured {measured} Mbit/s", flush=True)
        for cname, (compression, boundary) in configs.items():
            print(f"\n[albert_fidelity] swarm: {cname} ({compression}, boundary {boundary})", flush=True)
            swarm_only = [f"--trainer.strategy.init_args.compression={compression}"]
            if link is not None:  # every call crosses the shaped link, none the same-host socket
                swarm_only.append("--trainer.strategy.init_args.same_host=false")
            if boundary != "none":
                swarm_only += [
                    f"--model.boundary={boundary}",
                    f"--model.boundary_factor={args.boundary_factor}",
                ]
            out = report.path(cname)
            argv = launcher_argv(out, f"fid_{cname}_{os.getpid()}") + ["--", *common, *swarm_only]
            swarm = run_swarm_config(argv, out, link, args.timeout + 120)
            results[cname] = figures(
                compression, boundary, swarm, single, target_loss, fp32_per_sample, window
            )
            print(f"[albert_fidelity] {cname}: {json.dumps(results[cname])}", flush=True)
    finally:
        if link is not None:
            link.close()

    meets = {
        c: r["bytes_vs_fp32"] <= TARGET_BYTES and r["relative_gap"] <= TARGET_GAP for c, r in results.items()
    }
    boundaries = [c for c in results if results[c]["boundary"] != "none"]
    best = min(
        boundaries, key=lambda c: (results[c]["relative_gap"], results[c]["bytes_vs_fp32"]), default=None
    )
    ttt_single = time_to_loss(single, target_loss, window)
    result: dict = {
        "steps": steps,
        "target_step": target_step,
        "smooth_steps": window,
        "global_batch": b * args.accumulate,
        "microbatch": b,
        "peers_per_stage": args.peers_per_stage,
        "boundary_factor": args.boundary_factor,
        "link_mbit": args.link_mbit,
        "link": "one shared loopback (all peers)" if link is not None else "loopback, unshaped",
        "link_measured_mbit": measured,
        "relative_gap": {c: r["relative_gap"] for c, r in results.items()},
        "bytes_vs_fp32": {c: r["bytes_vs_fp32"] for c, r in results.items()},
        "bytes_per_sample": {c: r["bytes_per_sample"] for c, r in results.items()},
        "time_to_target_s": {c: r["time_to_target_s"] for c, r in results.items()},
        "time_to_target_s_single": None if ttt_single is None else round(ttt_single, 1),
        "best_boundary": best,
        "target": f"bytes_vs_fp32 <= {TARGET_BYTES} at relative_gap <= {TARGET_GAP}",
        "target_met": any(meets.values()),
        "gap_target_met": {c: r["relative_gap"] <= TARGET_GAP for c, r in results.items()},
        "loss_single": round(single["eval_loss"], 4),
        "target_train_loss": round(target_loss, 3),
        "initial_train_loss": round(losses_single[0], 3),
        "final_train_loss_single": round(sum(losses_single[-window:]) / window, 3),
        "fp32_bytes_per_sample_plain": fp32_per_sample,
        "single_train_seconds": round(single["time"][-1], 1),
        "single_seconds": round(single_s, 1),
        "configs": results,
    }
    if len(results) == 1:  # one configuration: its figures at the top level too (the earlier report's keys)
        (only,) = results.values()
        result.update({k: v for k, v in only.items() if k not in ("events",)})
        result["meets_target"] = only["relative_gap"] <= TARGET_GAP
        result["loss_single"] = round(single["eval_loss"], 4)
    report.finish(result)


if __name__ == "__main__":
    main()
