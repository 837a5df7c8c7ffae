"""One object per device (``Platform``): what differs between CPU and CUDA lives here and nowhere else.

``platform_for(device)`` answers for a given device, ``current_platform()`` for the one ``--device auto``
picks. Platforms are made once per device and shared (they hold no per-engine state), so asking is cheap
enough for per-step callers such as the sampler.
"""

from __future__ import annotations

from functools import cache

import torch

from tideserve.platform.cpu import CpuPlatform
from tideserve.platform.cuda import CudaPlatform
from tideserve.platform.interface import Platform

__all__ = ["CpuPlatform", "CudaPlatform", "Platform", "current_platform", "platform_for", "resolve_device"]

_PLATFORMS: dict[str, type[Platform]] = {"cpu": CpuPlatform, "cuda": CudaPlatform}
_DEVICE_ERROR = "device must be auto, cpu or cuda[:N], got {!r}."


def resolve_device(name: str | torch.device) -> torch.device:
    """``--device``: "auto" is the GPU when torch sees one, else the CPU; a ValueError names the value."""
    if isinstance(name, torch.device):
        device = name
    elif name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        try:
            device = torch.device(name)
        except RuntimeError as exc:
            raise ValueError(_DEVICE_ERROR.format(name)) from exc
    if device.type not in _PLATFORMS:
        raise ValueError(_DEVICE_ERROR.format(str(name)))
    return device


@cache
def _platform(device: torch.device) -> Platform:
    return _PLATFORMS[device.type](device)


def platform_for(device: torch.device | str) -> Platform:
    """The platform of ``device`` (a torch.device or its name, "cpu", "cuda:1"); ValueError for others."""
    if not isinstance(device, torch.device):
        device = torch.device(device)
    if device.type not in _PLATFORMS:
        raise ValueError(_DEVICE_ERROR.format(str(device)))
    return _platform(device)


def current_platform() -> Platform:
    """The platform ``--device auto`` runs on."""
    return platform_for(resolve_device("auto"))
