"""PrecisionAtK: exact values on hand-made cases and a real 2-process gloo reduction."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_swarm.layers.metrics import PrecisionAtK
from tests._helpers import free_port


def test_exact_values_on_hand_made_batch() -> None:
    metric = PrecisionAtK(ks=(1, 3, 5))
    topk = torch.tensor(
        [
            [3, 1, 4, 5, 9],  # labels {3, 5}: hits at positions 1 and 4
            [7, 8, 9, 10, 11],  # labels {0}: no hit
            [2, 6, 0, 1, 4],  # labels {6, 0, 1, 4, 2, 99}: all five hit
        ]
    )
    labels = torch.tensor(
        [
            [3, 5, -1, -1, -1, -1],
            [0, -1, -1, -1, -1, -1],
            [6, 0, 1, 4, 2, 99],
        ]
    )
    metric.update(topk, labels)
    out = metric.compute()
    assert set(out) == {"p@1", "p@3", "p@5"}
    assert out["p@1"].item() == pytest.approx((1 + 0 + 1) / 3)
    assert out["p@3"].item() == pytest.approx((1 / 3 + 0 + 1) / 3)
    assert out["p@5"].item() == pytest.approx((2 / 5 + 0 + 1) / 3)


def test_divides_by_k_even_with_fewer_labels_and_counts_label_less_samples() -> None:
    metric = PrecisionAtK(ks=(1, 5))
    # One label, found at rank 1: P@5 is 1/5 (standard definition), not 1.
    metric.update(torch.tensor([[4, 0, 1, 2, 3, 8]]), torch.tensor([[4]]))
    # A sample without labels counts with precision 0; padding -1 never matches a prediction.
    metric.update(torch.tensor([[-1, 0, 1, 2, 3, 5]]), torch.tensor([[-1]]))
    out = metric.compute()
    assert out["p@1"].item() == pytest.approx(0.5)
    assert out["p@5"].item() == pytest.approx(0.1)


def test_accumulates_over_batches_like_one_batch() -> None:
    gen = torch.Generator().manual_seed(0)
    topk = torch.stack([torch.randperm(30, generator=gen)[:5] for _ in range(40)])
    labels = torch.randint(0, 30, (40, 4), generator=gen)
    labels[::3, 2:] = -1
    whole, split = PrecisionAtK(), PrecisionAtK()
    whole.update(topk, labels)
    for a, b in zip(topk.split(7), labels.split(7), strict=True):
        split.update(a, b)
    for key, value in whole.compute().items():
        assert split.compute()[key].item() == pytest.approx(value.item())
    assert 0 < whole.compute()["p@1"].item() < 1


def test_bad_input_is_rejected_with_a_clear_error() -> None:
    metric = PrecisionAtK(ks=(1, 5))
    with pytest.raises(ValueError, match="fewer than max"):
        metric.update(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="rows"):
        metric.update(torch.zeros(2, 5, dtype=torch.long), torch.zeros(3, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="2-D"):
        metric.update(torch.zeros(5, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="positive"):
        PrecisionAtK(ks=(0, 1))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    topk = torch.stack([torch.randperm(20, generator=gen)[:5] for _ in range(25)])
    labels = torch.randint(0, 20, (25, 3), generator=gen)
    labels[::4, 1:] = -1
    return topk, labels


def _worker(rank: int, world_size: int, port: int, result_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        topk, labels = _data()
        # Uneven shards: rank 0 gets 10 samples, rank 1 gets 15.
        part = slice(0, 10) if rank == 0 else slice(10, 25)
        metric = PrecisionAtK()
        metric.update(topk[part], labels[part])
        synced = {k: v.item() for k, v in metric.compute().items()}  # compute() syncs across the group
        torch.save({"synced": synced}, os.path.join(result_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_distributed_reduction_over_real_gloo_matches_single_process(tmp_path) -> None:
    port = free_port()
    mp.get_context("forkserver").set_forkserver_preload([__name__])  # ranks forked clean, torch imported once
    mp.start_processes(_worker, args=(2, port, str(tmp_path)), nprocs=2, join=True, start_method="forkserver")
    topk, labels = _data()
    single = PrecisionAtK()
    single.update(topk, labels)
    expected = {k: v.item() for k, v in single.compute().items()}
    # The shards' own means differ from the global mean, so a missing sync would fail here.
    shard0 = PrecisionAtK()
    shard0.update(topk[:10], labels[:10])
    assert any(abs(shard0.compute()[k].item() - expected[k]) > 1e-6 for k in expected)
    for rank in range(2):
        synced = torch.load(tmp_path / f"rank{rank}.pt")["synced"]
        assert synced == pytest.approx(expected)
