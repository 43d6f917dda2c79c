"""glibc's allocator settings for a swarm's processes (lightning_swarm/swarm/allocator.py): what they change, in a
fresh interpreter (glibc reads its settings once), and when they are left to the user."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from lightning_swarm.swarm.allocator import ALLOCATOR_ENV, ALLOCATOR_OPT_OUT, allocator_env

# forwards and backwards of a Transformer layer of width 1024 (its parameter gradients are fresh tensors of 16, 16,
# 12 and 4 MB, as torch.autograd.grad returns them), each on a thread of its own, as a stage server serves requests
# off the main thread; prints the minor page faults per timed round
_JOB = """
import json, resource, sys, threading
import torch
torch.set_num_threads(1)
if sys.argv[1] == "tune":
    from lightning_swarm.swarm.allocator import tune_allocator
    tune_allocator()
layer = torch.nn.TransformerEncoderLayer(1024, 16, 4096, dropout=0.0, batch_first=True)
params = list(layer.parameters())
def work():
    x = torch.randn(2, 16, 1024, requires_grad=True)
    grads = torch.autograd.grad(layer(x).sum(), [x, *params])
    del grads
for i in range(8):
    if i == 2:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = threading.Thread(target=work)
    t.start()
    t.join()
print(json.dumps({"faults": (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 6}))
"""


def _faults(mode: str) -> int:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    env.pop(ALLOCATOR_OPT_OUT, None)
    env["OMP_NUM_THREADS"] = "1"
    out = subprocess.run(
        [sys.executable, "-c", _JOB, mode], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])["faults"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator: not applied elsewhere")
def test_the_tuned_allocator_reuses_a_threads_large_tensors_instead_of_faulting_them_in_again() -> None:
    pages = 4 * sum(p.numel() for p in torch.nn.TransformerEncoderLayer(1024, 16, 4096).parameters()) // 4096
    default, tuned = _faults("default"), _faults("tune")  # per round, against the gradients' pages
    assert default > pages // 2, (default, pages)  # glibc's defaults: fresh mmaps, faulted in page by page
    assert tuned < pages // 10, (tuned, pages)  # tuned after torch's import, as SwarmStrategy does: reused


def test_the_settings_are_left_to_an_environment_that_chooses_them() -> None:
    assert allocator_env({}) == (ALLOCATOR_ENV if sys.platform.startswith("linux") else {})
    assert allocator_env({"MALLOC_ARENA_MAX": "4"}) == {}
    assert allocator_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=4"}) == {}
    assert allocator_env({ALLOCATOR_OPT_OUT: "default"}) == {}
    assert allocator_env({"GLIBC_TUNABLES": "glibc.rtld.optional_static_tls=512"}) == allocator_env({})
