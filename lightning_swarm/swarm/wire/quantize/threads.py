"""Threads of the 8-bit kernel: every kernel call runs on one OpenMP thread of its caller (OpenMP workers spin
after each parallel region and starve the p2p daemons sharing the cores), and a large tensor is cut at block
boundaries into shares that the caller and idle helper threads claim one by one."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from lightning_swarm.swarm.wire.quantize.blocks import BLOCKSIZE

HELPERS_ENV = "LIGHTNING_SWARM_CODEC_HELPERS"


_SHARE_ELEMENTS = 32 * BLOCKSIZE  # the unit of work the threads claim


@functools.cache
def _omp() -> Any:
    """The OpenMP runtime torch uses (bitsandbytes shares it), for per-thread settings; None if not found."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line or "libiomp" in line}
        for path in sorted(paths):
            # PyDLL keeps the GIL: releasing it around a 10 ns call may cost a thread switch
            lib = ctypes.PyDLL(path)
            lib.omp_set_num_threads  # noqa: B018 (raises AttributeError if this is not an OpenMP runtime)
            return lib
    except (OSError, AttributeError):
        pass
    return None


@contextlib.contextmanager
def one_thread(count: int = 1) -> Iterator[None]:
    """Run torch/bitsandbytes kernels on ``count`` OpenMP threads in this thread only.

    ``torch.set_num_threads`` also changes a process-wide default that new threads start from, so the OpenMP
    setting of the calling thread is changed directly where the runtime is found.
    """
    previous = torch.get_num_threads()  # also lets torch initialise this thread's setting before we change it
    if previous == count:
        yield
        return
    omp = _omp()
    setter = torch.set_num_threads if omp is None else omp.omp_set_num_threads
    setter(count)
    try:
        yield
    finally:
        setter(previous)


class _QuantizeCounter:
    """Counts quantizations (tests use it to check that a message was re-sent, not re-quantized)."""

    def __init__(self) -> None:
        self.calls = 0
        self.lock = threading.Lock()

    def add(self) -> None:
        with self.lock:
            self.calls += 1


quantizations = _QuantizeCounter()


def helper_count() -> int:
    """Idle threads that help quantize large tensors: ``LIGHTNING_SWARM_CODEC_HELPERS``, else cores - 1 (max 3).

    Read on every call (cheap), so the setting may change while the process runs.
    """
    value = os.environ.get(HELPERS_ENV)
    if value is None:
        return min(_cpu_count() - 1, 3)
    if not value.strip().isdigit():
        raise ValueError(
            f"{HELPERS_ENV} must be a non-negative integer (threads that help quantize; 0 for none), got {value!r}"
        )
    return int(value)


@functools.cache
def _cpu_count() -> int:
    return os.cpu_count() or 1  # ~50 us a call: it reads /sys


_pool: ThreadPoolExecutor | None = None


_pool_pid: int | None = None


_pool_lock = threading.Lock()


def _helpers(count: int) -> ThreadPoolExecutor:
    global _pool, _pool_pid
    with _pool_lock:
        # a forked child has none of its parent's threads; a larger setting needs a larger pool
        if _pool is None or _pool_pid != os.getpid() or _pool._max_workers < count:
            _pool = ThreadPoolExecutor(max_workers=max(1, count), thread_name_prefix="swarm-codec")
            _pool_pid = os.getpid()
        return _pool


def part_bounds(numel: int, chunks: int) -> list[int]:
    """Element offsets of ``chunks`` pieces of a flat tensor: block-aligned, as even as possible."""
    units = -(numel // -BLOCKSIZE)
    return [min(numel, (units * i // chunks) * BLOCKSIZE) for i in range(chunks + 1)]


class Shares:
    """Block-aligned shares of one quantization, done by whichever thread claims them first.

    ``kernel(lo, hi)`` quantizes elements ``[lo, hi)`` (block-aligned) into their final place. The caller waits
    for the shares to be done, not for the helpers: a helper that wakes up after the caller took every share
    (a busy machine) costs the caller nothing.
    """

    def __init__(self, kernel: Any, numel: int, helpers: int):
        shares = min(64, numel // _SHARE_ELEMENTS) if helpers > 0 else 1
        self.kernel, self.helpers = kernel, helpers
        self.bounds = part_bounds(numel, max(1, shares))
        self.total = len(self.bounds) - 1
        self.next = self.done = 0
        self.error: BaseException | None = None
        self.lock = threading.Lock()
        self.finished = threading.Condition(self.lock)

    def run(self) -> None:
        """Do the work with as many idle helper threads as there are spare shares."""
        count = min(self.helpers, self.total - 1)
        for _ in range(count):
            _helpers(self.helpers).submit(self.work)
        self.work()
        with self.lock:
            while self.done < self.total:
                self.finished.wait()
        if self.error is not None:
            raise self.error

    def work(self) -> None:
        while True:
            with self.lock:
                index = self.next
                if index >= self.total:
                    return
                self.next += 1
            try:
                self.kernel(self.bounds[index], self.bounds[index + 1])
            except BaseException as e:  # re-raised by run(), in the caller's thread
                self.error = e
            finally:
                with self.lock:
                    self.done += 1
                    if self.done == self.total:
                        self.finished.notify_all()
