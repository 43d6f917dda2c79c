"""Shared fixtures and the two tiers of the suite.

- ``unit``: tests of one component in this process, without a DHT, a p2p daemon or child processes (the modules
  in ``UNIT_MODULES``); ``pytest -m unit`` is the fast loop (about 40 s on 2 cores). Each has a
  60 s timeout unless it says otherwise.
- ``integration``: everything else (real DHTs and P2P on 127.0.0.1, local swarms, gloo groups, launchers); a new
  test module is integration unless it is added to ``UNIT_MODULES``. Each has the suite's default timeout (600 s)
  unless it says otherwise.

``pytest`` (what CI runs) runs both. The job scripts that integration tests start (``tests/_*_job.py``,
``examples/albert/*.py``, ``lightning-swarm serve``...) are forked by each worker's zygote (``tests/_zygote.py``)
instead of importing torch and Lightning afresh, and so are the ranks their launcher starts (``SwarmLauncher``'s,
D-SLIDE's ``RestartingLauncher``'s and Lightning's own for the DDP baselines, unless the job runs in its own
session); ``LIGHTNING_SWARM_TEST_ZYGOTE=0``
starts them all as plain processes, ``LIGHTNING_SWARM_TEST_ZYGOTE_RANKS=0`` only the ranks. The ranks of the mesh
and metric tests come from a fork server (``multiprocessing``'s ``forkserver``) that imported the test module once.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator

import hivemind
import pytest

from lightning_swarm.swarm.allocator import allocator_env
from tests._helpers import local_dhts

# the allocator settings SwarmStrategy's launcher gives its peers (see lightning_swarm/swarm/allocator.py), here for
# every process of the suite: the xdist workers and their zygotes then match the launched peers' environment, which
# the zygote needs to fork a peer instead of starting it afresh (tests/_zygote.py)
os.environ.update(allocator_env())

UNIT_MODULES = {
    "test_allocator",
    "test_boundary",
    "test_codec",
    "test_deferred_grads",
    "test_deferred_init",
    "test_fuzz_codec",
    "test_hashing",
    "test_lazy_adam",
    "test_partition",
    "test_rebalance_policy",
    "test_weight_grads",
    "test_widened_sums",
    "test_records",
    "test_routing",
    "test_schedules",
    "test_sparse_linear",
}
UNIT_TIMEOUT_S = 60
# the modules whose tests take longest (local swarms of 4 peers, kills and restarts, launchers): run first, so that
# with several workers (``-n``, what scripts/test.sh uses) none of them is left to run alone at the end
LONGEST_FIRST = (
    "test_swarm_strategy",
    "test_chaos",
    "test_albert",
    "test_failures",
    "test_contract",
    "test_dslide",
    "test_dslide_restarts",
    "test_memory",
    "test_launcher",
    "test_docs_commands",
)


def _module(item: pytest.Item) -> str:
    return item.module.__name__.rsplit(".", 1)[-1] if item.module is not None else ""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _module(item) in UNIT_MODULES:
            item.add_marker(pytest.mark.unit)
            if item.get_closest_marker("timeout") is None:
                item.add_marker(pytest.mark.timeout(UNIT_TIMEOUT_S))
        else:
            item.add_marker(pytest.mark.integration)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(_module(item), len(rank)))  # stable: each module keeps its order


@pytest.fixture
def cleanup() -> Iterator[list]:
    """Things with a ``shutdown()`` to stop after the test, even when it fails (last added, first stopped)."""
    things: list = []
    yield things
    for thing in reversed(things):
        thing.shutdown()


_DHT_NAMES = ("trainer", "server1", "server2")


@pytest.fixture(scope="module")
def _module_dhts() -> Iterator[dict[str, hivemind.DHT]]:
    nodes = dict(zip(_DHT_NAMES, local_dhts(3), strict=True))
    yield nodes
    for dht in nodes.values():
        dht.shutdown()


@pytest.fixture
def dhts(_module_dhts, request) -> Iterator[dict[str, hivemind.DHT]]:
    """Three DHT nodes on 127.0.0.1 shared by a module's tests: ``"trainer"``, ``"server1"`` and ``"server2"``.

    A node that died during a test is reported (a warning naming that test and the node's exit code) and the three
    are replaced before the next test, so one test's dead node does not fail a later one with a misleading error.
    """
    nodes = _module_dhts
    if not all(dht.is_alive() for dht in nodes.values()):
        for dht in nodes.values():
            dht.shutdown()
        nodes.update(zip(_DHT_NAMES, local_dhts(3), strict=True))
    yield nodes
    dead = {name: dht.exitcode for name, dht in nodes.items() if not dht.is_alive()}
    if dead:
        warnings.warn(
            f"{request.node.nodeid}: DHT node(s) died during this test (exit codes {dead})", stacklevel=1
        )
