"""``selfspec.core.bounds.json_size``: one walk counts objects and lists alike (no model)."""

from __future__ import annotations

import random
from typing import Any

from selfspec.core.bounds import JsonSize, json_size


def _reference(value: Any, depth: int = 1) -> JsonSize:
    """The documented count, recursively: keys and strings by length, one per other scalar and per item."""
    if isinstance(value, str):
        return JsonSize(len(value), 0, 0)
    if not isinstance(value, (dict, list, tuple)):
        return JsonSize(1, 0, 0)
    chars, items, deepest = len(value), len(value), depth
    children = value.values() if isinstance(value, dict) else value
    if isinstance(value, dict):
        chars = sum((len(key) if isinstance(key, str) else 0) + 1 for key in value)
    for child in children:
        if isinstance(child, (dict, list, tuple)):
            inner = _reference(child, depth + 1)
            chars, items, deepest = chars + inner.chars, items + inner.items, max(deepest, inner.depth)
        else:
            chars += _reference(child).chars
    return JsonSize(chars, items, deepest)


def _random_json(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.choice(["str", "num", "null", "list", "dict"] if depth < 4 else ["str", "num", "null"])
    if kind == "str":
        return "x" * rng.randrange(6)
    if kind == "num":
        return rng.choice([0, 1.5, True])
    if kind == "null":
        return None
    if kind == "list":
        return [_random_json(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {f"k{i}" * rng.randrange(1, 3): _random_json(rng, depth + 1) for i in range(rng.randrange(4))}


def test_json_size_counts_objects_and_lists_as_documented() -> None:
    rng = random.Random(0)
    for _ in range(300):
        value = {"root": _random_json(rng)}
        assert json_size(value) == _reference(value)
    assert json_size({"ab": ["cd", 1, None]}) == JsonSize(chars=3 + 3 + 2 + 1 + 1, items=4, depth=2)
    assert json_size("abc") == JsonSize(3, 0, 0) and json_size(7) == JsonSize(1, 0, 0)


def test_json_size_stops_early_past_a_limit() -> None:
    wide = {"k": [["x" * 10]] * 1000}  # the walk checks the limits after each container
    assert json_size(wide, max_chars=50).chars < json_size(wide).chars
