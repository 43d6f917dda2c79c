"""What a peer's processes cost in memory, and the settings that cut what a peer does not need.

Measured on the main job (``python benchmarks/swarm_memory.py``, PSS per peer; README has the figures):

- hivemind sets torch's tensor-sharing strategy to ``file_system`` when it is imported, which starts one
  ``torch_shm_manager`` process per peer (about 60 MB of PSS: it links libtorch) on the first shared tensor. A
  peer's averagers are forked, and inherit their shared tensors; torch's default strategy (``file_descriptor``)
  needs no manager process. :func:`trim_footprint` restores it unless ``HIVEMIND_MEMORY_SHARING_STRATEGY`` asks
  otherwise.
- glibc gives each thread that contends for ``malloc`` an arena of its own, up to 8 per core, and a peer's main
  process runs 20-30 threads (hivemind's event loops, torch's pools, the stage server): limiting the arenas to
  :data:`MALLOC_ARENAS` (unless ``MALLOC_ARENA_MAX`` is set) keeps their free memory from piling up per thread.
- ``p2pd`` (Go) is started with ``GOGC`` = :data:`P2PD_GOGC` unless the environment sets ``GOGC``: its heap is
  collected at 1.25x the live data instead of 2x (see :func:`~.lifetime.die_with_parent`, which starts it).

- A page of a private mapping that a process writes after a fork is copied, and the forked helper keeps the old
  one: :func:`release_free_memory` hands free heap pages back before each fork (and after a peer released the
  blocks it does not host), and :func:`share_optimizer_state` moves a stage optimizer's state (written every step)
  to shared memory before hivemind forks its averagers; :func:`zero_grad_view` is a zero gradient that takes no
  memory, for hivemind's and the optimizer's set-up.

Linux/glibc only where it matters; elsewhere the calls do nothing.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys

import torch

__all__ = [
    "MALLOC_ARENAS",
    "P2PD_GOGC",
    "p2pd_env",
    "release_free_memory",
    "share_optimizer_state",
    "trim_footprint",
    "zero_grad_view",
]

logger = logging.getLogger(__name__)

MALLOC_ARENAS = 2
P2PD_GOGC = "25"
_M_ARENA_MAX = -8  # glibc's mallopt parameter
_trimmed_in_pid: int | None = None


def trim_footprint() -> None:
    """Apply the settings above to this process (idempotent; call before the peer starts its helpers)."""
    global _trimmed_in_pid
    if _trimmed_in_pid == os.getpid():
        return
    _trimmed_in_pid = os.getpid()
    if "HIVEMIND_MEMORY_SHARING_STRATEGY" not in os.environ:
        import torch.multiprocessing as tmp

        if "file_descriptor" in tmp.get_all_sharing_strategies():
            tmp.set_sharing_strategy("file_descriptor")
    if "MALLOC_ARENA_MAX" not in os.environ and sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None).mallopt(_M_ARENA_MAX, MALLOC_ARENAS)
        except (OSError, AttributeError) as e:  # not glibc
            logger.debug(f"mallopt(M_ARENA_MAX) unavailable: {e!r}")


def release_free_memory() -> None:
    """Hand the heap's free pages back to the system (glibc's ``malloc_trim``): after a peer released the blocks it
    does not host, or materialised its stage (each skipped block's values drawn in scratch memory then freed),
    glibc would otherwise keep the freed pages resident for later allocations (its mmap threshold grows with the
    largest block freed, so tensors of a block's size come from the heap and stay there once freed)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None).malloc_trim(0)
        except (OSError, AttributeError) as e:  # not glibc
            logger.debug(f"malloc_trim unavailable: {e!r}")


def share_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Move the optimizer's state tensors on the CPU to shared memory, in place, before hivemind forks its averager
    processes: every step writes them, and pages of a private mapping written after a fork are copied, so each
    forked helper would keep its own copy of the state as it was (two Adam moments per helper). Shared pages are
    never copied."""
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.dim() > 0:
                value.share_memory_()


def zero_grad_view(p: torch.Tensor) -> torch.Tensor:
    """A zero gradient for ``p`` that takes no memory (one element, expanded): hivemind and the optimizer's
    initial step only read it, or copy it (a copy is dense)."""
    return torch.zeros((), dtype=p.dtype, device=p.device).expand_as(p)


def p2pd_env(program: str, env: dict[str, str] | None) -> dict[str, str] | None:
    """The environment to start ``program`` with: ``p2pd`` gets ``GOGC`` unless it is set already."""
    if os.path.basename(str(program)) != "p2pd":
        return env
    base = dict(os.environ if env is None else env)
    base.setdefault("GOGC", P2PD_GOGC)
    return base
