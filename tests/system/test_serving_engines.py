"""One shared engine per distinct set of engine arguments (what both adapters rely on)."""

from __future__ import annotations

import pytest

from selfspec import clear_engines, get_engine


def test_equivalent_arguments_share_one_engine() -> None:
    clear_engines()
    first = get_engine("selfspec-demo")
    assert get_engine(
        "selfspec-demo", exit_layer="auto", draft_model=None, quantization=None, drafter="auto"
    ) is first
    assert get_engine("selfspec-demo", drafter="none") is not first


def test_unknown_engine_argument_is_a_clear_error() -> None:
    with pytest.raises(TypeError, match="exit_layr"):
        get_engine("selfspec-demo", exit_layr=2)
