"""verl on CPU: a platform for verl's own `PlatformRegistry`, so verl's training worker
(FSDP2 over gloo) runs where there is no accelerator, the very code path a GPU cluster runs.

verl chooses its platform from `VERL_PLATFORM` and imports plugins named in
`VERL_USE_EXTERNAL_MODULES` when `verl` is first imported; `worker_env()` returns both (plus
what the FSDP engine needs on CPU) for the environment of every worker process. Nothing in
verl is edited: the device module below answers verl's device calls for the CPU (memory
figures are 0: verl only logs them).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Optional

import torch
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry

__all__ = ["PLATFORM", "PlatformCPU", "worker_env"]

PLATFORM = "mas-cpu"


class _CPUDevice:
    """What verl calls on `get_torch_device()`, answered for the CPU (`torch.cpu` otherwise)."""

    @staticmethod
    def current_device() -> str:
        return "cpu"

    @staticmethod
    def get_device_name(*_: Any) -> str:
        return "cpu"

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def set_device(*_: Any) -> None:
        return None

    @staticmethod
    def synchronize(*_: Any) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def _zero(*_: Any, **__: Any) -> int:
        return 0

    max_memory_allocated = memory_allocated = max_memory_reserved = memory_reserved = _zero
    reset_peak_memory_stats = _zero

    @staticmethod
    def mem_get_info(*_: Any) -> tuple[int, int]:
        import psutil

        vm = psutil.virtual_memory()
        return vm.available, vm.total

    manual_seed = staticmethod(torch.manual_seed)
    manual_seed_all = staticmethod(torch.manual_seed)
    get_rng_state = staticmethod(torch.get_rng_state)
    set_rng_state = staticmethod(torch.set_rng_state)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)


_DEVICE = _CPUDevice()


@PlatformRegistry.register(platform=PLATFORM)
class PlatformCPU(PlatformBase):
    """CPU processes, gloo collectives, Ray's `CPU` resource."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> Any:
        return _DEVICE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        return False  # never auto-detected: chosen only by VERL_PLATFORM

    def current_device(self) -> str:  # type: ignore[override]
        return "cpu"  # verl moves tensors to get_device_id(): an int would mean cuda:N

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: Optional[int] = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[Optional[int], Optional[int]]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "MAS_TRAINER_VISIBLE_CPUS"

    @contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
        return {}

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None


def worker_env() -> dict[str, str]:
    """Environment of a verl worker process on CPU."""
    return {
        "VERL_USE_EXTERNAL_MODULES": __name__,
        "VERL_PLATFORM": PLATFORM,
        # verl registers its FSDP engine for cuda/npu only; the device it then uses comes
        # from the platform above, so the engine runs on the CPU all the same.
        "VERL_ENGINE_DEVICE": "cuda",
        # verl announces every optional engine it cannot import, once per rank
        "PYTHONWARNINGS": "ignore::UserWarning:verl.workers.engine",
    }
