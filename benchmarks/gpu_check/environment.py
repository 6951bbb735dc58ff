"""Section 1: what the check runs on: torch, CUDA, NCCL, the device, its memory, the packages."""

from __future__ import annotations

import importlib.metadata
import platform
import subprocess
from typing import Any

import torch

PINNED_TORCH = "2.13"  # pyproject's torch>=2.13,<2.14
PACKAGES = ["lightning", "torchmetrics", "hydra-core", "omegaconf", "transformers", "triton", "pytest"]


def run(config: dict[str, Any]) -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_matches_pin": torch.__version__.startswith(PINNED_TORCH),
        "cuda_runtime": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "packages": {name: _version(name) for name in PACKAGES},
    }
    try:
        import lightning_parallel  # noqa: F401  (its private torch APIs resolve on this torch, or the error says which)

        info["lightning_parallel_import"] = "ok"
    except Exception as err:  # noqa: BLE001  (reported, the check goes on)
        info["lightning_parallel_import"] = f"{type(err).__name__}: {err}"
    if torch.cuda.is_available():
        info |= _device()
    info["nvidia_smi"] = _nvidia_smi()
    return info


def _device() -> dict[str, Any]:
    props = torch.cuda.get_device_properties(0)
    free, total = torch.cuda.mem_get_info(0)
    nccl = torch.cuda.nccl.version() if hasattr(torch.cuda, "nccl") else None
    return {
        "device_count": torch.cuda.device_count(),
        "device_name": torch.cuda.get_device_name(0),
        "capability": f"{props.major}.{props.minor}",
        "multiprocessors": props.multi_processor_count,
        "memory_total_bytes": total,
        "memory_free_bytes": free,
        "bf16_supported": torch.cuda.is_bf16_supported(),
        "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl,
        "cudnn": torch.backends.cudnn.version(),
        "flash_sdp_enabled": torch.backends.cuda.flash_sdp_enabled(),
    }


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _nvidia_smi() -> str | None:
    try:
        done = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=15)
        return done.stdout.strip() or done.stderr.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
