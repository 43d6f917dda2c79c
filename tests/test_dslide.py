"""DSlideStrategy and the sharded layers, on real gloo process groups over 127.0.0.1.

- engine: 2 and 3 ranks train the same network as one process (same seeds, same active sets) and end with
  the same parameters, losses and eval top-k; the bytes of every step equal the analytic count;
- the lock-step loader stops all ranks at the shortest data and refuses different batches;
- Trainer: ``strategy="dslide"`` on 2 ranks (Lightning's launcher) matches a plain single-process run, writes a
  checkpoint that the plain LightningModule loads, and 3 ranks (started as 3 nodes) resume from it like a plain run
  does. These four runs come from one worker process that imports once and forks them (``--suite``); every rank and
  process trains with one torch thread.
"""

from __future__ import annotations

import csv
import json
import math
import os
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.fabric.strategies import _StrategyRegistry

from lightning_swarm.layers import LazyAdam, SparseInputLinear, SparseLSHLinear, active_set_loss
from lightning_swarm.layers.distributed import ShardGroup
from lightning_swarm.layers.shard_plan import LockStepLoader, shard_lightning_module
from lightning_swarm.layers.sharded import ShardedSparseInputLinear, ShardedSparseLSHLinear
from lightning_swarm.strategy.dslide import DSlideStrategy
from tests import _zygote

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "_dslide_worker.py"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (here, not from tests._helpers: that imports hivemind,
    which every rank started afresh would then import too)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


NET = {"F": 400, "H": 24, "Y": 300, "B": 16, "ymax": 3, "k": 40, "steps": 5, "tables": 6}


# --------------------------------------------------------------------------- helpers


def _batches(net: dict[str, int]) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(net["steps"] + 1):
        nnz = torch.randint(1, 8, (net["B"],), generator=g)
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), nnz.cumsum(0)[:-1]])
        indices = torch.randint(0, net["F"], (int(nnz.sum()),), generator=g)
        values = torch.rand(int(nnz.sum()), generator=g)
        labels = torch.randint(0, net["Y"], (net["B"], net["ymax"]), generator=g)
        labels[torch.rand(net["B"], net["ymax"], generator=g) < 0.3] = -1
        out.append((indices, offsets, values, labels))
    return out


def _train(active_set: str, shard: bool) -> dict[str, Any]:
    """A few LazyAdam steps of sparse input -> ReLU -> Linear (replicated) -> SparseLSHLinear.

    With ``shard`` the wide layers are sharded by the strategy's plan and the replicated layer is kept in sync
    by summing its gradients over ranks, as ``DSlideStrategy`` does.
    """
    torch.manual_seed(0)
    root = torch.nn.Module()
    root.inp = SparseInputLinear(NET["F"], NET["H"])
    root.mid = torch.nn.Linear(NET["H"], NET["H"])
    root.out = SparseLSHLinear(
        NET["H"], NET["Y"], num_active=NET["k"], num_bits=4, num_tables=NET["tables"], bucket_cap=None, rebuild_every=2,
        active_set=active_set,
    )  # fmt: skip
    group = ShardGroup()
    plan = shard_lightning_module(root, group) if shard else None
    if plan is not None:
        plan.sync_replicated()
        assert isinstance(root.inp, ShardedSparseInputLinear) and isinstance(root.out, ShardedSparseLSHLinear)
    opt = LazyAdam(root.parameters(), lr=1e-2)
    losses, step_bytes = [], []
    batches = _batches(NET)
    for indices, offsets, values, labels in batches[:-1]:
        group.stats.reset()
        hidden = F.relu(root.mid(F.relu(root.inp(indices, offsets, values))))
        ids, logits = root.out(hidden, labels)
        loss = active_set_loss(ids, logits, labels)
        opt.zero_grad()
        loss.backward()
        if plan is not None:
            plan.all_reduce_replicated_grads()
        opt.step()
        losses.append(float(loss.detach()))  # every rank computes the loss of the whole network
        step_bytes.append(group.stats.snapshot())
    indices, offsets, values, _ = batches[-1]
    root.out.eval()
    with torch.no_grad():
        hidden = F.relu(root.mid(F.relu(root.inp(indices, offsets, values))))
        scores, top = root.out.topk(hidden, 5)
        _, lsh_top = root.out.topk(hidden, 5, mode="lsh")  # LSH queries: hashed by batch slices on 3 ranks
    return {
        "input_weight": root.inp.weight.detach(),
        "input_bias": root.inp.bias.detach(),
        "mid_weight": root.mid.weight.detach(),
        "output_weight": root.out.weight.detach(),
        "output_bias": root.out.bias.detach(),
        "losses": losses,
        "bytes": step_bytes,
        "scores": scores,
        "top": top,
        "lsh_top": lsh_top,
    }


def _lockstep_checks(rank: int) -> dict[str, Any]:
    group = ShardGroup()
    uneven = [torch.tensor([i]) for i in range(5 if rank == 0 else 3)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        seen = [int(b) for b in LockStepLoader(uneven, group)]
    different = [torch.tensor([rank])]
    try:
        list(LockStepLoader(different, group))
        error = ""
    except RuntimeError as exc:
        error = str(exc)
    return {
        "seen": seen,
        "warned": any("different numbers of batches" in str(w.message) for w in caught),
        "error": error,
    }


def _rank_main(rank: int, world: int, port: int, active_set: str, out_dir: str) -> None:
    torch.set_num_threads(1)  # ranks share the 2 cores: more threads only spin when the box is busy
    if world >= 3:  # this tiny batch hashes in microseconds: make the ranks split it, as a big batch would
        ShardedSparseLSHLinear.split_hashing_min_macs = 0
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        result = _train(active_set, shard=True)
        result["lockstep"] = _lockstep_checks(rank)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _start_ranks(kind: str, world: int, *args: str, timeout: float) -> None:
    """``world`` ranks of :data:`_RANK_MAINS` ``[kind]``, each ``python -m tests.test_dslide KIND RANK WORLD PORT
    ARGS...`` (this module's ``__main__``), forked by the worker's zygote (``tests/_zygote.py``) instead of importing
    torch and Lightning afresh (about 4 s of CPU a rank); each must exit with 0 within ``timeout``."""
    port = free_port()
    procs = [
        _zygote.Popen(
            [sys.executable, "-m", "tests.test_dslide", kind, str(r), str(world), str(port), *args], cwd=REPO
        )
        for r in range(world)
    ]
    try:
        for p in procs:
            try:
                p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        assert [p.returncode for p in procs] == [0] * world, "a rank failed (see its stderr above)"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _run_ranks(world: int, active_set: str, out_dir: Path) -> list[dict[str, Any]]:
    _start_ranks("engine", world, active_set, str(out_dir), timeout=400)
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(world)]


# --------------------------------------------------------------------------- engine
@pytest.mark.timeout(450)
@pytest.mark.parametrize(("world", "active_set"), [(2, "shared"), (3, "per_sample"), (8, "shared")])
def test_sharded_layers_match_single_process(world: int, active_set: str, tmp_path: Path) -> None:
    reference = _train(active_set, shard=False)
    ranks = _run_ranks(world, active_set, tmp_path)

    full = {
        "input_weight": torch.cat([r["input_weight"] for r in ranks]),  # sharded by input feature
        "output_weight": torch.cat([r["output_weight"] for r in ranks]),  # sharded by output neuron
        "output_bias": torch.cat([r["output_bias"] for r in ranks]),
    }
    for r in ranks:  # the replicated layer stays identical on every rank and equal to the reference
        torch.testing.assert_close(r["mid_weight"], reference["mid_weight"], rtol=1e-5, atol=1e-6)
        # the input layer's bias is whole on every rank and gets the all-reduced gradient: equal everywhere
        assert torch.equal(r["input_bias"], ranks[0]["input_bias"])
        torch.testing.assert_close(r["input_bias"], reference["input_bias"], rtol=1e-4, atol=1e-5)
    for name, tensor in full.items():
        assert tensor.shape == reference[name].shape
        # Float rounding only: the shards sum the softmax's exponentials in another order (per shard, then
        # rescaled to the global max) and the hidden pre-activations in another order (per feature shard), and Adam's first steps magnify a 1e-7 gradient difference on a row whose
        # gradient is near zero. A wrong gradient moves weights by ~lr (1e-2 here).
        torch.testing.assert_close(tensor, reference[name], rtol=1e-4, atol=1e-5, msg=name)
    for r in ranks:
        assert r["losses"] == pytest.approx(reference["losses"], rel=1e-5)
        assert torch.equal(r["top"], reference["top"])
        assert torch.equal(r["lsh_top"], reference["lsh_top"])
        torch.testing.assert_close(r["scores"], reference["scores"], rtol=1e-5, atol=1e-6)

    # Bytes per step: batch x hidden floats for the hidden all-gather and the hidden-gradient all-reduce,
    # batch x (2 + Ymax) floats per rank for the softmax (max, sum, the labels' logits), rows x k float64
    # priorities per rank for the active set.
    b, h, k, ymax = NET["B"], NET["H"], NET["k"], NET["ymax"]
    rows = 1 if active_set == "shared" else b
    expected = {
        "hidden_all_reduce": b * h * 4,  # the ranks' partial sums over their input features
        "hidden_grad_all_reduce": b * h * 4,
        "softmax_all_gather": world * b * (2 + ymax) * 4,
        "active_set_all_gather": world * rows * k * 8,
        "replicated_grad_all_reduce": (h * h + h) * 4,  # the replicated Linear(H, H): data parallel
    }
    if world >= 3:  # split hashing: each rank hashes its slice of the batch (parts padded to the widest) and
        # sends int32 codes, L per row; with 2 ranks every rank hashes the whole (small) batch and sends none
        expected["hash_codes_all_gather"] = world * math.ceil(b / world) * NET["tables"] * 4
    weight_bytes = min(NET["F"] * h, NET["Y"] * h) * 4
    for r in ranks:
        for step in r["bytes"]:
            assert step == expected
            assert max(step.values()) < weight_bytes  # no weight-sized transfer (even in this tiny network)

    for rank, r in enumerate(ranks):
        assert r["lockstep"]["seen"] == [0, 1, 2], "every rank stops at the shortest data"
        assert r["lockstep"]["warned"] == (rank == 0)
        assert "different batches" in r["lockstep"]["error"]


# --------------------------------------------------------------------------- memory at scale (scaled down)
MEM = {"F": 3000, "H": 48, "Y": 4000, "B": 16, "k": 64}


def _largest_allocation(fn: Any) -> tuple[int, Any]:
    """Run ``fn`` under torch's profiler; the largest memory any one op allocated (its own, not its children's)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    return max((e.cpu_memory_usage for e in prof.events()), default=0), out


def _memory_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    """Born-sharded network of the example's shape, small: the largest allocation of creating it, of a training
    step, of a full table rebuild and of a streamed checkpoint save, on this rank."""
    from lightning_swarm.layers.checkpoint import save_streamed
    from lightning_swarm.layers.init import sharded_init
    from lightning_swarm.layers.shard_plan import streamed_optimizer_state

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        group = ShardGroup()
        root = torch.nn.Module()

        def create() -> None:
            with sharded_init(group):
                root.inp = SparseInputLinear(MEM["F"], MEM["H"])
                root.out = SparseLSHLinear(MEM["H"], MEM["Y"], num_active=MEM["k"], num_bits=6, num_tables=4)

        sizes = {"create": _largest_allocation(create)[0]}
        initial = {"inp": root.inp.weight.detach().clone(), "out": root.out.weight.detach().clone()}
        plan = shard_lightning_module(root, group)
        opt = LazyAdam(root.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(0)
        indices = torch.randint(0, MEM["F"], (MEM["B"] * 5,), generator=g)
        offsets = torch.arange(0, MEM["B"] * 5, 5)
        values = torch.rand(MEM["B"] * 5, generator=g)
        labels = torch.randint(0, MEM["Y"], (MEM["B"], 2), generator=g)

        def step() -> None:
            ids, logits = root.out(F.relu(root.inp(indices, offsets, values)), labels)
            opt.zero_grad()
            active_set_loss(ids, logits, labels).backward()
            plan.all_reduce_replicated_grads()
            opt.step()

        step()  # the first step builds the tables and LazyAdam's moments (shard-sized)
        sizes["step"] = _largest_allocation(step)[0]

        def rebuild() -> None:
            root.out.invalidate_tables()
            root.out.maybe_rebuild()

        sizes["rebuild"] = _largest_allocation(rebuild)[0]
        checkpoint = {
            "state_dict": plan.streamed_state_dict(),
            "optimizer_states": [streamed_optimizer_state(opt, plan)],
        }
        path = os.path.join(out_dir, "model.ckpt")
        sizes["save"] = _largest_allocation(lambda: save_streamed(checkpoint, path, group, chunk_bytes=4096))[
            0
        ]
        torch.save({"sizes": sizes, "out_shard": root.out.weight.detach(), "inp_shard": root.inp.weight.detach(),
                    "exp_avg": opt.state[root.out.weight]["exp_avg"], "initial": initial}, os.path.join(out_dir, f"rank{rank}.pt"))  # fmt: skip
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(500)
def test_no_rank_allocates_a_weight_sized_tensor(tmp_path: Path) -> None:
    """Two ranks create the example's network born sharded, train a step, rebuild all tables and save a streamed
    checkpoint; no single allocation on either rank reaches 60% of a wide layer's weight (a shard is 50%), and the
    checkpoint holds the whole layers, loadable with plain torch.load."""
    world = (
        2  # (each rank holds half of a layer: a whole-layer allocation is twice the largest legitimate one)
    )
    _start_ranks("memory", world, str(tmp_path), timeout=450)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    bound = (
        0.6 * MEM["Y"] * MEM["H"] * 4
    )  # 60% of the output weight; the input weight is larger than that too
    assert MEM["F"] * MEM["H"] * 4 > bound
    for r in ranks:
        for phase, size in r["sizes"].items():
            assert size < bound, (phase, size, bound)
    assert all(size > 0 for size in ranks[0]["sizes"].values()), "the profiler saw rank 0's allocations"
    full = torch.load(tmp_path / "model.ckpt", weights_only=True)
    torch.testing.assert_close(full["state_dict"]["out.weight"], torch.cat([r["out_shard"] for r in ranks]))
    torch.testing.assert_close(full["state_dict"]["inp.weight"], torch.cat([r["inp_shard"] for r in ranks]))
    moments = full["optimizer_states"][0]["state"]
    assert any(torch.equal(v["exp_avg"], torch.cat([r["exp_avg"] for r in ranks])) for v in moments.values())
    # The shards are the whole layer's rows: a single process with the same seed creates the same values.
    torch.manual_seed(0)
    whole_inp = SparseInputLinear(MEM["F"], MEM["H"])
    whole_out = SparseLSHLinear(MEM["H"], MEM["Y"], num_active=MEM["k"], num_bits=6, num_tables=4)
    assert torch.equal(torch.cat([r["initial"]["out"] for r in ranks]), whole_out.weight.detach())
    assert torch.equal(torch.cat([r["initial"]["inp"] for r in ranks]), whole_inp.weight.detach())


# --------------------------------------------------------------------------- strategy units
def test_register_strategies_and_defaults() -> None:
    registry = _StrategyRegistry()
    DSlideStrategy.register_strategies(registry)
    assert "dslide" in registry
    strategy = registry.get("dslide")
    assert isinstance(strategy, DSlideStrategy)
    assert strategy.is_distributed
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 1, "rank": 0}
    with pytest.raises(ValueError, match=r"spin_wait=-1.*seconds >= 0"):
        DSlideStrategy(spin_wait=-1)


def test_a_rank_sharing_its_core_with_a_busy_process_stops_spinning_in_its_waits() -> None:
    """``ShardGroup.cpu_contended`` reads the thread's time waiting for a CPU: with a busy process pinned to the
    same core the thread waits about half of the time, so waits block instead of spinning (a spinning rank would
    take the CPU from the ranks it waits for)."""
    core = sorted(os.sched_getaffinity(0))[0]
    before = os.sched_getaffinity(0)
    busy = subprocess.Popen(
        [sys.executable, "-c", f"import os; os.sched_setaffinity(0, [{core}])\nwhile True: pass"]
    )
    try:
        os.sched_setaffinity(0, [core])  # this (the calling) thread only
        group = ShardGroup(spin_s=0.2)
        verdicts = []
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline and not (verdicts and verdicts[-1]):
            verdicts.append(group.cpu_contended())  # renewed every CONTENTION_WINDOW_S of busy work
        assert verdicts[-1], "a thread sharing its core with a busy process was not seen as contended"
    finally:
        os.sched_setaffinity(0, before)
        busy.kill()
        busy.wait()


def test_module_without_sparse_output_layer_is_refused() -> None:
    root = torch.nn.Sequential(SparseInputLinear(10, 4), torch.nn.Linear(4, 3))
    with pytest.raises(ValueError, match="DSlideStrategy shards `SparseLSHLinear`.*strategy='ddp'"):
        shard_lightning_module(root, ShardGroup())


# --------------------------------------------------------------------------- Trainer
def _suite(out: Path) -> dict[str, dict]:
    """The worker's ``--suite`` (one import, every run forked from it; see tests/_dslide_worker.py): ``plain`` and
    ``dslide2`` (Lightning's launcher, 2 ranks) for 6 steps, then ``dslide3`` (3 ranks) and ``plain_resumed``
    resumed from ``dslide2``'s checkpoint to step 10. Their results, by run."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(WORKER), "--suite", "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            start_new_session=True)  # fmt: skip
    try:
        _, stderr = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:  # timed out: end the forked runs and their launched ranks with it
            os.killpg(proc.pid, 9)
            proc.wait()
    assert proc.returncode == 0, stderr[-6000:]
    return {name: json.loads((out / name / "result.json").read_text())
            for name in ("plain", "dslide2", "dslide2_gloo", "dslide3", "plain_resumed")}  # fmt: skip


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, dict, dict]:
    root = tmp_path_factory.mktemp("dslide")
    runs = _suite(root)
    return root, runs["plain"], runs["dslide2"], runs


@pytest.mark.timeout(900)
def test_trainer_two_ranks_match_plain_run(two_rank_run: tuple[Path, dict, dict, dict]) -> None:
    root, plain, sharded, _ = two_rank_run
    assert sharded["world_size"] == 2 and sharded["global_step"] == plain["global_step"] == 6
    # the output layer's weight and bias were updated while the hidden gradient's all-reduce was in flight, at
    # every step (overlap_updates), and the run still equals the plain one
    assert sharded["early_updates"] == 2 * sharded["global_step"]
    assert sharded["losses"] == pytest.approx(plain["losses"], rel=1e-5)
    assert sharded["ids"] == plain["ids"]
    plain_state = torch.load(root / "plain" / "model.ckpt", weights_only=False)["state_dict"]
    sharded_ckpt = torch.load(root / "dslide2" / "model.ckpt", weights_only=False)
    for name, tensor in plain_state.items():
        torch.testing.assert_close(sharded_ckpt["state_dict"][name], tensor, rtol=1e-5, atol=1e-5, msg=name)

    # Two ranks on one machine: each runs on its own share of the cores when there is one core each, and then
    # (one torch thread per rank) waits for collectives spinning; with fewer cores nothing is pinned or burnt.
    cores = sorted(os.sched_getaffinity(0))
    placed = [json.loads((root / "dslide2" / f"rank{r}.placement.json").read_text()) for r in range(2)]
    if len(cores) >= 2:
        per = len(cores) // 2
        assert [p["cores"] for p in placed] == [cores[:per], cores[per : 2 * per]]
        assert [p["spin_s"] for p in placed] == [0.2, 0.2]
    else:
        assert [p["cores"] for p in placed] == [cores, cores] and [p["spin_s"] for p in placed] == [0.0, 0.0]

    # The model logs the loss of the whole network on every rank (no extra collective needed).
    assert sharded["logged_loss"] == pytest.approx(plain["logged_loss"], rel=1e-5)

    # Bytes of a step (counted from one step's start to the next): the lock-step check of one batch, the
    # model's collectives: batch x hidden floats twice, 2 ranks x batch x (2 + Ymax) floats for the softmax
    # (max, sum and the labels' logits), and 2 ranks x k float64 active-set priorities.
    b, h, k = 16, 16, 48
    for step_bytes, ymax in zip(sharded["bytes"][1:], sharded["label_widths"], strict=False):
        assert step_bytes == {
            "lockstep_all_reduce": 4 * 8,
            "hidden_all_reduce": b * h * 4,
            "hidden_grad_all_reduce": b * h * 4,
            "softmax_all_gather": 2 * b * (2 + ymax) * 4,
            "active_set_all_gather": 2 * k * 8,
        }  # no codes: each rank hashes the whole (small) batch, cheaper than an all-gather
        assert sum(step_bytes.values()) < 300 * h * 4 / 4  # far below the smallest weight (300 x 16 floats)


@pytest.mark.timeout(900)
def test_trainer_collectives_through_gloo_give_the_parameters_of_the_socket_mesh(
    two_rank_run: tuple[Path, dict, dict, dict],
) -> None:
    """The same 2-rank Trainer run with ``DSlideStrategy(collectives="gloo")`` and the default ``"socket"``: the
    same losses, predictions and parameters, bit for bit (a sum of two parts is the same in any order; the gathers
    only move bytes)."""
    root, _, sharded, runs = two_rank_run
    through_gloo = runs["dslide2_gloo"]
    assert through_gloo["world_size"] == 2 and through_gloo["global_step"] == sharded["global_step"] == 6
    assert through_gloo["losses"] == sharded["losses"]
    assert through_gloo["ids"] == sharded["ids"] and through_gloo["scores"] == sharded["scores"]
    assert through_gloo["bytes"] == sharded["bytes"]  # the same collectives, counted alike
    mesh_state = torch.load(root / "dslide2" / "model.ckpt", weights_only=False)
    gloo_state = torch.load(root / "dslide2_gloo" / "model.ckpt", weights_only=False)
    assert mesh_state["state_dict"].keys() == gloo_state["state_dict"].keys()
    for name, tensor in mesh_state["state_dict"].items():
        assert torch.equal(gloo_state["state_dict"][name], tensor), name
    moments = zip(mesh_state["optimizer_states"][0]["state"].values(),
                  gloo_state["optimizer_states"][0]["state"].values(), strict=True)  # fmt: skip
    for mesh_moments, gloo_moments in moments:
        for key, value in mesh_moments.items():
            assert torch.equal(torch.as_tensor(gloo_moments[key]), torch.as_tensor(value)), key


@pytest.mark.timeout(700)
def test_two_rank_runs_exit_cleanly_every_time_and_a_failure_ends_both_ranks(tmp_path: Path) -> None:
    """Ten two-rank Trainer runs (fit, checkpoint gather, sharded top-k after fit) each exit 0 through the normal
    interpreter exit with the process group destroyed; then a run whose rank 1 raises mid-training ends both
    ranks with an error (no abort, no hang); then a run whose rank 1 receives SIGTERM mid-training stops both
    ranks at the same step, as Lightning's SIGTERM handling does (before, both ranks hung). The ranks are forked
    after the imports so a run costs ~2 s."""
    proc = subprocess.run(
        [sys.executable, str(WORKER), "--repeat", "10", "--fail-rank", "1", "--sigterm-rank", "1"]
        + ["--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=680,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    runs = json.loads((tmp_path / "repeat.json").read_text())
    assert runs[:10] == [[0, 0]] * 10, runs
    assert runs[10] == [1, 1], "both ranks end with an error (negative: a signal such as SIGABRT; None: hung)"
    assert runs[11] == [0, 0], "SIGTERM: both ranks leave through Lightning's SIGTERMException (None: hung)"
    stopped = [json.loads((tmp_path / "run11" / f"rank{r}.stopped.json").read_text()) for r in range(2)]
    assert stopped[0] == stopped[1] and 2 <= stopped[0]["global_step"] < 8, stopped
    for run in range(12):
        for rank in range(2):
            log = (tmp_path / f"run{run}" / f"rank{rank}.log").read_text()
            assert "terminate called" not in log
            exit_state = json.loads((tmp_path / f"run{run}" / f"rank{rank}.exit.json").read_text())
            assert exit_state == {"process_group_alive": False}, f"run {run} rank {rank}"
            if run != 10:
                assert "Traceback" not in log and "ERROR" not in log, log[-3000:]
    # the strategy logs the bytes each rank sent per step (log_bytes, on by default) at the steps the logger writes
    with open(tmp_path / "run0" / "logs" / "version_0" / "metrics.csv") as f:
        rows = [row for row in csv.DictReader(f) if row.get("dslide/bytes_per_step")]
    assert [int(row["step"]) for row in rows] == [0, 1], rows
    assert all(float(row["dslide/bytes_per_step"]) > 0 for row in rows), rows
    failed = [(tmp_path / "run10" / f"rank{rank}.log").read_text() for rank in range(2)]
    assert "ValueError: deliberate failure on rank 1" in failed[1]
    # Rank 0 fails fast in its next collective, whose connection to rank 1 is closed (the mesh's error; with
    # collectives="gloo" it was gloo's transport error), not after the timeout.
    assert "MeshError: rank 0: the connection to rank 1 was closed" in failed[0], failed[0][-3000:]
    assert "timed out" not in failed[0].lower() and "read timeout" not in failed[0].lower(), failed[0][-3000:]
    seconds = json.loads((tmp_path / "seconds.json").read_text())
    assert seconds[10] < 60, f"the failing run took {seconds[10]} s: a rank waited for a timeout"
    assert seconds[11] < 60, f"the SIGTERM run took {seconds[11]} s"


@pytest.mark.timeout(900)
def test_checkpoint_loads_unsharded_and_resumes_on_three_ranks(
    two_rank_run: tuple[Path, dict, dict, dict],
) -> None:
    sys.path.insert(0, str(REPO))
    from examples.amazon670k.model import XCModel
    from tests._dslide_worker import predictions

    root, _, sharded, runs = two_rank_run
    ckpt = root / "dslide2" / "model.ckpt"
    model = XCModel.load_from_checkpoint(ckpt)
    assert isinstance(model.output_layer, SparseLSHLinear) and model.output_layer.out_features == 400
    scores, ids = predictions(model)
    assert ids.tolist() == sharded["ids"]
    torch.testing.assert_close(scores, torch.tensor(sharded["scores"]), rtol=1e-5, atol=1e-6)

    # The fixture resumed both from this checkpoint: 3 ranks (3 nodes) and one plain process, to step 10.
    resumed, plain_resumed = runs["dslide3"], runs["plain_resumed"]
    assert resumed["world_size"] == 3 and resumed["global_step"] == 10
    assert len(resumed["losses"]) == 4
    assert resumed["losses"] == pytest.approx(plain_resumed["losses"], rel=1e-5)
    assert resumed["ids"] == plain_resumed["ids"]
    # their model also gives the output bias a gradient of its own (zero, built before the forward, so it arrives
    # after the hidden gradient's all-reduce): only the weight was updated early, and the runs still agree
    assert resumed["early_updates"] == 4


# --------------------------------------------------------------------------- shaped links (testbed/netns.py)
_ALL_REDUCE = """
import os, sys, torch, torch.distributed as dist
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:29561", rank=rank, world_size=2)
x = torch.full((250_000,), float(rank + 1))
dist.all_reduce(x)
print(float(x[0]), flush=True)
dist.destroy_process_group()
"""


def _ip(*args: str) -> str:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=True).stdout


@pytest.mark.timeout(120)
def test_virtual_cluster_carries_gloo_between_namespaces_and_cleans_up() -> None:
    from testbed import netns

    if os.geteuid() != 0:
        pytest.skip("creating network namespaces needs root (`ip netns`, `tc`)")
    probe = f"lsw-{os.getpid()}-probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot create network namespaces here: {made.stderr.strip()}")
    subprocess.run(["ip", "netns", "del", probe], check=True)
    routes_before = _ip("route")
    with netns.VirtualCluster(2, rate_mbit=200, net=250) as net:
        names = [net.rank_ns(0), net.rank_ns(1), net.bridge_ns]
        listed = _ip("netns", "list")
        assert all(name in listed for name in names)
        assert _ip("route") == routes_before, "the root namespace must not get routes to the private network"
        env = {"MASTER_ADDR": net.address(0)}
        cmd = [sys.executable, "-c", _ALL_REDUCE]
        procs = [net.popen(r, [*cmd, str(r)], env=env, stdout=subprocess.PIPE) for r in range(2)]
        outputs = [p.communicate(timeout=90)[0].decode().split() for p in procs]
        assert [p.returncode for p in procs] == [0, 0]
        assert outputs == [["3.0"], ["3.0"]]
        assert net.tx_bytes(0) >= 250_000 * 4  # the all-reduce really crossed rank 0's veth
    assert not any(name in _ip("netns", "list") for name in names)
    assert netns.leftover_namespaces() == []


def test_dslide_does_not_import_the_swarm_side():
    """``import lightning_swarm`` and a D-SLIDE Trainer leave hivemind and bitsandbytes unimported (~25 MB of RSS
    per rank); ``Trainer(strategy="swarm")`` still works after the same import."""
    code = (
        "import sys, lightning_swarm\n"
        "from lightning.pytorch import Trainer\n"
        "Trainer(strategy='dslide', accelerator='cpu', devices=1, logger=False)\n"
        "assert 'hivemind' not in sys.modules and 'bitsandbytes' not in sys.modules, 'swarm side imported'\n"
        "t = Trainer(strategy='swarm', accelerator='cpu', devices=1, logger=False)\n"
        "assert isinstance(t.strategy, lightning_swarm.SwarmStrategy)\n"
        "print('ok')\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-2000:]


_RANK_MAINS = {"engine": _rank_main, "memory": _memory_rank}

if __name__ == "__main__":  # a rank of _start_ranks: python -m tests.test_dslide KIND RANK WORLD PORT ARGS...
    _RANK_MAINS[sys.argv[1]](int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), *sys.argv[5:])
