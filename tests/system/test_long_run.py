"""A short version of benchmarks/long_run.py: no memory growth over many generations."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from tiny_models import make_model
from tiny_tokenizer import make_tokenizer

from selfspec import SpeculativeEngine

spec = importlib.util.spec_from_file_location("long_run", Path(__file__).parents[2] / "benchmarks" / "long_run.py")
assert spec is not None and spec.loader is not None
long_run_module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(long_run_module)


def test_many_generations_do_not_grow_memory() -> None:
    tokenizer = make_tokenizer()
    model = make_model("llama", vocab_size=len(tokenizer), max_position_embeddings=512)
    engine = SpeculativeEngine(model, tokenizer, exit_layer=2, drafter="early_exit")
    prompts = ["It is a truth", [{"role": "user", "content": "Hello world!"}], "Café 東京"]
    long_run_module.long_run(engine, prompts, 20, 16)  # warm up allocator pools
    result = long_run_module.long_run(engine, prompts, 200, 16)
    assert result["memory_within_bound"], result
    assert result["streams_cancelled"] == 20 and result["calls_refused"] == 8, result
    # step time is a benchmark figure (benchmarks/long_run.py), not asserted in a test
