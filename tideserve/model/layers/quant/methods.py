"""Which ``--quantization`` methods are applied while the checkpoint loads, and why a method cannot run on
a device: the loader and the engine check before they build anything, so the error names the fix."""

from __future__ import annotations

import torch

from tideserve.native import quant
from tideserve.platform import platform_for

# methods applied while the checkpoint loads (model/loader), the rest to a loaded float model
LOAD_TIME_METHODS = ("gguf", "int4")


def unavailable_reason(method: str, device: torch.device) -> str | None:
    """Why ``method`` cannot run here, or None when it can."""
    if method == "int8":
        return int8_unavailable_reason(device)
    if method in ("int4", "gguf"):
        platform = platform_for(device)
        if not platform.computes_on_host:
            return f"--quantization {method} uses tideserve's CPU kernels and does not run on {platform.device_name}"
        if not quant.available():
            return (f"--quantization {method} needs tideserve's native kernels, which need a C compiler (cc or "
                    "$CC) and TIDESERVE_NATIVE unset or 1")
    return None


def int8_unavailable_reason(device: torch.device) -> str | None:
    """Why int8 cannot run here, or None when it can."""
    platform = platform_for(device)
    if not platform.computes_on_host:
        return f"--quantization int8 uses fbgemm's CPU kernels and does not run on {platform.device_name}"
    engines = torch.backends.quantized.supported_engines
    if "fbgemm" not in engines and "x86" not in engines:
        return f"--quantization int8 needs torch's fbgemm/x86 quantized engine; this build has {engines}"
    return None
