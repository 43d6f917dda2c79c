"""The benchmarks' one harness.

A benchmark script (``benchmarks/<name>.py``) begins with ``import _harness``: the script's folder is on
``sys.path`` when Python runs it, and importing the harness puts the repository root first on ``sys.path`` (the
only place that does), so that ``examples``, ``testbed`` and this checkout's ``lightning_swarm`` import from there.

- :mod:`.procs`: child processes and rank launchers that end with the benchmark on every exit path
  (:func:`popen`, :func:`run`, :class:`Launcher`, :func:`rank_env`, :func:`exit_on_sigterm`);
- :mod:`.links`: shaped links (``testbed.netns.VirtualCluster``: namespaces, veth, ``tc``) and :class:`Loopback`
  behind one interface (:func:`link`);
- :mod:`.clocks`: step clocks (:class:`StepClock`, :func:`lightning_clock`); :mod:`.memory`: PSS, RSS, ``VmHWM``;
  :mod:`.counters`: bytes on a link, CPU time by process and thread;
- :mod:`.trainer`: ``QUIET_TRAINER``, the ``Trainer`` arguments of a measured Lightning run;
- :mod:`.cli`: :func:`parser`, with ``--quick`` and ``--out``; :mod:`.report`: :class:`Report`, which writes
  ``runs/<name>/<name>.json`` (commit, UTC date, load before and after, command line, figures) and prints it as
  the last stdout line;
- :mod:`.registry`: what each report claims and its target, for ``scripts/benchmark_table.py`` (the figures table
  of ``docs/benchmarks.md``);
- :mod:`.stage_load` (imports torch and hivemind: import it by name): trainer processes that drive one stage
  server as fast as they can (``batched_stage.py``, ``kept_activations.py``).

Tests never import this package, and no benchmark imports a test's file: what both need lives in ``testbed/``
(infrastructure and the job scripts both start) or ``examples/`` (what a user runs).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _allocator_env() -> dict[str, str]:
    """The glibc allocator settings a swarm's processes run with (``lightning_swarm/swarm/allocator.py``, loaded on
    its own: the package would import torch into every benchmark's parent)."""
    spec = importlib.util.spec_from_file_location(
        "_swarm_allocator", ROOT / "lightning_swarm/swarm/allocator.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.allocator_env()


# every process a benchmark starts, the swarm's and its baselines' alike, runs with the allocator settings that
# SwarmStrategy gives its own peers: equal terms (LIGHTNING_SWARM_ALLOCATOR=default runs all with glibc's defaults)
os.environ.update(_allocator_env())

from . import counters, memory  # noqa: E402
from .cli import parser  # noqa: E402
from .clocks import StepClock, lightning_clock, lightning_clock_class  # noqa: E402
from .links import Loopback, VirtualCluster, link  # noqa: E402
from .procs import (  # noqa: E402
    Launcher,
    dies_with_me,
    exit_on_sigterm,
    kill_group,
    popen,
    rank_env,
    run,
    set_parent_death_signal,
    stop_with_stdin,
)
from .report import Report  # noqa: E402
from .trainer import QUIET as QUIET_TRAINER  # noqa: E402

__all__ = [
    "ROOT",
    "QUIET_TRAINER",
    "Launcher",
    "Loopback",
    "Report",
    "StepClock",
    "VirtualCluster",
    "counters",
    "dies_with_me",
    "exit_on_sigterm",
    "kill_group",
    "lightning_clock",
    "lightning_clock_class",
    "link",
    "memory",
    "parser",
    "popen",
    "rank_env",
    "run",
    "set_parent_death_signal",
    "stop_with_stdin",
]
