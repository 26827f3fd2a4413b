"""Loading the Triton kernels lazily, and where they can run."""

from __future__ import annotations

from types import ModuleType

import torch

from ...errors import ConfigurationError, MissingDependencyError

KERNELS_EXTRA = "pip install 'selfspec[kernels]'"


_LOADED: ModuleType | None = None


def triton_code() -> ModuleType:
    """The module of Triton kernels, imported on first use (``TRITON_INTERPRET`` is read then).

    Kept in a module global rather than behind ``functools.cache``: once loaded (the engine loads it
    when it turns the kernels on), ``torch.compile`` traces this as a plain global read.

    Raises:
        MissingDependencyError: triton is not installed.
        ConfigurationError: ``TRITON_INTERPRET=1`` was set after triton itself was imported.
    """
    global _LOADED
    if _LOADED is None:
        try:
            from . import triton_code as code
        except ImportError as error:
            raise MissingDependencyError(f"the row-invariant kernels need triton: {KERNELS_EXTRA} ({error})") from error
        import triton.language as tl

        if type(code.linear_kernel).__name__ != type(tl.zeros).__name__:
            # Triton's own library was built before TRITON_INTERPRET=1 was set: interpreted kernels would
            # fail inside it with "Cannot call @triton.jit'd outside of the scope of a kernel"
            raise ConfigurationError(
                "TRITON_INTERPRET=1 was set after triton was imported (torch.compile and torch._dynamo import it): "
                "set it in the environment before Python starts, or before importing torch"
            )
        _LOADED = code
    return _LOADED


def interpreted() -> bool:
    """Whether the kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` when they were first loaded)."""
    return type(triton_code().linear_kernel).__name__ == "InterpretedFunction"


def check_device(*tensors: torch.Tensor) -> bool:
    """Check that the kernels can run on the tensors' device; returns whether to upcast tiles to float32.

    Compiled kernels need CUDA tensors. The interpreter runs on CPU tensors and always multiplies
    float32 tiles (its ``tl.dot`` is wrong on bfloat16 operands).

    Raises:
        ConfigurationError: a tensor is on another device than the first, or compiled kernels got
            CPU tensors.
    """
    device = tensors[0].device
    if any(tensor.device != device for tensor in tensors):
        raise ConfigurationError(f"the kernel's tensors are on several devices: {[t.device for t in tensors]}")
    if interpreted():
        return True
    if device.type != "cuda":
        raise ConfigurationError(
            f"the row-invariant Triton kernels run on CUDA tensors (got {device}); on a CPU set "
            "TRITON_INTERPRET=1 before they are first used to run them in Triton's interpreter"
        )
    return False


def store_dtype(dtype: torch.dtype, upcast: bool) -> torch.dtype:
    """The dtype a kernel stores its result in: float32 in the interpreter, else ``dtype``.

    Triton 3.9's interpreter rounds float32 to bfloat16 by truncation (its ``cast_impl`` ignores the
    round-to-nearest-even mode a GPU applies), so there the kernels store float32 and torch rounds
    to nearest even afterwards, which is what the compiled kernel's store does on a GPU.
    """
    return torch.float32 if upcast else dtype
