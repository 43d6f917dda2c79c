"""glibc's allocator settings for the processes of a swarm (see :mod:`.footprint`'s docstring for why and what
they save). No imports beyond the standard library: benchmark launchers load this file on its own."""

from __future__ import annotations

import ctypes
import logging
import os
import sys

__all__ = ["ALLOCATOR_ENV", "ALLOCATOR_OPT_OUT", "allocator_env", "tune_allocator"]

logger = logging.getLogger(__name__)

# glibc malloc's settings for a process of the swarm (see the module's docstring), as environment variables (read
# when a process starts: what a launcher gives its children) and as mallopt parameters (this process, from now on)
ALLOCATOR_ENV = {
    "MALLOC_ARENA_MAX": "1",
    "MALLOC_MMAP_THRESHOLD_": str(32 << 20),  # glibc's maximum (HEAP_MAX_SIZE / 2 on 64-bit)
    "MALLOC_TRIM_THRESHOLD_": str((1 << 31) - 1),
}
_MALLOPT = {"MALLOC_ARENA_MAX": -8, "MALLOC_MMAP_THRESHOLD_": -3, "MALLOC_TRIM_THRESHOLD_": -1}
ALLOCATOR_OPT_OUT = "LIGHTNING_SWARM_ALLOCATOR"  # "default": leave glibc's allocator as it is
_tuned_in_pid: int | None = None


def allocator_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The variables of :data:`ALLOCATOR_ENV` to add to a child's environment (``environ``, default this process's):
    none where it already chooses glibc's allocator settings or opts out (``LIGHTNING_SWARM_ALLOCATOR=default``)."""
    environ = os.environ if environ is None else environ
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
