"""D-SLIDE vs the alternatives on an Amazon-670K-shaped network, over loopback and simulated 1 Gbit/s Ethernet.

    python benchmarks/dslide_vs_ddp.py [--quick]      (as root: creates network namespaces)

The network: 135,909 sparse features -> 128 ReLU -> 670,091 labels (~103M parameters), LazyAdam, global batch 256
for every variant (a D-SLIDE rank works on the whole batch, a DDP rank on ``batch / ranks``):

- ``single``: one process of the sparse model (``SparseLSHLinear``, LSH active set) with as many threads as the
  ranks it is compared with use together (2 threads vs 2 ranks of 1 thread);
- ``dslide``: ``strategy="dslide"``, the same sparse model sharded (input layer by features, output layer
  by neurons), one thread per rank;
- ``ddp_sparse``: Lightning's ``"ddp"`` (torch DDP, gloo) of the same sparse model, with the wide layers' weights
  held by ``nn.EmbeddingBag``/``nn.Embedding(sparse=True)`` so that torch DDP exchanges their gradients sparsely
  (all-gather of the touched rows, which is how torch DDP reduces sparse gradients); the output bias keeps a
  dense gradient (torch DDP reduces a parameter either sparse or dense);
- ``ddp``: the paper's baseline, Lightning's ``"ddp"`` of the dense model (``nn.Linear`` output, full softmax,
  dense gradients of both layers all-reduced every step).

Ranks run in their own network namespaces, joined through a bridge by veth pairs shaped with ``tc`` to
``--rate-mbit`` (``testbed/netns.py``), or on loopback (127.0.0.1, same namespace). Processes are started
like separate machines (``num_nodes=ranks``, ``NODE_RANK``/``MASTER_ADDR``). Step time: mean interval between
consecutive batches after the warm-up steps (the first steps include the first hash-table build; the timed steps
contain no rebuild, for the sparse variants alike). Bytes per step: ``bytes_per_step_*`` is the logical payload
(the strategy's own count for D-SLIDE; for DDP the size of every gradient it reduces: dense ones whole, sparse
ones as the rows every rank contributes, gathered), ``tx_bytes_per_step_per_rank_*`` what each rank really sent
on its veth. ``peak_rss_mb_per_rank``: the largest peak RSS (``VmHWM``) over the ranks (1 rank: the single process);
``rss_after_imports_mb`` the same right after the imports (torch, Lightning, the project: a floor every rank pays),
``model_rss_ratio_4_ranks`` the 4-rank / single ratio of what the run adds above that floor. ``step_ms``: the
single process and the 2-rank D-SLIDE runs are repeated ``--rounds`` times, interleaved, and the run of median step
time is kept (``step_ms_rounds`` lists them all); ``cpu_ms_per_step_per_rank`` is the process CPU time per step.
Each rank of a multi-rank variant (a simulated machine) runs on its own share of the box's cores where there are
at least as many cores as ranks; ``DSLIDE_SPIN_WAIT=<seconds>`` in the environment sets D-SLIDE's ``spin_wait``
(default: automatic), for side-by-side runs of its waits.

Headline: ``comm_reduction`` (1 - D-SLIDE / DDP-dense bytes sent on the veths, 1 Gbit/s, at 4 ranks; 2 with
``--quick``) and ``parallel_efficiency``: ``single`` step time / 2-rank D-SLIDE step time on the shaped link, taken
per interleaved round (``parallel_efficiency_rounds``, one ratio per round of back-to-back runs) and reported as
their median; ``parallel_efficiency_best`` is each variant's fastest round over the other's (the ``_loopback`` keys
the same on 127.0.0.1). ``load_average_before`` is the box's load before the run started its own processes. ``--quick`` (~2 min on
an idle 2-core box) runs fewer DDP-dense steps and only: single, D-SLIDE at 2 ranks (loopback and 1 Gbit/s) and 4
ranks, DDP-sparse and DDP-dense at 2 ranks (1 Gbit/s); the sparse variants time 35 steps in both modes. The last stdout line is one JSON object (with the load average),
also written to ``runs/dslide_vs_ddp/dslide_vs_ddp.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

import _harness

REPO = _harness.ROOT
HIDDEN = 128


# ----------------------------------------------------------------------------------- worker (one rank)
def _tx_bytes() -> int | None:
    return _harness.counters.link_bytes(("tx",), in_namespace_only=False)


def _peak_rss_mb() -> float:
    """This process's peak resident memory (``VmHWM``). Not ``ru_maxrss``: Linux carries that across ``exec``
    from the process that forked, so a rank would report at least the harness's own memory."""
    return _harness.memory.vm_hwm_mb()


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F
    from lightning.pytorch import Trainer, seed_everything
    from torch import nn

    import lightning_swarm  # noqa: F401
    from examples.amazon670k.data import XCDataModule
    from examples.amazon670k.model import XCModel
    from lightning_swarm.strategy.dslide import DSlideStrategy

    if args.cores:  # this rank's share of the box, as a machine of its own would have
        os.sched_setaffinity(0, [int(c) for c in args.cores.split(",")])
    torch.set_num_threads(args.threads)
    rss_after_imports = _peak_rss_mb()

    class DDPSparseXCModel(XCModel):
        """The sparse model with its wide weights held by sparse embedding modules, so torch DDP reduces them as
        sparse gradients; the output bias gets a dense gradient. Records the gradient bytes DDP reduces."""

        def configure_model(self) -> None:
            super().configure_model()
            inp, out = self.input_layer, self.output_layer
            bag = nn.EmbeddingBag(
                inp.in_features, inp.out_features, mode="sum", sparse=True, _weight=inp.weight.data
            )
            rows = nn.Embedding(out.total_out, out.in_features, sparse=True, _weight=out.weight.data)
            for layer, owner in ((inp, bag), (out, rows)):
                del layer._parameters["weight"]
                object.__setattr__(
                    layer, "weight", owner.weight
                )  # the layers compute with the module's weight
            self.sparse_weights = nn.ModuleList([bag, rows])

            def active_logits(layer: Any, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
                from lightning_swarm.layers.sparse_linear import gather_rows

                w = gather_rows(layer.weight, ids[0])  # sparse gradient (an nn.Embedding's weight for DDP)
                return torch.addmm(layer.bias.index_select(0, ids[0]), x, w.t())  # dense bias gradient

            out.active_logits = types.MethodType(active_logits, out)
            self.grad_bytes: dict[str, int] = {}
            for name, param in self.named_parameters():
                param.register_hook(lambda g, name=name: self._count(name, g))

        def _count(self, name: str, grad: torch.Tensor) -> torch.Tensor:
            if grad.is_sparse:  # every rank contributes its touched rows (indices + values), gathered
                rows = grad.coalesce().indices().size(1)
                row_bytes = grad.size(1) * grad.element_size() + 8
                self.grad_bytes[name] = rows * row_bytes * args.ranks
            else:
                self.grad_bytes[name] = grad.numel() * grad.element_size()
            return grad

    class DenseXCModel(XCModel):
        """The paper's baseline: dense output layer, and a dense gradient for the input layer too (Horovod/DDP
        all-reduce every parameter's whole gradient)."""

        def configure_model(self) -> None:
            super().configure_model()

            def forward(
                layer: Any, indices: torch.Tensor, offsets: torch.Tensor, values: torch.Tensor
            ) -> torch.Tensor:
                out = F.embedding_bag(indices, layer.weight, offsets, mode="sum", per_sample_weights=values)
                return out + layer.bias

            self.input_layer.forward = types.MethodType(forward, self.input_layer)

    seed_everything(0)
    if args.strategy == "ddp":
        model: XCModel = DenseXCModel(output="dense", hidden=HIDDEN, num_active=4096, lr=1e-4)
    elif args.strategy == "ddp_sparse":
        model: XCModel = DDPSparseXCModel(hidden=HIDDEN, num_active=4096, lr=1e-4)
    else:
        model = XCModel(
            output="dense" if args.strategy == "ddp" else "sparse", hidden=HIDDEN, num_active=4096, lr=1e-4
        )
    data = XCDataModule(data_dir=args.data_dir, batch_size=args.batch)
    clock = _harness.lightning_clock(tx=_tx_bytes)
    strategy: Any = {
        "single": "auto",
        "dslide": DSlideStrategy(
            spin_wait=float(os.environ["DSLIDE_SPIN_WAIT"]) if os.environ.get("DSLIDE_SPIN_WAIT") else None
        ),
        "ddp": "ddp",
        "ddp_sparse": "ddp",
    }[args.strategy]
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        num_nodes=args.ranks if args.strategy != "single" else 1,
        strategy=strategy,
        max_steps=args.steps,
        **_harness.QUIET_TRAINER,
        limit_val_batches=0,
        callbacks=[clock],
    )
    trainer.fit(model, data)
    warm = args.warmup
    steps = len(clock.times) - 1 - warm
    step_s = (clock.times[-1] - clock.times[warm]) / steps
    tx = clock.readings["tx"]
    tx_per_step = (tx[-1] - tx[warm]) / steps if tx[-1] is not None and tx[warm] is not None else None
    output_grad_bytes = None
    if args.strategy == "dslide":
        payload = sum(trainer.strategy.last_step_bytes.values())
    elif args.strategy == "ddp_sparse":
        payload = sum(model.grad_bytes.values())
        output_grad_bytes = sum(
            v for k, v in model.grad_bytes.items() if k.startswith(("output_layer", "sparse_weights.1"))
        )
    elif args.strategy == "ddp":  # DDP all-reduces the (dense) gradient of every parameter
        payload = sum(p.numel() * p.element_size() for p in model.parameters())
    else:
        payload = 0
    result = {
        "rank": trainer.global_rank,
        "step_ms": 1000 * step_s,
        "cpu_ms_per_step": 1000 * (clock.cpu[-1] - clock.cpu[warm]) / steps,
        "timed_steps": steps,
        "payload_bytes_per_step": payload,
        "output_grad_bytes": output_grad_bytes,
        "tx_bytes_per_step": tx_per_step,
        "threads": torch.get_num_threads(),
        "peak_rss_mb": _peak_rss_mb(),
        "rss_after_imports_mb": rss_after_imports,
    }
    (Path(args.rank_dir) / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


# ----------------------------------------------------------------------------------- harness
def _free_port() -> int:
    """A TCP port nobody listens on here (a fresh network namespace has none in use): back-to-back runs must not
    meet the previous run's rendezvous port in TIME_WAIT."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def make_data(directory: Path, num_samples: int) -> None:
    """Amazon-670K-shaped synthetic points, written once in the repository format for every rank to read."""
    from examples.amazon670k.data import make_synthetic, write_xc_file

    write_xc_file(directory / "train.txt", make_synthetic(num_samples, sample_seed=0))
    write_xc_file(directory / "test.txt", make_synthetic(16, sample_seed=1))


def run_one(
    net: Any,
    strategy: str,
    ranks: int,
    threads: int,
    steps: int,
    warmup: int,
    batch: int,
    data_dir: Path,
    out: Path,
) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--strategy", strategy]
    cmd += ["--ranks", str(ranks), "--threads", str(threads), "--steps", str(steps), "--warmup", str(warmup)]
    # Same global batch for all: D-SLIDE ranks all work on the whole batch, DDP ranks on 1/ranks of it each.
    per_rank_batch = batch // ranks if strategy.startswith("ddp") else batch
    cmd += ["--batch", str(per_rank_batch), "--data-dir", str(data_dir), "--rank-dir", str(out)]
    port = str(_free_port())
    cores = sorted(os.sched_getaffinity(0))
    per = len(cores) // ranks if strategy != "single" else 0
    with _harness.Launcher(out, what=f"{strategy} with {ranks} ranks: ") as launcher:
        for rank in range(ranks):
            # ranks simulate separate machines: each gets its share of the cores, where there are enough
            own = ["--cores", ",".join(str(c) for c in cores[rank * per : (rank + 1) * per])] if per else []
            env = {
                **_harness.rank_env(rank, ranks, net.address(0), port),
                "OMP_NUM_THREADS": str(threads),
                "PYTHONWARNINGS": "ignore",
            }
            if strategy == "single":
                env = {"OMP_NUM_THREADS": str(threads), "PYTHONWARNINGS": "ignore"}
            launcher.start(f"rank{rank}", cmd + own, env, net=net, rank=rank, cwd=REPO)
        launcher.wait(900)
    per_rank = [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]
    tx = [r["tx_bytes_per_step"] for r in per_rank]
    return {
        "step_ms": max(r["step_ms"] for r in per_rank),
        "cpu_ms_per_step_per_rank": sum(r["cpu_ms_per_step"] for r in per_rank) / len(per_rank),
        "timed_steps": per_rank[0]["timed_steps"],
        "payload_bytes_per_step": max(r["payload_bytes_per_step"] for r in per_rank),
        "output_grad_bytes": per_rank[0]["output_grad_bytes"],
        "tx_bytes_per_step_per_rank": (sum(tx) / len(tx)) if all(t is not None for t in tx) else None,
        "peak_rss_mb": max(r["peak_rss_mb"] for r in per_rank),
        "rss_after_imports_mb": max(r["rss_after_imports_mb"] for r in per_rank),
    }


def main() -> None:
    parser = _harness.parser(
        "dslide_vs_ddp", __doc__, quick="fewer runs and steps (under 5 minutes)", raw=True
    )
    parser.add_argument("--rate-mbit", type=float, default=1000.0, help="link rate of the shaped runs")
    parser.add_argument("--batch", type=int, default=256, help="global batch size")
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="interleaved rounds of the parallel-efficiency runs (median kept)",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--strategy", default="dslide", help=argparse.SUPPRESS)
    parser.add_argument("--ranks", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=10, help=argparse.SUPPRESS)
    parser.add_argument("--warmup", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--rank-dir", default="", help=argparse.SUPPRESS)
    parser.add_argument("--data-dir", default="", help=argparse.SUPPRESS)
    parser.add_argument("--cores", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    # SIGTERM unwinds like an exception, so the `finally` blocks kill the rank processes started so far.
    _harness.exit_on_sigterm()
    report = _harness.Report("dslide_vs_ddp", args.out)

    rate = args.rate_mbit
    cores = os.cpu_count() or 1
    load_before = os.getloadavg()  # the box is shared: how busy it was before this run's own processes
    print(f"load average before the run (1, 5, 15 min): {load_before}", flush=True)
    # (name, strategy, ranks, link): every rank gets one thread; the single process gets the 2 ranks' 2 threads.
    plan = (
        [
            ("single", "single", 1, "loopback"),
            ("dslide_2_loopback", "dslide", 2, "loopback"),
            ("dslide_2_link", "dslide", 2, rate),
        ]
        * args.rounds
    )  # the parallel-efficiency runs, interleaved: a slow spell of the box hits all of them alike
    plan += [
        ("ddp_sparse_2_link", "ddp_sparse", 2, rate),
        ("ddp_2_link", "ddp", 2, rate),
        ("dslide_4_link", "dslide", 4, rate),
    ]
    if not args.quick:
        plan += [("ddp_sparse_4_link", "ddp_sparse", 4, rate), ("ddp_4_link", "ddp", 4, rate)]
    steps = {"ddp": (2, 1)} if args.quick else {"ddp": (6, 2)}
    # 35 timed steps either way (a rebuild of the hash tables comes at step 50): with 12 a 2-rank
    # round moved by 2 ms of ~31 from run to run, more than the changes it measures
    sparse_steps = (40, 5)
    tries: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="dslide_vs_ddp_") as tmp:
        data_dir = Path(tmp) / "data"
        data_dir.mkdir()
        make_data(data_dir, args.batch * (sparse_steps[0] + 1))
        for index, (name, strategy, ranks, link) in enumerate(plan):
            n, warm = steps.get(strategy, sparse_steps)
            threads = 2 if strategy == "single" else 1
            started = time.monotonic()
            cluster = _harness.link(ranks, None if link == "loopback" else link, net=index)
            with cluster as net:
                res = run_one(
                    net,
                    strategy,
                    ranks,
                    threads,
                    n,
                    warm,
                    args.batch,
                    data_dir,
                    Path(tmp) / f"{name}_{index}",
                )
            res.update(strategy=strategy, ranks=ranks, link_mbit=None if link == "loopback" else link)
            tries.setdefault(name, []).append(res)
            print(
                f"[{name}] {res['step_ms']:.0f} ms/step ({res['cpu_ms_per_step_per_rank']:.0f} ms CPU per rank), "
                f"{res['payload_bytes_per_step']:,} B/step payload, "
                f"{(res['tx_bytes_per_step_per_rank'] or 0):,.0f} B/step sent per rank, peak RSS "
                f"{res['peak_rss_mb']:.0f} MB ({time.monotonic() - started:.0f} s)",
                flush=True,
            )
    runs: dict[str, dict] = {}
    for name, results in tries.items():  # the run of median step time stands for its variant
        runs[name] = sorted(results, key=lambda r: r["step_ms"])[(len(results) - 1) // 2]
        runs[name]["step_ms_rounds"] = [round(r["step_ms"], 1) for r in results]

    def tx(name: str) -> float | None:
        return runs[name]["tx_bytes_per_step_per_rank"]

    n = (
        4 if "ddp_4_link" in runs else 2
    )  # the headline compares D-SLIDE and DDP at the most ranks run for both
    d, p = tx(f"dslide_{n}_link"), tx(f"ddp_{n}_link")
    single = runs["single"]

    def efficiency(dslide: str) -> dict[str, Any]:
        """Single-process step time over 2-rank D-SLIDE step time, per interleaved round (the two runs of a round
        ran back to back), their median, and each variant's fastest round over the other's."""
        singles = [r["step_ms"] for r in tries["single"]]
        sharded = [r["step_ms"] for r in tries[dslide]]
        rounds = [round(a / b, 3) for a, b in zip(singles, sharded, strict=True)]
        return {
            "median": sorted(rounds)[(len(rounds) - 1) // 2],
            "rounds": rounds,
            "best": round(min(singles) / min(sharded), 3),
        }

    eff_link, eff_loop = efficiency("dslide_2_link"), efficiency("dslide_2_loopback")
    summary = {
        "batch": args.batch,
        "link_mbit": rate,
        "comm_reduction": round(1 - d / p, 6) if d and p else None,
        "comm_reduction_ranks": n,
        "comm_reduction_payload": round(
            1
            - runs[f"dslide_{n}_link"]["payload_bytes_per_step"]
            / runs[f"ddp_{n}_link"]["payload_bytes_per_step"],
            6,
        ),
        "speedup_vs_ddp_dense": round(
            runs[f"ddp_{n}_link"]["step_ms"] / runs[f"dslide_{n}_link"]["step_ms"], 2
        ),
        "speedup_vs_ddp_sparse": round(
            runs["ddp_sparse_2_link"]["step_ms"] / runs["dslide_2_link"]["step_ms"], 2
        ),
        # 2 ranks on the shaped link (--rate-mbit), against the single process with both cores' threads
        "parallel_efficiency": eff_link["median"],
        "parallel_efficiency_rounds": eff_link["rounds"],
        "parallel_efficiency_best": eff_link["best"],
        "parallel_efficiency_loopback": eff_loop["median"],
        "parallel_efficiency_loopback_rounds": eff_loop["rounds"],
        "parallel_efficiency_loopback_best": eff_loop["best"],
        "step_ms_single_sparse": round(single["step_ms"], 1),
        "step_ms_rounds": {
            name: runs[name]["step_ms_rounds"] for name in ("single", "dslide_2_loopback", "dslide_2_link")
        },
        "cpu_ms_per_step_per_rank": {
            name: round(r["cpu_ms_per_step_per_rank"], 1) for name, r in runs.items()
        },
        "step_ms_dslide_2": round(runs["dslide_2_link"]["step_ms"], 1),
        "step_ms_dslide_2_loopback": round(runs["dslide_2_loopback"]["step_ms"], 1),
        "step_ms_dslide_4": round(runs["dslide_4_link"]["step_ms"], 1),
        "step_ms_ddp_sparse": round(runs["ddp_sparse_2_link"]["step_ms"], 1),
        "step_ms_ddp_dense": round(runs[f"ddp_{n}_link"]["step_ms"], 1),
        "bytes_per_step_dslide_2": runs["dslide_2_link"]["payload_bytes_per_step"],
        "bytes_per_step_dslide_4": runs["dslide_4_link"]["payload_bytes_per_step"],
        "bytes_per_step_ddp_sparse": runs["ddp_sparse_2_link"]["payload_bytes_per_step"],
        "bytes_output_grad_ddp_sparse": runs["ddp_sparse_2_link"]["output_grad_bytes"],
        "bytes_per_step_ddp_dense": runs[f"ddp_{n}_link"]["payload_bytes_per_step"],
        "tx_bytes_per_step_per_rank": {name: tx(name) for name in runs},
        "peak_rss_mb_per_rank": {
            "1": round(single["peak_rss_mb"]),
            "2": round(runs["dslide_2_link"]["peak_rss_mb"]),
            "4": round(runs["dslide_4_link"]["peak_rss_mb"]),
        },
        "peak_rss_ratio_4_ranks": round(runs["dslide_4_link"]["peak_rss_mb"] / single["peak_rss_mb"], 3),
        # What the model adds to a process (peak minus the process after `import torch, lightning, ...`):
        # the part of a rank's memory that model parallelism divides.
        "rss_after_imports_mb": round(single["rss_after_imports_mb"]),
        "model_rss_ratio_4_ranks": round(
            (runs["dslide_4_link"]["peak_rss_mb"] - runs["dslide_4_link"]["rss_after_imports_mb"])
            / (single["peak_rss_mb"] - single["rss_after_imports_mb"]),
            3,
        ),
        "threads": {"single": 2, "per_rank": 1},
        "cpu_cores": cores,
        "load_average_before": [round(v, 2) for v in load_before],
        "load_average_1min": round(os.getloadavg()[0], 2),
        "quick": args.quick,
        "runs": runs,
    }
    report.finish(summary)


if __name__ == "__main__":
    main()
