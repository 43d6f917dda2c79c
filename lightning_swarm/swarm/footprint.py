"""What a peer's processes cost in memory, and the settings that cut what a peer does not need.

Measured on the main job (``python benchmarks/swarm_memory.py``, PSS per peer; README has the figures):

- hivemind sets torch's tensor-sharing strategy to ``file_system`` when it is imported, which starts one
  ``torch_shm_manager`` process per peer (about 60 MB of PSS: it links libtorch) on the first shared tensor. A
  peer's averagers are forked, and inherit their shared tensors; torch's default strategy (``file_descriptor``)
  needs no manager process. :func:`trim_footprint` restores it unless ``HIVEMIND_MEMORY_SHARING_STRATEGY`` asks
  otherwise.
- glibc's allocator: one arena for all of a peer's threads, and a backward's tensors reused from the heap instead of
  faulted in page by page (:func:`~.allocator.tune_allocator`; why, and what it saves: :mod:`.allocator`).
- ``p2pd`` (Go) is started with ``GOGC`` = :data:`P2PD_GOGC` unless the environment sets ``GOGC``: its heap is
  collected at 1.25x the live data instead of 2x (see :func:`~.lifetime.die_with_parent`, which starts it).

- A page of a private mapping that a process writes after a fork is copied, and the forked helper keeps the old
  one: :func:`before_fork` hands free heap pages back before each fork and freezes the Python objects out of the
  garbage collector's passes (and after a peer released the
  blocks it does not host), and :func:`share_optimizer_state` moves a stage optimizer's state (written every step)
  to shared memory before hivemind forks its averagers; :func:`zero_grad_view` is a zero gradient that takes no
  memory, for hivemind's and the optimizer's set-up.
- :func:`share_parameters` moves the tensors a peer keeps (its stage, the trainer-local modules) to shared memory
  before its DHT forks: the optimizer writes them every step, and the DHT's process would otherwise keep the
  pages as they were at the fork (a copy of the stage). :func:`untouched_shared` is shared memory that costs
  nothing until written: hivemind's gradient averager gets its buffers so, and a stage with one peer (no round
  to average in) never pays for them.
- torch adds a float32 (or half) tensor to a float64 one through a float64 copy of the whole operand, which above
  glibc's mmap threshold (32 MB) is faulted in page by page at every add: :func:`add_widened` widens it a slice at
  a time in a small scratch buffer instead (a stage's float64 sum of a step's backwards, see
  :meth:`.server.shared.SharedState.add_pending`).
- Each shared tensor keeps one file descriptor open (torch's ``file_descriptor`` strategy): :func:`trim_footprint`
  raises the soft limit on open files to the hard one (at most :data:`OPEN_FILES`).

Linux/glibc only where it matters; elsewhere the calls do nothing.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import sys
import threading

import torch

from lightning_swarm.swarm.allocator import tune_allocator

__all__ = [
    "add_widened",
    "before_fork",
    "P2PD_GOGC",
    "p2pd_env",
    "release_free_memory",
    "share_optimizer_state",
    "share_parameters",
    "trim_footprint",
    "untouched_shared",
    "zero_grad_view",
]

logger = logging.getLogger(__name__)

P2PD_GOGC = "25"
OPEN_FILES = 1 << 16
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
    _raise_open_files_limit()
    tune_allocator()


def _raise_open_files_limit() -> None:
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        wanted = OPEN_FILES if hard == resource.RLIM_INFINITY else min(hard, OPEN_FILES)
        if soft != resource.RLIM_INFINITY and soft < wanted:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    except (ImportError, OSError, ValueError) as e:
        logger.debug(f"could not raise the open files limit: {e!r}")


def before_fork() -> None:
    """Right before a helper process is forked: free heap pages go back to the system (:func:`release_free_memory`)
    and the Python objects alive now are frozen out of the garbage collector (``gc.freeze()``, as CPython's docs
    advise before a fork): a collection writes to every object it scans, so each of its passes would copy, page by
    page, this process's whole object heap away from the helper, which would then hold the old pages alone."""
    gc.collect()
    gc.freeze()
    release_free_memory()


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


def share_parameters(tensors) -> int:
    """Move each allocated CPU tensor of ``tensors`` (parameters, buffers) to shared memory, in place (see the
    module docstring); returns how many moved. One at a time, so the copy costs one tensor's size at most."""
    moved = 0
    for t in tensors:
        if t.device.type == "cpu" and not t.is_meta and t.numel() > 0 and not t.is_shared():
            t.data.share_memory_()
            moved += 1
    return moved


# elements of the scratch buffer add_widened widens a slice of its operand in (2 MiB of float64)
WIDEN_SLICE = 1 << 18
_scratch = threading.local()


def add_widened(total: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``total.add_(values)`` for a float64 ``total`` and a narrower ``values`` of its shape, bit for bit (each
    value is widened exactly, then added in float64), without the float64 copy of all of ``values`` that torch's
    mixed-dtype add makes: ``values`` are widened :data:`WIDEN_SLICE` elements at a time in a scratch buffer of this
    thread's. On one core, a gradient of 2048 x 2048 costs about 3.6 ms so, and 20 ms through torch's copy (faulted
    in page by page: 32 MB is past glibc's mmap threshold). Anything else (another dtype, shape or device, a strided
    ``total``) is ``total.add_(values)``. Returns ``total``."""
    if (
        total.dtype != torch.float64
        or values.dtype == torch.float64
        or not values.is_floating_point()
        or total.shape != values.shape
        or total.device.type != "cpu"
        or values.device.type != "cpu"
        or not total.is_contiguous()
        or total.numel() <= WIDEN_SLICE
    ):
        return total.add_(values)
    scratch = getattr(_scratch, "buffer", None)
    if scratch is None:
        scratch = _scratch.buffer = torch.empty(WIDEN_SLICE, dtype=torch.float64)
    flat_total, flat_values = total.view(-1), values.reshape(-1)
    with torch.no_grad():
        for start in range(0, flat_values.numel(), WIDEN_SLICE):
            end = min(start + WIDEN_SLICE, flat_values.numel())
            part = scratch[: end - start]
            part.copy_(flat_values[start:end])
            flat_total[start:end].add_(part)
    return total


def untouched_shared(like: torch.Tensor) -> torch.Tensor:
    """A CPU tensor shaped as ``like``, in shared memory whose pages are allocated only when first written (they
    read as zeros)."""
    dtype = like.dtype
    storage = torch.UntypedStorage._new_shared(max(1, like.numel()) * dtype.itemsize)
    return torch.empty(0, dtype=dtype).set_(storage, 0, tuple(like.shape), torch.empty(like.shape).stride())


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
