"""What tests and benchmarks run, and that is neither the library nor an example a user runs. It is not installed
with the package.

- :mod:`testbed.netns`: a private network of Linux network namespaces joined by ``tc``-shaped veth links (root),
  where benchmarks put ranks and peers on a slow link and ``tests/test_dslide.py`` checks the set-up and clean-up
  (it imports nothing from ``lightning_swarm`` nor torch);
- job scripts that use the library, started as processes by tests and benchmarks: ``stage_peer.py`` (one
  server-only stage peer), ``memory_job.py`` (an MLP pipeline built in each of Lightning's three ways),
  ``fidelity_job.py`` (one model family trained in one process or in a swarm, and the gaps between the two) with
  its ``families.py`` (GPT, ViT, encoder, CNN, ALBERT), and ``dslide_fault_job.py`` (a D-SLIDE job whose ranks are
  killed on purpose).

Tests and benchmarks never import each other's files: what both need lives here.
"""
