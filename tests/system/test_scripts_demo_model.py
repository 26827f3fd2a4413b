"""Tests of the demo-model training script (a few tiny steps on a small Austen excerpt)."""

from __future__ import annotations

import itertools
import json
import math
import os
import random
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from demo_model import demo
from demo_model.corpus import WindowPacker, split_corpus, split_sentences
from demo_model.tokenizer import SPECIAL_TOKENS, TOOL_TOKENS
from demo_model.tool_chats import chat_stream, drill_stream
from demo_model.trainer import choose_exit, expected_speedup
from transformers import AutoModelForCausalLM, AutoTokenizer

EXCERPT = Path(__file__).parents[1] / "data" / "austen_excerpt.txt"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather for a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "The city name."}},
                "required": ["city"],
            },
        },
    }
]
TOOL_CHAT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the weather in Zürich?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}],
    },
    {"role": "tool", "content": "18°C and sunny"},
    {"role": "assistant", "content": "It is 18°C and sunny in Zürich."},
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Run the training script for a few tiny steps and return its output folder."""
    out = tmp_path_factory.mktemp("demo")
    threads = torch.get_num_threads()
    argv = [
        "--data",
        str(EXCERPT),
        "--out",
        str(out),
        "--steps",
        "6",
        "--seq-len",
        "64",
        "--batch-size",
        "2",
        "--vocab-size",
        "512",
        "--lr",
        "3e-3",
        "--warmup-steps",
        "1",
        "--threads",
        "1",
        "--copy-phase",
        "0.3",
        "--log-every",
        "1",
    ]
    try:
        assert demo.main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    return out


def test_output_files(trained: Path) -> None:
    names = {p.name for p in trained.iterdir()}
    for name in (
        "model.safetensors",
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "training_args.json",
        "eval.json",
        "selfspec.json",
    ):
        assert name in names
    assert not any(n.endswith((".bin", ".pt", ".pth")) for n in names)
    config = json.loads((trained / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "float16"
    assert config["num_hidden_layers"] == 16 and config["hidden_size"] == 192
    spec = json.loads((trained / "selfspec.json").read_text())
    assert spec["source"] == "train-demo"
    assert 1 <= spec["exit_layer"] <= 8 and 1 <= spec["num_draft_tokens"] <= 8
    assert sorted(spec["agreement"], key=int) == [str(e) for e in range(1, 16)]
    tokenizer_config = json.loads((trained / "tokenizer_config.json").read_text())
    assert "chat_template" in tokenizer_config
    assert tokenizer_config["tokenizer_class"] == "PreTrainedTokenizerFast"


def test_loss_finite_and_decreasing(trained: Path) -> None:
    report = json.loads((trained / "eval.json").read_text())
    first, last = report["train_loss_first"], report["train_loss_last"]
    assert math.isfinite(first) and math.isfinite(last)
    assert last < first
    assert math.isfinite(report["heldout_austen"]["loss"]["final"])
    assert 0.0 <= report["copy_accuracy"] <= 1.0
    stats = json.loads((trained / "training_args.json").read_text())["data_stats"]
    assert stats["drill_docs"] > 0 and 0.0 < stats["prose_share_trained"] < 1.0


def test_model_loads_and_generates(trained: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(trained, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(trained)
    assert model.config.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    assert model.generation_config.eos_token_id == [
        tok.convert_tokens_to_ids("<|im_end|>"),
        tok.convert_tokens_to_ids("<|endoftext|>"),
    ]
    ids = tok("It is a truth", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert out.shape[1] > ids.shape[1]


def test_tokenizer_tokens_and_round_trip(trained: Path) -> None:
    tok = AutoTokenizer.from_pretrained(trained)
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS + TOOL_TOKENS}
    assert len(set(ids.values())) == len(ids) and tok.unk_token_id not in ids.values()
    assert tok.pad_token == "<|endoftext|>" and tok.eos_token == "<|im_end|>"
    assert not set(TOOL_TOKENS) & set(tok.all_special_tokens)
    text = 'Héllo café Zürich über 日本 東京 🎉 naïve —\n\n  spaced <tool_call>{"x": 12.5}</tool_call>'
    encoded = tok(text).input_ids
    assert tok.decode(encoded) == text
    assert ids["<tool_call>"] in encoded
    assert tok("Hello").input_ids[0] != tok.bos_token_id
    wrapped = tok("<|im_start|>user\nhi<|im_end|><tool_response>5</tool_response>").input_ids
    assert tok.decode(wrapped, skip_special_tokens=True) == "user\nhi<tool_response>5</tool_response>"


def test_chat_template_renders_tools(trained: Path) -> None:
    tok = AutoTokenizer.from_pretrained(trained)
    text = tok.apply_chat_template(TOOL_CHAT, tools=TOOLS, tokenize=False)
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.\n\nYou can call these tools:\n")
    assert '{"name": "get_weather", "description": "Get the current weather for a city.", "parameters": ' in text
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Zürich"}}</tool_call><|im_end|>' in text
    assert "<|im_start|>tool\n<tool_response>18°C and sunny</tool_response><|im_end|>\n" in text
    prompt = tok.apply_chat_template(TOOL_CHAT[:2], tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>user\nWhat is the weather in Zürich?<|im_end|>\n<|im_start|>assistant\n")
    flat = [{"role": "assistant", "content": "Sure.", "tool_calls": [{"name": "f", "arguments": {}}]}]
    assert tok.apply_chat_template(flat, tokenize=False) == (
        '<|im_start|>assistant\nSure.\n<tool_call>{"name": "f", "arguments": {}}</tool_call><|im_end|>\n'
    )
    plain = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert plain == "<|im_start|>user\nhi<|im_end|>\n"


def test_choose_exit_maximises_speedup() -> None:
    agreement = {str(e): min(0.99, 0.5 + 0.04 * e) for e in range(1, 16)}
    e, k, best = choose_exit(agreement, 16)
    grid = [expected_speedup(agreement[str(x)], n, x, 16) for x in range(1, 9) for n in range(1, 9)]
    assert best == pytest.approx(max(grid))
    assert best == pytest.approx(expected_speedup(agreement[str(e)], k, e, 16))
    assert expected_speedup(0.0, 1, 1, 16) == pytest.approx(1 / (1 / 16 + 0.05 + 1))


def test_sentences_and_packing() -> None:
    para = 'Mr. Darcy bowed. "Indeed!" cried she. Was it Mrs. Bennet? Yes.'
    assert split_sentences(para) == ["Mr. Darcy bowed.", '"Indeed!" cried she.', "Was it Mrs. Bennet?", "Yes."]
    prose = list(range(100, 1100))
    docs = [[7] * random.Random(i).randrange(3, 20) for i in range(200)]
    packer = WindowPacker(prose, docs, 33, 0, prose_fraction=0.6)
    windows = list(packer.epoch(random.Random(0)))
    assert windows and all(len(w) == 33 for w in windows)
    prose_share = sum(t >= 100 for w in windows for t in w) / sum(map(len, windows))
    assert 0.5 < prose_share < 0.7


def test_synthetic_mix_is_seeded_and_copies_arguments() -> None:
    split = split_corpus(EXCERPT.read_text(encoding="utf-8"))
    first = [c.messages for c in itertools.islice(chat_stream(split.train_paragraphs, 3), 50)]
    again = [c.messages for c in itertools.islice(chat_stream(split.train_paragraphs, 3), 50)]
    assert first == again
    chats = list(itertools.islice(chat_stream(split.train_paragraphs, 0), 400))
    kinds = {c.kind for c in chats}
    assert {"tool_call", "tool_unneeded", "rag_span", "json", "rewrite"} <= kinds
    calls = [m for c in chats for m in c.messages if m.get("tool_calls")]
    assert any(not (tc.get("function", tc)["arguments"]) for m in calls for tc in m["tool_calls"])
    assert any(len(c.tools or []) > 1 for c in chats)
    drill = next(drill_stream(split.train_paragraphs, 0)).messages
    assert drill[0]["content"].endswith(drill[1]["content"])
