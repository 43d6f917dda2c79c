"""Test-bed infrastructure that both ``tests/`` and ``benchmarks/`` use, and that is neither the library nor an
example of it: it imports nothing from ``lightning_swarm`` (nor torch) and is not installed with the package.

- :mod:`testbed.netns`: a private network of Linux network namespaces joined by ``tc``-shaped veth links (root),
  where benchmarks put ranks and peers on a slow link and ``tests/test_dslide.py`` checks the set-up and clean-up.

Tests and benchmarks never import each other's files: what both need lives here (infrastructure) or in
``examples/`` (models and jobs that use the library, e.g. ``examples/stage_peer.py``, ``examples/memory_job.py``).
"""
