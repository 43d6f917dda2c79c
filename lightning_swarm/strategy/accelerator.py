"""The ``"swarm"`` accelerator: one local device per peer (the engine measures throughput itself)."""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.accelerators.registry import _AcceleratorRegistry
from lightning.fabric.utilities.types import _DEVICE
from lightning.pytorch.accelerators import Accelerator, CPUAccelerator, CUDAAccelerator
from typing_extensions import override


class SwarmAccelerator(Accelerator):
    """Accelerator for swarm peers: picks CUDA when present, else the CPU.

    ``Trainer(accelerator="swarm", devices=N)`` runs N peers; on a GPU machine each takes one GPU (round robin when
    there are more peers than GPUs), on a CPU machine they share the CPU.
    """

    @override
    def setup_device(self, device: torch.device) -> None:
        if device.type == "cuda":
            torch.cuda.set_device(device)

    @override
    def get_device_stats(self, device: _DEVICE) -> dict[str, Any]:
        if torch.device(device).type == "cuda":
            return CUDAAccelerator().get_device_stats(device)
        return CPUAccelerator().get_device_stats(device)

    @override
    def teardown(self) -> None:
        pass

    @staticmethod
    @override
    def parse_devices(devices: int | str | list[int]) -> int:
        if isinstance(devices, list):
            return len(devices)
        if devices in ("auto", -1, "-1"):
            return SwarmAccelerator.auto_device_count()
        try:
            count = int(devices)
        except (TypeError, ValueError):
            raise ValueError(
                f"`devices={devices!r}` is not understood by the SwarmAccelerator; pass the number of peers to run "
                "on this machine, e.g. `devices=4`."
            ) from None
        if count < 1:
            raise ValueError(
                f"The SwarmAccelerator needs `devices >= 1` (peers on this machine), got {count}."
            )
        return count

    @staticmethod
    @override
    def get_parallel_devices(devices: int | str | list[int]) -> list[torch.device]:
        count = SwarmAccelerator.parse_devices(devices)
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus:
            return [torch.device("cuda", i % gpus) for i in range(count)]
        return [torch.device("cpu")] * count

    @staticmethod
    @override
    def auto_device_count() -> int:
        return max(1, torch.cuda.device_count()) if torch.cuda.is_available() else 1

    @staticmethod
    @override
    def is_available() -> bool:
        return True

    @staticmethod
    @override
    def name() -> str:
        return "swarm"

    @classmethod
    @override
    def register_accelerators(cls, accelerator_registry: _AcceleratorRegistry) -> None:
        accelerator_registry.register(cls.name(), cls, description=cls.__name__)
