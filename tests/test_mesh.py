"""The D-SLIDE socket mesh (lightning_swarm/layers/mesh.py): real TCP connections between real processes on
127.0.0.1, set up through a real torch TCPStore."""

from __future__ import annotations

import socket
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_swarm.layers.mesh import MeshError, SocketMesh


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank(rank: int, world: int, port: int, case: str, results: dict) -> None:
    try:
        store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=timedelta(seconds=30))
        mesh = SocketMesh(rank, world, store, "127.0.0.1", timeout_s=20.0, spin_s=0.05)
        if case == "ok":
            x = torch.full((3, 4), float(rank + 1))
            # two collectives in flight, waited for in the reverse order; a third in between, synchronous
            flags = torch.tensor([rank, -rank, 7], dtype=torch.int64)
            first = mesh.start_all_reduce(flags, lambda a, b: torch.minimum(a, b, out=a))
            second = mesh.start_all_gather(torch.arange(5.0) * (rank + 1))
            summed = mesh.start_all_reduce(x, lambda a, b: a.add_(b))
            summed.wait()
            second.wait()
            first.wait()
            empty = mesh.start_all_gather(torch.empty(0, 4))
            empty.wait()
            results[rank] = {
                "sum": x.tolist(),
                "gathered": [p.tolist() for p in second.parts],
                "min": flags.tolist(),
                "empty": [tuple(p.shape) for p in empty.parts],
            }
        elif case == "out_of_step":  # rank 1 sends a tensor of another size: both ranks must say so, not hang
            handle = mesh.start_all_gather(torch.zeros(4 if rank == 0 else 6))
            handle.wait()
            results[rank] = "no error"
        elif case == "peer_dies":
            if rank == 1:
                mesh.close()
                results[rank] = "closed"
                return
            handle = mesh.start_all_gather(torch.zeros(1000))
            handle.wait()
            results[rank] = "no error"
        mesh.close()
    except MeshError as e:
        results[rank] = f"MeshError: {e}"
    except Exception:
        results[rank] = traceback.format_exc()


def _run(case: str, world: int) -> dict:
    ctx = mp.get_context("spawn")
    port = _free_port()
    with ctx.Manager() as manager:
        results = manager.dict()
        procs = [ctx.Process(target=_rank, args=(r, world, port, case, results)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
        alive = [p for p in procs if p.is_alive()]
        for p in alive:
            p.kill()
            p.join()
        assert not alive, f"{case}: a rank hung"
        return dict(results)


@pytest.mark.timeout(120)
def test_collectives_over_the_mesh_agree_on_every_rank_in_any_wait_order() -> None:
    world = 3
    results = _run("ok", world)
    for rank in range(world):
        got = results[rank]
        assert isinstance(got, dict), got
        assert got["sum"] == [[6.0] * 4] * 3  # 1 + 2 + 3
        assert got["gathered"] == [[float(i * (r + 1)) for i in range(5)] for r in range(world)]
        assert got["min"] == [0, -2, 7]
        assert got["empty"] == [(0, 4)] * world


@pytest.mark.timeout(120)
def test_ranks_out_of_step_fail_with_a_clear_error() -> None:
    results = _run("out_of_step", 2)
    for rank in range(2):
        assert "MeshError" in results[rank] and "ran different collectives" in results[rank], results[rank]


@pytest.mark.timeout(120)
def test_a_rank_that_closes_its_connections_ends_the_others_collective() -> None:
    results = _run("peer_dies", 2)
    assert results[1] == "closed"
    assert "MeshError: rank 0: the connection to rank 1 was closed" in results[0], results[0]
