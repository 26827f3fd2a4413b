"""``row_exact=``: what it means on each device and dtype (no model, no kernel launch)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from selfspec.decoding.options import EngineOptions, parse_row_exact
from selfspec.errors import ConfigurationError
from selfspec.modeling.kernels import BATCHED, KERNELS, ROWS, kernels_refusal, resolve_row_exact

CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # a device object: no GPU needed
HALF = [torch.bfloat16, torch.float16]
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


@pytest.mark.parametrize("dtype", HALF)
def test_auto_is_the_row_by_row_verify_on_a_cpu_in_half_precision(dtype: torch.dtype) -> None:
    assert resolve_row_exact("auto", CPU, dtype).mode == ROWS
    assert resolve_row_exact(True, CPU, dtype).mode == ROWS
    assert resolve_row_exact(False, CPU, dtype).mode == BATCHED


def test_float32_needs_nothing_unless_asked() -> None:
    assert resolve_row_exact("auto", CPU, torch.float32).mode == BATCHED
    assert resolve_row_exact(True, CPU, torch.float32).mode == ROWS
    assert resolve_row_exact("auto", CUDA, torch.float32).mode == BATCHED


@needs_triton
@pytest.mark.parametrize("dtype", HALF)
def test_auto_is_the_kernels_on_cuda_in_half_precision(dtype: torch.dtype) -> None:
    assert kernels_refusal(CUDA, dtype) is None
    assert resolve_row_exact("auto", CUDA, dtype).kernels
    assert resolve_row_exact(True, CUDA, torch.float32).mode == KERNELS
    assert resolve_row_exact(False, CUDA, dtype).mode == BATCHED


@needs_triton
def test_what_the_kernels_do_not_cover_falls_back_under_auto_and_is_refused_when_asked() -> None:
    fallback = resolve_row_exact("auto", CUDA, torch.bfloat16, unsupported="single calls (batching=False)")
    assert fallback.mode == ROWS and "batching=False" in fallback.reason
    with pytest.raises(ConfigurationError, match="row_exact=True: the kernels need single calls"):
        resolve_row_exact(True, CUDA, torch.bfloat16, unsupported="single calls (batching=False)")
    assert "CUDA" in str(kernels_refusal(CPU, torch.bfloat16))


def test_a_marked_model_runs_the_kernels_on_any_device_unless_turned_off() -> None:
    assert resolve_row_exact("auto", CPU, torch.float32, marked=True).kernels
    assert resolve_row_exact(True, CPU, torch.bfloat16, marked=True).kernels
    with pytest.raises(ConfigurationError, match="use_row_invariant_kernels"):
        resolve_row_exact(False, CPU, torch.bfloat16, marked=True)
    with pytest.raises(ConfigurationError, match="need chain drafts"):
        resolve_row_exact("auto", CPU, torch.bfloat16, marked=True, unsupported="chain drafts (no token trees)")


def test_the_option_reads_auto_on_off_and_refuses_anything_else() -> None:
    assert [parse_row_exact(v) for v in ("auto", "on", "OFF", "true", "0")] == ["auto", True, False, True, False]
    with pytest.raises(ValueError, match="auto, on or off"):
        parse_row_exact("sometimes")
    assert EngineOptions().row_exact == "auto"
    for bad in ("yes", 1, None):
        with pytest.raises(ConfigurationError, match="row_exact must be"):
            EngineOptions(row_exact=bad)
