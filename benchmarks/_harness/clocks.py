"""Step clocks: marks taken at the start of every step and once after the last one.

:class:`StepClock` records, at each :meth:`~StepClock.mark`, the wall clock (``time.perf_counter``), this process's
CPU time (``time.process_time``) and any probes given (name -> a function returning a number or None, e.g.
``counters.link_bytes``). :meth:`~StepClock.window` turns the marks after ``warm`` warm-up steps into per-step
figures. :func:`lightning_clock` is the same as a Lightning callback (a mark at every ``on_train_batch_start`` and at
``on_train_end``); :func:`lightning_clock_class` is its class, to subclass.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any


class StepClock:
    def __init__(self, **probes: Callable[[], Any]) -> None:
        self.probes = probes
        self.times: list[float] = []
        self.cpu: list[float] = []
        self.readings: dict[str, list[Any]] = {name: [] for name in probes}

    def mark(self) -> None:
        self.times.append(time.perf_counter())
        self.cpu.append(time.process_time())
        for name, probe in self.probes.items():
            self.readings[name].append(probe())

    def steps_after(self, warm: int) -> int:
        """Steps between the mark ``warm`` (the end of the warm-up) and the last mark."""
        return len(self.times) - 1 - warm

    def window(self, warm: int) -> dict[str, Any]:
        """``steps``, ``step_s`` (mean wall seconds per step), ``cpu_s_per_step`` and, per probe, its change per
        step (None where a reading is None) over the steps after ``warm``."""
        steps = self.steps_after(warm)
        out: dict[str, Any] = {
            "steps": steps,
            "step_s": (self.times[-1] - self.times[warm]) / steps,
            "cpu_s_per_step": (self.cpu[-1] - self.cpu[warm]) / steps,
        }
        for name, values in self.readings.items():
            a, b = values[warm], values[-1]
            out[f"{name}_per_step"] = (b - a) / steps if a is not None and b is not None else None
        return out


@functools.cache
def lightning_clock_class() -> type:
    """The :class:`StepClock` as a Lightning ``Callback`` class (Lightning is imported here, on first use)."""
    from lightning.pytorch import Callback

    class LightningStepClock(Callback, StepClock):
        def __init__(self, **probes: Callable[[], Any]) -> None:
            StepClock.__init__(self, **probes)

        def on_train_batch_start(self, *_: Any) -> None:
            self.mark()

        def on_train_end(self, *_: Any) -> None:
            self.mark()

    return LightningStepClock


def lightning_clock(**probes: Callable[[], Any]) -> Any:
    """A Lightning callback marking a :class:`StepClock` at every step's start and at the end of training."""
    return lightning_clock_class()(**probes)
