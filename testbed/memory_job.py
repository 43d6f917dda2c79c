"""One training job of an MLP pipeline, built in one of the three ways Lightning users build models, for
``benchmarks/swarm_memory.py --scale`` and ``tests/test_memory.py``.

``python testbed/memory_job.py '<json>'``; the settings (all optional but ``out_dir``):

- ``way``: ``"init"`` (the model built in ``__init__``), ``"init_module"`` (built under
  ``trainer.init_module(empty_init=True)``) or ``"configure_model"`` (built in ``configure_model``);
- ``devices``: 1 runs one plain Lightning process (no swarm); N > 1 a local swarm of N peers, one trainer, N
  stages of one peer each;
- ``width``, ``ffn``, ``blocks``: the pipeline (``blocks`` blocks LayerNorm -> Linear(width, ffn) -> GELU ->
  Linear(ffn, width)), between a trainer-local input layer and head;
- ``steps``, ``batch``, ``seed``, ``compression``, ``lr``;
- ``init_hook``: the model re-initialises its layers after the build, as Hugging Face models do
  (``self.apply(self._init_weights)``: normal(0, 0.02) weights, zero biases, truncated-normal LayerNorm gains);
- ``save_path``: the trainer saves a checkpoint there when training ends (``trainer.save_checkpoint`` in
  ``on_train_end``, while the swarm still runs: streamed stage by stage);
- ``compare_gather`` (with ``save_path``): save weights only, streamed, then the old way (every stage gathered,
  then saved), recording the rise of the trainer's RSS for each (``save_rss_rise_streamed_mb``,
  ``save_rss_rise_gathered_mb``);
- ``ckpt_path``: resume from that checkpoint (``trainer.fit(..., ckpt_path=...)``; ``steps`` counts from 0, so
  give more than the checkpoint's).

Every process writes ``out_dir/peer<rank>.json`` once set up (Lightning's ``on_fit_start``, after the strategy's
``setup``): its stage, the bytes of storage its model's tensors hold (every distinct storage of the module's
parameters and buffers, the pipeline's blocks included, ``meta`` tensors holding none), the bytes its stage and the
trainer-local modules need, what its stage server holds besides (copies of the parameters, optimizer state, the
resident part of hivemind's averaged gradients), when
resuming the bytes of the checkpoint file it has read (``ckpt_rss_bytes``: the resident pages of its memory-mapped
checkpoint, from ``/proc/self/smaps``), and, for the trainer, the output of the first forward. At the end it adds its peak resident memory (``VmHWM``) and how many of
its module's tensors are on ``meta`` once ``fit`` returned (``meta_tensors_after_fit``: 0 when the trainer gathered
the stages).
"""

from __future__ import annotations

import json
import os
import sys
import time


def _enter_cgroup() -> None:
    """``SWARM_MEMORY_CGROUP=<dir>:<bytes>`` (set by ``swarm_memory.py --scale --capped``): this process and the
    helpers it starts run in the memory cgroup (v1) ``<dir>/peer<rank>``, limited to ``<bytes>``."""
    spec = os.environ.get("SWARM_MEMORY_CGROUP")
    if not spec:
        return
    root, limit = spec.rsplit(":", 1)
    path = os.path.join(root, f"peer{os.environ.get('LOCAL_RANK', '0')}")
    os.makedirs(path, exist_ok=True)
    for name in ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes"):
        if os.path.exists(os.path.join(path, name)):
            with open(os.path.join(path, name), "w") as f:
                f.write(limit)
    with open(os.path.join(path, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))


_enter_cgroup()  # before the imports: they are the floor every peer pays

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import lightning_swarm  # noqa: E402


def block(width: int, ffn: int) -> nn.Module:
    return nn.Sequential(nn.LayerNorm(width), nn.Linear(width, ffn), nn.GELU(), nn.Linear(ffn, width))


class MLPPipeline(LightningModule):
    """A trainer-local input layer, ``blocks`` MLP blocks (the pipeline, ``self.layers``) and a head."""

    def __init__(
        self,
        width: int = 64,
        ffn: int = 256,
        blocks: int = 8,
        lr: float = 1e-3,
        build: bool = True,
        init_hook: bool = False,
    ):
        super().__init__()
        self.width, self.ffn, self.num_blocks, self.lr = width, ffn, blocks, lr
        self.init_hook = init_hook
        self.first_output: torch.Tensor | None = None
        if build:
            self.build()

    def build(self) -> None:
        self.inp = nn.Linear(self.width, self.width)
        self.layers = nn.Sequential(*(block(self.width, self.ffn) for _ in range(self.num_blocks)))
        self.head = nn.Linear(self.width, 1)
        if (
            self.init_hook
        ):  # as Hugging Face models initialise: an init hook over every module after the build
            self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(mean=0.0, std=0.02)
            if module.bias is not None:
                module.bias.data.zero_()
        elif isinstance(module, nn.LayerNorm):
            nn.init.trunc_normal_(module.weight, mean=1.0, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(self.inp(x)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self(x)
        if self.first_output is None:
            self.first_output = out.detach().clone()
        return nn.functional.mse_loss(out, y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr)


class BuiltInConfigureModel(MLPPipeline):
    """The same model, its layers built in ``configure_model`` (idempotent, as Lightning asks)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(build=False, **kwargs)

    def configure_model(self) -> None:
        if not hasattr(self, "layers"):
            self.build()


def data(width: int, batch: int, steps: int, seed: int = 1234) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch * steps, width, generator=g)
    y = x[:, :1] - x[:, 1:2]
    return DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=False)


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (``meta`` tensors have none)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None or t.is_meta:
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def _optimizer_tensors(optimizer) -> list[torch.Tensor]:
    if optimizer is None:
        return []
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def resident_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` whose pages are resident (``mincore``): shared memory
    that was never written holds no pages. The page where a storage starts is not counted: torch writes its
    shared-memory header there (one page per shared tensor)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    page = os.sysconf("SC_PAGE_SIZE")
    seen, total = set(), 0
    for t in tensors:
        if t is None or t.is_meta:
            continue
        storage = t.untyped_storage()
        start = storage.data_ptr()
        if start in seen or storage.nbytes() == 0:
            continue
        seen.add(start)
        first = start - start % page + page  # past the header's page
        if first >= start + storage.nbytes():
            continue
        pages = (start + storage.nbytes() - first + page - 1) // page
        vec = (ctypes.c_ubyte * pages)()
        if libc.mincore(ctypes.c_void_p(first), ctypes.c_size_t(pages * page), vec) != 0:
            total += storage.nbytes()  # unknown: counted whole
            continue
        total += min(storage.nbytes(), sum(v & 1 for v in vec) * page)
    return total


def server_extra_bytes(server, served: list[torch.Tensor]) -> int:
    """Bytes a stage server holds besides its served tensors: the optimizer's copy of the parameters and their
    gradients, the optimizer's state, hivemind's averaged and accumulated tensors (the resident part of its
    averaged gradients: shared memory a stage without a second peer never writes), the pending gradients."""
    extra = (
        list(server.shared.master)
        + [p.grad for p in server.shared.master]
        + list(server.shared.pending or ())
    )
    averaged: list[torch.Tensor] = []
    opt = server.optimizer
    if opt is not None:
        state = opt.state_averager
        extra += list(state._averaged_parameters) + _optimizer_tensors(state.optimizer)
        grads = opt.grad_averager
        extra += list(grads._local_accumulators or ())
        with grads.get_tensors() as buffers:
            averaged = list(buffers)
    own = {t.untyped_storage().data_ptr() for t in served if not t.is_meta}
    mine = {t.untyped_storage().data_ptr() for t in extra if t is not None and not t.is_meta}
    return storage_bytes(
        t for t in extra if t is not None and t.untyped_storage().data_ptr() not in own
    ) + resident_bytes(t for t in averaged if t.untyped_storage().data_ptr() not in own | mine)


def mapped_rss_bytes(path: str) -> int:
    """Resident bytes of this process's mappings of the file ``path`` (pages of it read into this process)."""
    target, total, inside = os.path.realpath(path), 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and not fields[0].endswith(":"):
                inside = len(fields) >= 6 and os.path.realpath(" ".join(fields[5:])) == target
            elif inside and fields[0] == "Rss:":
                total += int(fields[1]) * 1024
    return total


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_rise(fn) -> int:
    """How far this process's resident memory rose above its level at the start while ``fn()`` ran (sampled
    every 5 ms)."""
    import gc
    import threading

    from lightning_swarm.swarm.footprint import release_free_memory

    gc.collect()
    release_free_memory()  # freed heap pages back to the system first: each measurement starts from the same footing
    start, peak, done = _rss_bytes(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss_bytes() - start)
            time.sleep(0.005)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        fn()
    finally:
        done.set()
        thread.join()
    return max(peak[0], _rss_bytes() - start)


class SaveAtEnd(Callback):
    """``save_path``: save there when training ends. With ``compare_gather`` (weights only), also measure the rise
    of this process's RSS while saving streamed and while saving the old way (every stage gathered, then saved)."""

    def __init__(self, path: str, report: Report, compare_gather: bool = False) -> None:
        self.path, self.report, self.compare = path, report, compare_gather

    def on_train_end(self, trainer, pl_module):
        if not self.compare:
            trainer.save_checkpoint(self.path)
            return
        from lightning_swarm.strategy.checkpointing import fetcher
        from lightning_swarm.swarm.peer.checkpoint import resolve_deferred

        strategy = trainer.strategy
        streamed = peak_rss_rise(lambda: trainer.save_checkpoint(self.path, weights_only=True))

        def gathered() -> None:
            state = resolve_deferred(strategy.lightning_module_state_dict(), fetcher(strategy.peer))
            torch.save({"state_dict": state}, self.path + ".gathered")

        self.report.record["save_rss_rise_streamed_mb"] = streamed / 2**20
        self.report.record["save_rss_rise_gathered_mb"] = peak_rss_rise(gathered) / 2**20
        self.report._write(trainer)


class Report(Callback):
    def __init__(self, out_dir: str, ckpt_path: str | None = None) -> None:
        self.out_dir, self.ckpt_path = out_dir, ckpt_path
        self.record: dict = {}

    def on_fit_start(self, trainer, pl_module):
        tensors = [*pl_module.parameters(), *pl_module.buffers()]
        strategy = trainer.strategy
        peer = getattr(strategy, "_peer", None)
        record = {"rank": trainer.global_rank, "pid": os.getpid()}
        if peer is not None:
            container = peer.partition.container
            tensors += [*container.parameters(), *container.buffers()]
            hosted = [] if peer.server is None else list(peer.server.module.parameters())
            hosted += [] if peer.server is None else list(peer.server.module.buffers())
            local = [t for name, t in pl_module.named_parameters() if not name.startswith("layers.")]
            record["stage"] = peer.stage
            record["expected_bytes"] = storage_bytes(hosted) + storage_bytes(local)
            record["stage_bytes"] = storage_bytes(hosted)
            server = peer.server
            if server is not None:  # what the stage server holds besides the served parameters
                record["server_extra_bytes"] = server_extra_bytes(server, hosted)
        record["model_bytes"] = storage_bytes(tensors)
        if self.ckpt_path is not None:  # Lightning still holds the loaded checkpoint here
            record["ckpt_rss_bytes"] = mapped_rss_bytes(self.ckpt_path)
        self.record = record
        self._write(trainer)

    def on_fit_end(self, trainer, pl_module):
        # after the strategy's teardown: what the trainer's module holds once fit returned
        self.record["meta_tensors_after_fit"] = sum(
            t.is_meta for t in (*pl_module.parameters(), *pl_module.buffers())
        )
        if pl_module.first_output is not None:
            self.record["first_output"] = pl_module.first_output.tolist()
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    self.record["vm_hwm_mb"] = int(line.split()[1]) / 1024
        self._write(trainer)

    def _write(self, trainer) -> None:
        path = os.path.join(self.out_dir, f"peer{trainer.global_rank}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(self.record, f)
        os.replace(path + ".tmp", path)


def main() -> None:
    cfg = json.loads(sys.argv[1])
    way = cfg.get("way", "init")
    devices = int(cfg.get("devices", 1))
    seed = int(cfg.get("seed", 0))
    sizes = {"width": cfg.get("width", 64), "ffn": cfg.get("ffn", 256), "blocks": cfg.get("blocks", 8)}
    strategy = "auto"
    if devices > 1:
        strategy = lightning_swarm.SwarmStrategy(
            pipeline="layers",
            num_stages=devices,
            num_trainers=1,
            compression=cfg.get("compression", "none"),
            run_id=cfg.get("run_id", f"memory_{way}"),
            rebalance_period=0,
        )
    report = Report(cfg["out_dir"], cfg.get("ckpt_path"))
    callbacks: list[Callback] = [report]
    if cfg.get("save_path"):
        callbacks.append(SaveAtEnd(cfg["save_path"], report, bool(cfg.get("compare_gather"))))
    trainer = Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        max_steps=int(cfg.get("steps", 1)),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=callbacks,
    )
    seed_everything(seed, verbose=False)
    kwargs = {"lr": cfg.get("lr", 1e-3), "init_hook": bool(cfg.get("init_hook")), **sizes}
    if way == "init":
        model = MLPPipeline(**kwargs)
    elif way == "init_module":
        with trainer.init_module(empty_init=True):
            model = MLPPipeline(**kwargs)
    elif way == "configure_model":
        model = BuiltInConfigureModel(**kwargs)
    else:
        raise SystemExit(f"unknown way {way!r}: init, init_module or configure_model")
    batch = int(cfg.get("batch", 8))
    trainer.fit(model, data(sizes["width"], batch, int(cfg.get("steps", 1))), ckpt_path=cfg.get("ckpt_path"))


if __name__ == "__main__":
    main()
