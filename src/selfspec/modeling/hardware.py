"""What the machine computes natively: the CPU's instruction-set flags and the half precisions a device runs fast.

Kept apart from :mod:`selfspec.modeling.loading` (which imports ``native_dtypes`` from here) so that the runner's
exact-argmax head can ask without importing the loader, which imports the runner.
"""

from __future__ import annotations

import torch

__all__ = ["NATIVE_CPU_FLAGS", "cpu_features", "native_dtypes"]


def cpu_features() -> frozenset[str]:
    """The CPU's instruction-set flags (``/proc/cpuinfo``; empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


#: CPU flags that compute a half precision natively (AMX tiles, or AVX-512 bf16 dot products).
#: float16 is left out on CPUs: torch's CPU float16 matmuls are not faster than float32's.
NATIVE_CPU_FLAGS: dict[torch.dtype, frozenset[str]] = {torch.bfloat16: frozenset({"amx_bf16", "avx512_bf16"})}


def native_dtypes(device: torch.device, flags: frozenset[str] | None = None) -> frozenset[torch.dtype]:
    """The half precisions ``device`` computes natively.

    CUDA: bfloat16 where supported, and float16. CPU: bfloat16 with AMX or AVX512-BF16
    (``flags``: the CPU's, read from ``/proc/cpuinfo`` by default), never float16.
    """
    if device.type == "cuda":
        bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        return frozenset({torch.float16, torch.bfloat16} if bf16 else {torch.float16})
    if device.type == "cpu":
        flags = cpu_features() if flags is None else flags
        return frozenset(dtype for dtype, needed in NATIVE_CPU_FLAGS.items() if flags & needed)
    return frozenset()
