"""One rank of a GPipe job that checkpoints and resumes: what a user of ``torch.distributed.pipelining`` runs so that
a killed rank costs a restart from the last checkpoint, not the whole run (``benchmarks/swarm_faults.py``).

``python benchmarks/_harness/gpipe_job.py '<json>'`` runs rank ``rank`` of 2 (one stage each) over gloo, rendezvous
at ``tcp://127.0.0.1:<port>``, with one torch thread. The model is ``testbed/stage_peer.py``'s: stage ``k`` is
``blocks`` blocks of ``Linear(width, width)`` + ``Tanh``; its initial weights are the ``step 0`` checkpoint the
benchmark writes from ``stage_peer.stage_module`` (so both jobs start from the same weights; this file imports
only torch, as a rank of a pipelining job would, and not hivemind or ``lightning_swarm``, whose imports would add
seconds to every restart). One pipeline step is ``ScheduleGPipe`` over ``microbatches`` microbatches of ``batch``
rows (the input is random, the loss ``output.pow(2).mean()``, as the swarm trainer's); ``accumulate`` pipeline
steps make one optimizer step (``Adam(lr)``, the stage peers' optimizer and batch).

Every ``every`` optimizer steps the rank saves its stage's model and optimizer state to
``<dir>/ckpt/rank<r>_step<s>.pt`` (``torch.save`` to a temporary file, then ``os.replace``: a file that exists is
complete). On start both ranks resume from the last step that both ranks' files have (the previous job's ranks are
all dead by then: the supervisor restarts the job as a whole). Events go to ``<dir>/events_rank<r>.txt``, one per
line, flushed: ``resume <step> <monotonic time>`` once the rank is ready to train, ``step <s> <time>`` after each
optimizer step, ``ckpt <s> <seconds the save took>`` after each checkpoint (``time.monotonic`` is the system's
``CLOCK_MONOTONIC``, the same clock in every process). It trains until it is killed.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

_CKPT = re.compile(r"rank(\d)_step(\d+)\.pt$")


def stage_blocks(width: int, blocks: int) -> nn.Module:
    """The architecture of ``testbed/stage_peer.stage_module`` (its weights come from the checkpoint)."""
    return nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(blocks)))


def last_complete(ckpt: Path, ranks: int = 2) -> int:
    """The last step that every rank saved (``-1``: none)."""
    steps: dict[int, set[int]] = {}
    for f in ckpt.iterdir():
        m = _CKPT.match(f.name)
        if m:
            steps.setdefault(int(m.group(2)), set()).add(int(m.group(1)))
    complete = [s for s, r in steps.items() if len(r) == ranks]
    return max(complete, default=-1)


def save(ckpt: Path, rank: int, step: int, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    tmp = ckpt / f".rank{rank}_step{step}.pt.tmp"
    torch.save({"model": module.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, tmp)
    os.replace(tmp, ckpt / f"rank{rank}_step{step}.pt")


def prune(ckpt: Path, rank: int, keep: set[int]) -> None:
    """Delete this rank's checkpoints but ``keep`` (its newest and the one before: the other rank may not have
    saved the newest yet)."""
    for f in ckpt.iterdir():
        m = _CKPT.match(f.name)
        if m and int(m.group(1)) == rank and int(m.group(2)) not in keep:
            f.unlink(missing_ok=True)


def main() -> None:
    cfg = json.loads(sys.argv[1])
    rank, out = cfg["rank"], Path(cfg["dir"])
    ckpt = out / "ckpt"
    torch.set_num_threads(1)
    events = open(out / f"events_rank{rank}.txt", "a", buffering=1)  # noqa: SIM115 (lives as long as the rank)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{cfg['port']}", rank=rank, world_size=2)
    start = last_complete(ckpt)
    state = torch.load(ckpt / f"rank{rank}_step{start}.pt", weights_only=True)
    module = stage_blocks(cfg["width"], cfg["blocks"])
    module.load_state_dict(state["model"])
    optimizer = torch.optim.Adam(module.parameters(), lr=cfg["lr"])
    if state["optimizer"] is not None:
        optimizer.load_state_dict(state["optimizer"])
    mb, m = cfg["batch"], cfg["microbatches"]
    stage = PipelineStage(module, rank, 2, torch.device("cpu"), input_args=(torch.zeros(mb, cfg["width"]),))
    # the loss is a mean per microbatch; gradients add up over the microbatches and the accumulated pipeline steps
    schedule = ScheduleGPipe(stage, n_microbatches=m, loss_fn=_loss, scale_grads=False)
    dist.barrier()  # both ranks ready: the job is back
    events.write(f"resume {start} {time.monotonic():.4f}\n")
    step, kept = start, {start}
    while True:
        for _ in range(cfg["accumulate"]):
            if rank == 0:
                schedule.step(torch.randn(mb * m, cfg["width"]))
            else:
                schedule.step(target=torch.zeros(mb * m), losses=[])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        events.write(f"step {step} {time.monotonic():.4f}\n")
        if step % cfg["every"] == 0:
            began = time.monotonic()
            save(ckpt, rank, step, module, optimizer)
            events.write(f"ckpt {step} {time.monotonic() - began:.5f}\n")
            kept = {max(kept), step}
            prune(ckpt, rank, kept)


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return output.pow(2).mean()


if __name__ == "__main__":
    main()
