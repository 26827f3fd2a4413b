"""``selfspec.modeling.loading.resolve_dtype``: ``"auto"`` runs a checkpoint's half precision where it is native."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from selfspec.errors import ConfigurationError
from selfspec.modeling.loading import checkpoint_dtype, native_dtypes, resolve_dtype

CPU = torch.device("cpu")
AVX512_BF16 = frozenset({"avx512f", "avx512_bf16"})  # an AMD EPYC (Zen 4)
AMX = frozenset({"avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_fp16"})  # a Sapphire Rapids Xeon
OLD = frozenset({"avx2", "fma"})


def config(dtype: str | None) -> SimpleNamespace:
    return SimpleNamespace(dtype=dtype)


def test_native_half_precision_on_cpus_follows_their_flags() -> None:
    assert native_dtypes(CPU, AVX512_BF16) == {torch.bfloat16}
    assert native_dtypes(CPU, AMX) == {torch.bfloat16}  # float16 matmuls are no faster than float32 on CPUs
    assert native_dtypes(CPU, OLD) == frozenset()


@pytest.mark.parametrize(
    ("saved", "flags", "expected"),
    [
        ("bfloat16", AVX512_BF16, torch.bfloat16),
        ("bfloat16", AMX, torch.bfloat16),
        ("bfloat16", OLD, torch.float32),  # emulated bf16 is slow: float32
        ("float16", AVX512_BF16, torch.float32),  # no native float16 there
        ("float16", AMX, torch.float32),
        ("float32", AMX, torch.float32),  # a float32 checkpoint stays float32 on a CPU
        (None, AMX, torch.float32),
    ],
)
def test_auto_on_cpu_runs_the_checkpoint_precision_only_where_native(saved, flags, expected) -> None:
    assert resolve_dtype("auto", CPU, config(saved), flags=flags) == expected


def test_explicit_dtypes_are_taken_as_given() -> None:
    assert resolve_dtype("float32", CPU, config("bfloat16"), flags=AMX) == torch.float32
    assert resolve_dtype("bf16", CPU, config("float32"), flags=OLD) == torch.bfloat16
    assert resolve_dtype(torch.float64, CPU, config("bfloat16")) == torch.float64
    with pytest.raises(ConfigurationError, match="unknown dtype 'half-ish'"):
        resolve_dtype("half-ish", CPU, config(None))


def test_checkpoint_dtype_reads_both_config_spellings() -> None:
    assert checkpoint_dtype(SimpleNamespace(torch_dtype="torch.bfloat16")) == torch.bfloat16
    assert checkpoint_dtype(SimpleNamespace(dtype=torch.float16)) == torch.float16
    assert checkpoint_dtype(SimpleNamespace(dtype="complex128")) is None
    assert checkpoint_dtype(SimpleNamespace()) is None
