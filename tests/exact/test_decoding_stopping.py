"""Text output: streaming deltas, stop strings that span tokens, multi-byte characters,
cancellation, and concurrent callers."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import make_model
from tiny_tokenizer import make_tokenizer

from selfspec import SpeculativeEngine
from selfspec.decoding.stopping import IncrementalDetokenizer, StopStringMatcher


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="module")
def engine(tokenizer):
    model = make_model("llama", vocab_size=len(tokenizer), max_position_embeddings=512)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return SpeculativeEngine(model, tokenizer, exit_layer=2, num_draft_tokens=3, drafter="early_exit")


PROMPTS = ["It is a truth", "Café 東京 🙂", "The quick brown fox"]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_stream_joins_to_generate_text(engine, tokenizer, prompt) -> None:
    out = engine.generate(prompt, max_new_tokens=40)
    stream = engine.stream(prompt, max_new_tokens=40)
    deltas = list(stream)
    assert "".join(deltas) == out.text
    assert out.text == tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert stream.stats is not None and stream.output is not None
    assert stream.output.token_ids == out.token_ids
    assert stream.finish_reason == out.finish_reason


def test_stream_never_splits_a_multibyte_character(engine, tokenizer) -> None:
    """Sampled byte-level text over many seeds: no delta ends inside a character."""
    for seed in range(15):
        deltas = list(engine.stream("東京 🙂", max_new_tokens=30, temperature=1.5, seed=seed))
        for delta in deltas[:-1]:
            assert not delta.endswith("\ufffd") or "\ufffd" in tokenizer.decode(
                engine.generate("東京 🙂", max_new_tokens=30, temperature=1.5, seed=seed).token_ids
            )


def test_stop_string_spanning_tokens(engine, tokenizer) -> None:
    full = engine.generate("It is a truth", max_new_tokens=40)
    text = full.text
    assert len(text) > 12
    stop = text[5:12]  # a piece that spans several tokens
    ids = tokenizer(stop, add_special_tokens=False)["input_ids"]
    assert len(ids) > 1
    out = engine.generate("It is a truth", max_new_tokens=40, stop=[stop, "never-appears"])
    assert out.text == text[: text.find(stop)]
    assert out.finish_reason == "stop"
    streamed = "".join(engine.stream("It is a truth", max_new_tokens=40, stop=stop))
    assert streamed == out.text
    # token_ids end with the token that completed the stop string
    assert tokenizer.decode(out.token_ids).find(stop) >= 0
    assert tokenizer.decode(out.token_ids[:-1]).find(stop) < 0


def test_close_cancels_and_next_call_is_unaffected(engine) -> None:
    expected = engine.generate("The quick brown fox", max_new_tokens=30)
    stream = engine.stream("It is a truth", max_new_tokens=200)
    next(stream)
    stream.close()
    assert stream.finish_reason == "cancelled"
    assert stream.stats is not None and stream.stats.target_forwards < 200
    assert engine.generate("The quick brown fox", max_new_tokens=30).token_ids == expected.token_ids


def test_abandoned_stream_does_not_block_others(engine) -> None:
    expected = engine.generate("Café", max_new_tokens=20).token_ids
    stream = engine.stream("It is a truth", max_new_tokens=100)
    next(stream)  # left open, never closed
    result = {}
    worker = threading.Thread(target=lambda: result.update(ids=engine.generate("Café", max_new_tokens=20).token_ids))
    worker.start()
    worker.join(timeout=60)
    assert result.get("ids") == expected
    stream.close()


def test_threads_get_the_text_they_would_get_alone(engine) -> None:
    jobs = [(p, s) for p in PROMPTS for s in (None, 7)]
    alone = {
        (p, s): engine.generate(p, max_new_tokens=25, temperature=0.0 if s is None else 0.8, seed=s).token_ids
        for p, s in jobs
    }
    results: dict = {}

    def call(p, s):
        results[(p, s)] = engine.generate(p, max_new_tokens=25, temperature=0.0 if s is None else 0.8, seed=s).token_ids

    threads = [threading.Thread(target=call, args=job) for job in jobs * 2]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert results == alone


def test_chat_messages_use_the_template(engine, tokenizer) -> None:
    messages = [{"role": "user", "content": "Hello world!"}]
    ids = engine.encode_prompt(messages)
    text = tokenizer.decode(ids)
    assert text.startswith("<|im_start|>user\nHello world!<|im_end|>") and text.endswith("assistant\n")
    assert engine.generate(messages, max_new_tokens=5).token_ids == engine.generate_ids(ids, max_new_tokens=5).token_ids


def test_string_prompt_is_plain_tokenizer_call(engine, tokenizer) -> None:
    assert engine.encode_prompt("Hello world!") == tokenizer("Hello world!")["input_ids"]


# --------------------------------------------------------------------- stop matcher fuzzing
def reference_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """Cut before the stop string that is completed first (the longest one on a tie)."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            return text[: end - max(map(len, done))], True
    return text, False


@settings(max_examples=300, deadline=None)
@given(
    st.text(alphabet="abcX\u00e9\U0001f642", max_size=30),
    st.lists(st.text(alphabet="abcX\u00e9\U0001f642", min_size=1, max_size=4), min_size=0, max_size=3),
    st.lists(st.integers(1, 5), min_size=1, max_size=30),
)
def test_stop_matcher_matches_reference(text: str, stops: list[str], cuts: list[int]) -> None:
    matcher = StopStringMatcher(stops)
    out, i, k = [], 0, 0
    while i < len(text) and not matcher.stopped:
        step = cuts[k % len(cuts)]
        out.append(matcher.push(text[i : i + step]))
        i, k = i + step, k + 1
    out.append(matcher.flush())
    assert ("".join(out), matcher.stopped) == reference_stop(text, stops)


def test_detokenizer_round_trips_multibyte(tokenizer) -> None:
    text = "naïve Zürich 東京 🙂 done"
    ids = tokenizer(text)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push(i) for i in ids] + [detok.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_stream_of_token_ids_without_tokenizer_fails_clearly() -> None:
    engine = SpeculativeEngine(make_model("llama"), drafter="early_exit")
    with pytest.raises(ValueError, match="tokenizer"):
        engine.stream_ids(torch.tensor([5, 6]), max_new_tokens=3)


class ForcedTokens:
    """A constraint that allows exactly one scripted token at each step (then anything)."""

    def __init__(self, script: list[int], vocab: int) -> None:
        self.script, self.vocab, self.done = script, vocab, 0

    def allowed_tokens(self) -> torch.Tensor:
        allowed = torch.zeros(self.vocab, dtype=torch.bool)
        if self.done < len(self.script):
            allowed[self.script[self.done]] = True
        else:
            allowed[:] = True
        return allowed

    def advance(self, token_id: int) -> None:
        self.done += 1

    def rollback(self, num_tokens: int) -> None:
        self.done -= num_tokens


def test_invalid_utf8_in_output_becomes_replacement_characters(demo_engine) -> None:
    """Byte tokens that never form a UTF-8 character decode to U+FFFD; nothing crashes or hangs."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokenizer = demo_engine.tokenizer
    byte_char = bytes_to_unicode()
    lone = [tokenizer.convert_tokens_to_ids(byte_char[b]) for b in (0x80, 0xFF, 0xC3)]  # never valid alone
    text_ids = tokenizer.encode(" Elizabeth smiled", add_special_tokens=False)
    script = [*text_ids[:1], *lone, *text_ids[1:], lone[0]]
    expected = tokenizer.decode(script, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert "\ufffd" in expected

    def forced() -> ForcedTokens:
        return ForcedTokens(script, len(tokenizer))

    out = demo_engine.generate("Hello", max_new_tokens=len(script), constraint=forced())
    assert out.token_ids == script
    assert out.text == expected
    streamed = "".join(demo_engine.stream("Hello", max_new_tokens=len(script), constraint=forced()))
    assert streamed == expected
    assert demo_engine.generate("Hello", max_new_tokens=4).finish_reason == "length"  # still usable
