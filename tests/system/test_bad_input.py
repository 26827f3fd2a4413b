"""Bad input gets a clear error naming the fix, and the engine stays usable afterwards."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch
import transformers
from tiny_models import make_model, reference_greedy

from selfspec import (
    ConfigurationError,
    InvalidPromptError,
    ModelNotFoundError,
    SamplingError,
    SpeculativeEngine,
    UnsafeCheckpointError,
    UnsupportedArchitectureError,
)

PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def model():
    return make_model("llama")


@pytest.fixture(scope="module")
def engine(model):
    return SpeculativeEngine(model, exit_layer=2, num_draft_tokens=3, drafter="early_exit")


@pytest.fixture(scope="module")
def expected(model):
    return reference_greedy(model, PROMPT, 12)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"max_new_tokens": 0}, SamplingError, "max_new_tokens must be an int >= 1"),
        ({"max_new_tokens": -5}, SamplingError, "max_new_tokens"),
        ({"max_new_tokens": 2.5}, SamplingError, "max_new_tokens"),
        ({"temperature": -0.1}, SamplingError, "temperature must be >= 0"),
        ({"temperature": float("nan")}, SamplingError, "temperature"),
        ({"top_p": 0.0}, SamplingError, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, SamplingError, "top_p"),
        ({"top_k": -1}, SamplingError, "top_k must be an integer >= 0"),
        ({"stop": [""], "max_new_tokens": 4}, SamplingError, "must not be empty"),
        ({"seed": "abc", "max_new_tokens": 4}, SamplingError, "seed"),
        ({"max_new_tokens": 400}, InvalidPromptError, "exceeds the context window of 256"),
        # issue 18: bool is not a number, numbers are finite, ints are integral, seeds fit 64 bits
        ({"max_new_tokens": True}, SamplingError, "max_new_tokens must be an int >= 1, got bool"),
        ({"temperature": True}, SamplingError, "temperature must be >= 0 and finite"),
        ({"temperature": float("inf")}, SamplingError, "temperature must be >= 0 and finite"),
        ({"temperature": "0.5"}, SamplingError, "temperature"),
        ({"top_k": True, "temperature": 1.0}, SamplingError, "top_k must be an integer >= 0 .*got bool"),
        ({"top_k": 2.0, "temperature": 1.0}, SamplingError, "top_k must be an integer"),
        ({"top_p": True, "temperature": 1.0}, SamplingError, "top_p"),
        ({"top_p": float("nan"), "temperature": 1.0}, SamplingError, "top_p"),
        ({"stop": 5}, SamplingError, "stop must be a str or a list of non-empty str, got int"),
        ({"stop": [1]}, SamplingError, "stop strings must be str"),
        ({"stop": b"x"}, SamplingError, "stop must be a str"),
        ({"stop": "a\ud800"}, SamplingError, "lone surrogate"),
        (
            {"seed": 2**70, "temperature": 1.0, "max_new_tokens": 4},
            SamplingError,
            r"seed must be None or an int in \[0, 2\*\*64 - 1\]",
        ),
        ({"seed": -1, "temperature": 1.0, "max_new_tokens": 4}, SamplingError, "seed"),
        ({"seed": True, "temperature": 1.0, "max_new_tokens": 4}, SamplingError, "seed"),
        ({"seed": 1.0, "temperature": 1.0, "max_new_tokens": 4}, SamplingError, "seed"),
    ],
)
def test_bad_generation_arguments(engine, expected, kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        engine.generate_ids(PROMPT, **kwargs)
    assert issubclass(error, ValueError)
    # the engine answers the next call correctly
    assert engine.generate_ids(PROMPT, max_new_tokens=12).token_ids == expected


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_new_tokens": np.int64(12)},
        {"max_new_tokens": torch.tensor(12)},
        {"max_new_tokens": 12, "seed": 2**64 - 1},
        {"max_new_tokens": 12, "seed": np.uint64(7)},
        {"max_new_tokens": 12, "temperature": np.float32(0.0), "top_k": np.int32(3)},
        {"max_new_tokens": 12, "temperature": 0, "top_p": np.float64(0.5)},
    ],
    ids=str,
)
def test_numpy_and_torch_numbers_are_numbers(engine, expected, kwargs) -> None:
    assert engine.generate_ids(PROMPT, **kwargs).token_ids == expected


@pytest.mark.parametrize(
    "prompt",
    [
        np.array(PROMPT),
        np.array([PROMPT], dtype=np.int32),
        torch.tensor(PROMPT, dtype=torch.int32),
        [np.int64(t) for t in PROMPT],
        [torch.tensor(t) for t in PROMPT],
        tuple(PROMPT),
    ],
    ids=["numpy-1d", "numpy-[1,n]-int32", "torch-int32", "numpy-ints", "0-d-tensors", "tuple"],
)
def test_numpy_and_torch_integer_ids_are_accepted(engine, expected, prompt) -> None:
    assert engine.generate_ids(prompt, max_new_tokens=12).token_ids == expected


@pytest.mark.parametrize(
    ("prompt", "match"),
    [
        ([5.0, 6.0, 7.0], "token ids must be ints, got float 5.0 at position 0"),
        ([5, 6, True], "token ids must be ints, got bool"),
        (torch.tensor([5.0, 6.0]), "prompt_ids must hold integers, got dtype torch.float32"),
        (np.array([5.5, 6.0]), "prompt_ids must hold integers, got dtype float64"),
        (torch.tensor([True, False]), "prompt_ids must hold integers"),
        ("hello", "prompt_ids must be token ids"),
        (b"hello", "prompt_ids must be token ids"),
        ([5, "6"], "token ids must be ints, got str"),
        (torch.zeros(2, 3, dtype=torch.long), "1-D"),
        (12, "prompt_ids must be a list of ints"),
    ],
    ids=str,
)
def test_bad_prompt_ids(engine, expected, prompt, match) -> None:
    with pytest.raises(InvalidPromptError, match=match):
        engine.generate_ids(prompt, max_new_tokens=12)
    assert engine.generate_ids(PROMPT, max_new_tokens=12).token_ids == expected


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tree_nodes": 10**8}, r"tree_nodes must be None, 'auto' or an int >= 1 and <= 1024"),
        ({"tree_nodes": True}, "tree_nodes"),
        ({"tree_nodes": 2.0}, "tree_nodes"),
        ({"num_draft_tokens": 10**6}, "num_draft_tokens must be 'auto' or an int >= 1 and <= 128"),
        ({"num_draft_tokens": np.int64(0)}, "num_draft_tokens"),
    ],
    ids=str,
)
def test_size_options_have_upper_bounds(model, expected, kwargs, match) -> None:
    started = time.perf_counter()
    with pytest.raises(ConfigurationError, match=match):
        SpeculativeEngine(model, exit_layer=2, **kwargs)
    assert time.perf_counter() - started < 5  # refused at construction, nothing allocated
    assert SpeculativeEngine(model, exit_layer=2, num_draft_tokens=3, drafter="early_exit").generate_ids(
        PROMPT, max_new_tokens=12
    ).token_ids == (expected)


@pytest.fixture(scope="module")
def text_engine():
    from tiny_tokenizer import make_tokenizer

    tokenizer = make_tokenizer()
    return SpeculativeEngine(make_model("llama", vocab_size=len(tokenizer)), tokenizer, drafter="early_exit")


@pytest.mark.parametrize(
    ("prompt", "match"),
    [
        (b"Hello", r"the prompt is bytes; decode to str first"),
        (bytearray(b"Hello"), "decode to str first"),
        ([b"Hello"], "chat message 0 is bytes.*decode to str first"),
        ([{"role": "user", "content": b"Hello"}], "content of chat message 0 is bytes; decode to str first"),
        ("a\ud800", "lone surrogate"),
        ([{"role": "user", "content": "a\udfff"}], "content of chat message 0 contains a lone surrogate"),
        (["Hello"], "each chat message must be a dict"),
        ([{"content": "no role"}], "role"),
        ("", "empty"),
        ([], "non-empty"),
    ],
    ids=str,
)
def test_bad_text_prompts(text_engine, prompt, match) -> None:
    expected = text_engine.generate("Hello", max_new_tokens=6).text
    with pytest.raises(InvalidPromptError, match=match):
        text_engine.generate(prompt, max_new_tokens=6)
    with pytest.raises(InvalidPromptError, match=match):
        text_engine.stream(prompt, max_new_tokens=6)
    assert text_engine.generate("Hello", max_new_tokens=6).text == expected


@pytest.mark.parametrize("prompt", [[], torch.tensor([], dtype=torch.long)])
def test_empty_prompt_ids(engine, expected, prompt) -> None:
    with pytest.raises(InvalidPromptError, match="empty"):
        engine.generate_ids(prompt)
    assert engine.generate_ids(PROMPT, max_new_tokens=12).token_ids == expected


def test_out_of_vocabulary_prompt(engine, expected) -> None:
    with pytest.raises(InvalidPromptError, match="not in the vocabulary"):
        engine.generate_ids([5, 10_000])
    assert engine.generate_ids(PROMPT, max_new_tokens=12).token_ids == expected


def test_prompt_alone_over_context_window(engine) -> None:
    with pytest.raises(InvalidPromptError, match="context window"):
        engine.generate_ids([5] * 300, max_new_tokens=1)


def test_truncate_prompt_keeps_the_end(model, engine) -> None:
    long_prompt = [(7 * i) % 90 + 3 for i in range(300)]
    with pytest.raises(InvalidPromptError, match="truncate_prompt=True"):
        engine.generate_ids(long_prompt, max_new_tokens=16)
    out = engine.generate_ids(long_prompt, max_new_tokens=16, truncate_prompt=True)
    assert out.prompt_tokens == 256 - 16
    assert out.token_ids == reference_greedy(model, long_prompt[-(256 - 16) :], 16)
    # nothing to keep: max_new_tokens alone fills the window
    with pytest.raises(InvalidPromptError, match="context window"):
        engine.generate_ids(long_prompt, max_new_tokens=256, truncate_prompt=True)


def test_text_prompt_without_tokenizer(engine) -> None:
    with pytest.raises(ConfigurationError, match="tokenizer"):
        engine.generate("hello")


@pytest.mark.parametrize("exit_layer", [0, 6, 7, -1])
def test_exit_layer_out_of_range(model, exit_layer) -> None:
    with pytest.raises(ConfigurationError, match=r"exit_layer must be in \[1, 5\]"):
        SpeculativeEngine(model, exit_layer=exit_layer, drafter="early_exit")


@pytest.mark.parametrize("exit_layer", ["two", 2.0, True, None])
def test_exit_layer_wrong_type(model, exit_layer) -> None:
    with pytest.raises(ConfigurationError, match="exit_layer must be 'auto' or an int"):
        SpeculativeEngine(model, exit_layer=exit_layer, drafter="early_exit")


@pytest.mark.parametrize("num_draft_tokens", [0, -2, "many", 1.5, False])
def test_bad_draft_length(model, num_draft_tokens) -> None:
    with pytest.raises(ConfigurationError, match="num_draft_tokens must be 'auto' or an int >= 1"):
        SpeculativeEngine(model, num_draft_tokens=num_draft_tokens, drafter="early_exit")


def test_unknown_drafter(model) -> None:
    with pytest.raises(ConfigurationError, match="unknown drafter 'magic'"):
        SpeculativeEngine(model, drafter="magic")


def test_auto_resolves_to_ints_at_construction(model) -> None:
    engine = SpeculativeEngine(model, drafter="early_exit")
    assert engine.exit_layer == 6 // 4 and engine.num_draft_tokens == 4
    assert "exit_layer=1" in repr(engine)


def test_unsupported_architecture_model_object() -> None:
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64)
    model = transformers.GPT2LMHeadModel(config)
    with pytest.raises(UnsupportedArchitectureError, match=r"'gpt2' is not supported.*llama"):
        SpeculativeEngine(model, drafter="early_exit")


def test_unsupported_architecture_folder(tmp_path) -> None:
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedArchitectureError, match="supported architectures"):
        SpeculativeEngine.from_pretrained(tmp_path)


def test_missing_folder(tmp_path) -> None:
    with pytest.raises(OSError, match="no model folder"):
        SpeculativeEngine.from_pretrained(tmp_path / "nope")
    with pytest.raises(ModelNotFoundError):
        SpeculativeEngine.from_pretrained("./not-here")


def test_unknown_hub_id_offline() -> None:
    with pytest.raises(OSError, match="HF_HUB_OFFLINE"):
        SpeculativeEngine.from_pretrained("selfspec-test/no-such-model-anywhere")


def test_folder_without_weights(tmp_path) -> None:
    make_model("llama").config.save_pretrained(tmp_path)
    with pytest.raises(ModelNotFoundError, match="no weights"):
        SpeculativeEngine.from_pretrained(tmp_path)


def test_pickle_only_checkpoint_is_refused(tmp_path) -> None:
    model = make_model("llama", dtype=torch.float32)
    model.config.save_pretrained(tmp_path)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(UnsafeCheckpointError, match="allow_pickle=True"):
        SpeculativeEngine.from_pretrained(tmp_path)


def test_remote_code_is_refused(tmp_path) -> None:
    config = make_model("llama").config.to_dict()
    config.update({"model_type": "my_custom_lm", "auto_map": {"AutoConfig": "custom.MyConfig"}})
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsafeCheckpointError, match="trust_remote_code=True"):
        SpeculativeEngine.from_pretrained(tmp_path)


def test_bad_device_and_dtype(tmp_path) -> None:
    make_model("llama", dtype=torch.float32).save_pretrained(tmp_path)
    with pytest.raises(ConfigurationError, match="unknown dtype"):
        SpeculativeEngine.from_pretrained(tmp_path, dtype="float7")
    with pytest.raises(ConfigurationError, match="unknown device"):
        SpeculativeEngine.from_pretrained(tmp_path, device="warp-drive")


def test_flash_attention_models_get_a_hint() -> None:
    model = make_model("llama")
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ConfigurationError, match="attn_implementation='sdpa'"):
        SpeculativeEngine(model, drafter="early_exit")


@pytest.mark.parametrize("fault", [RuntimeError("simulated kernel failure"), KeyboardInterrupt()])
def test_fault_inside_a_forward_leaves_the_engine_usable(model, expected, fault) -> None:
    engine = SpeculativeEngine(model, exit_layer=2, num_draft_tokens=3, drafter="early_exit")
    original = engine.runner.run_layers
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:  # fail in the middle of decoding, after the prefill
            raise fault
        return original(*args, **kwargs)

    engine.runner.run_layers = flaky  # type: ignore[method-assign]
    try:
        with pytest.raises(type(fault)):
            engine.generate_ids(PROMPT, max_new_tokens=12)
    finally:
        del engine.runner.run_layers
    assert engine.generate_ids(PROMPT, max_new_tokens=12).token_ids == expected
    assert engine._lock.acquire(blocking=False)  # the lock was released
    engine._lock.release()


def test_empty_message_list_and_bad_messages() -> None:
    from tiny_tokenizer import make_tokenizer

    tokenizer = make_tokenizer()
    engine = SpeculativeEngine(make_model("llama", vocab_size=len(tokenizer)), tokenizer, drafter="early_exit")
    with pytest.raises(InvalidPromptError, match="non-empty"):
        engine.generate([])
    with pytest.raises(InvalidPromptError, match="role"):
        engine.generate([{"content": "no role"}])
    with pytest.raises(InvalidPromptError, match="empty"):
        engine.generate("")


OOM_SCRIPT = """
import resource, sys
sys.path.insert(0, {tests!r})
import torch
from tiny_models import make_model, reference_greedy
from selfspec import GenerationMemoryError, SpeculativeEngine

model = make_model("llama", max_position_embeddings=2**22)
engine = SpeculativeEngine(model, drafter="early_exit", exit_layer=2, num_draft_tokens=3)
expected = reference_greedy(model, [5, 6, 7, 8, 9], 12)

def vm_size():
    for line in open("/proc/self/status"):
        if line.startswith("VmSize"):
            return int(line.split()[1]) * 1024

# a tiny memory limit: 256 MiB above what the process maps now
resource.setrlimit(resource.RLIMIT_AS, (vm_size() + 2**28, resource.RLIM_INFINITY))
try:
    engine.generate_ids([5, 6, 7, 8, 9], max_new_tokens=2**22 - 16)  # a cache of ~3 GiB
except GenerationMemoryError as error:
    print("REPORTED:", error)
assert engine.generate_ids([5, 6, 7, 8, 9], max_new_tokens=12).token_ids == expected
print("USABLE")
"""


def test_out_of_memory_is_reported_and_the_engine_stays_usable(tmp_path) -> None:
    """A real allocation failure under a tiny address-space limit (its own process)."""
    import os
    import subprocess
    import sys

    script = tmp_path / "oom.py"
    script.write_text(OOM_SCRIPT.format(tests=os.path.dirname(os.path.dirname(__file__))))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "REPORTED: out of memory after 0 new tokens" in result.stdout
    assert "max_new_tokens 4194288" in result.stdout and "quantization" in result.stdout
    assert "USABLE" in result.stdout


@pytest.mark.parametrize(
    ("config_text", "error", "match"),
    [
        ('{"model_type": "llama", ', ConfigurationError, r"config.json is not valid JSON"),
        ("[1, 2]", ConfigurationError, "must hold a JSON object"),
        (
            '{"model_type": "wizardlm9000", "hidden_size": 8}',
            UnsupportedArchitectureError,
            "'wizardlm9000' is not supported.*llama",
        ),
        ('{"hidden_size": 8}', UnsupportedArchitectureError, "model_type None is not supported"),
    ],
    ids=["malformed", "not-an-object", "unknown-model_type", "no-model_type"],
)
def test_honest_config_errors(tmp_path, model, expected, config_text, error, match) -> None:
    (tmp_path / "config.json").write_text(config_text)
    with pytest.raises(error, match=match) as raised:
        SpeculativeEngine.from_pretrained(tmp_path)
    assert "not a local folder" not in str(raised.value)
    assert SpeculativeEngine(model, exit_layer=2, num_draft_tokens=3, drafter="early_exit").generate_ids(
        PROMPT, max_new_tokens=12
    ).token_ids == (expected)


def test_pt_only_checkpoint_is_named_as_such(tmp_path) -> None:
    model = make_model("llama", dtype=torch.float32)
    model.config.save_pretrained(tmp_path)
    torch.save(model.state_dict(), tmp_path / "model.pt")
    with pytest.raises(UnsafeCheckpointError, match=r"only pickle weights \(model.pt\)") as raised:
        SpeculativeEngine.from_pretrained(tmp_path)
    assert "*.bin" not in str(raised.value)
