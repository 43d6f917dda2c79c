"""glibc's allocator settings for the processes of a swarm.

glibc gives each thread that contends for ``malloc`` an arena of its own, up to 8 per core, and a peer's main
process runs 20-30 threads (hivemind's event loops, torch's pools, the stage server, the client's chunk threads):
one arena keeps their free memory from piling up per thread. It also serves the tensors of a forward and backward
(a 1024 x 4096 weight's gradient is 16 MB) from fresh ``mmap`` s that it unmaps when they are freed, and hands a
thread arena's free heaps back: each backward then pays a page fault and a zeroed page for every 4 KB it writes.
Measured on ``benchmarks/swarm_vs_alternatives.py``'s 50M-parameter stages (1 core, 2 rows x 16 tokens, two pairs
at 1 Gbit/s): 9,500-14,200 minor faults per sample in a swarm peer and 7,000-7,600 in a GPipe rank; 100-300 and
50-80 with :data:`ALLOCATOR_ENV`, and 7-15% and 10-20% less CPU per sample. The settings: one arena, tensors up to
32 MB from the heap, and free heap memory kept for the next microbatch (the explicit ``malloc_trim`` calls of
:mod:`.footprint` still hand it back). Unless the environment chooses (any ``MALLOC_*`` of these, ``GLIBC_TUNABLES``
with ``glibc.malloc``, or ``LIGHTNING_SWARM_ALLOCATOR=default``).

No imports beyond the standard library: benchmark launchers load this file on its own."""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from collections.abc import Mapping

__all__ = ["ALLOCATOR_ENV", "ALLOCATOR_OPT_OUT", "allocator_env", "tune_allocator"]

logger = logging.getLogger(__name__)

# the settings, as environment variables (read when a process starts: what a launcher gives its children) and as
# mallopt parameters (this process, from now on)
ALLOCATOR_ENV = {
    "MALLOC_ARENA_MAX": "1",
    "MALLOC_MMAP_THRESHOLD_": str(32 << 20),  # glibc's maximum (HEAP_MAX_SIZE / 2 on 64-bit)
    "MALLOC_TRIM_THRESHOLD_": str((1 << 31) - 1),
}
_MALLOPT = {"MALLOC_ARENA_MAX": -8, "MALLOC_MMAP_THRESHOLD_": -3, "MALLOC_TRIM_THRESHOLD_": -1}
ALLOCATOR_OPT_OUT = "LIGHTNING_SWARM_ALLOCATOR"  # "default": leave glibc's allocator as it is
_tuned_in_pid: int | None = None


def allocator_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables of :data:`ALLOCATOR_ENV` to add to a child's environment (``environ``, default this process's):
    none where it already chooses glibc's allocator settings or opts out (``LIGHTNING_SWARM_ALLOCATOR=default``)."""
    if environ is None:
        environ = os.environ
    if not sys.platform.startswith("linux") or environ.get(ALLOCATOR_OPT_OUT, "").lower() == "default":
        return {}
    if any(k in environ for k in ALLOCATOR_ENV) or "glibc.malloc" in environ.get("GLIBC_TUNABLES", ""):
        return {}
    return dict(ALLOCATOR_ENV)


def tune_allocator() -> None:
    """Apply :data:`ALLOCATOR_ENV` to this process with ``mallopt`` (idempotent; nothing where
    :func:`allocator_env` gives nothing, or without glibc). The arena limit binds the threads started after the
    call; a launcher's children get the settings from their start (:func:`allocator_env`)."""
    global _tuned_in_pid
    if _tuned_in_pid == os.getpid():
        return
    _tuned_in_pid = os.getpid()
    wanted = allocator_env()
    if not wanted:
        return
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError) as e:  # not glibc
        logger.debug(f"mallopt unavailable: {e!r}")
        return
    for name, value in wanted.items():
        if not mallopt(_MALLOPT[name], int(value)):
            logger.debug(f"mallopt({name}={value}) was refused")
