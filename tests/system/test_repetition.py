"""The early stop on degenerate repetition inside a constrained JSON string.

A small greedy model can loop inside a JSON string that the grammar cannot end
(``"cat_joke_fun_fun_fun..."``); :class:`selfspec.decoding.stopping.RepetitionDetector` notices the loop
and :class:`selfspec.serving.requests.RequestPlan` stops the call there, with ``finish_reason
"repetition"`` and a clear message, instead of spending the whole budget. Greedy output is not
changed: what is emitted is the unguarded output's prefix.
"""

from __future__ import annotations

import json

import pytest

from selfspec import SpeculativeEngine
from selfspec.decoding.stopping import RepetitionDetector
from selfspec.serving.requests import cut_off_message, plan_request


def _pushed(text: str, piece: int = 5) -> RepetitionDetector:
    detector = RepetitionDetector()
    for start in range(0, len(text), piece):
        if detector.push(text[start : start + piece]):
            break
    return detector


# SmolLM2-135M-Instruct's loops under greedy decoding (issue 19), as they were streamed
SMOLLM2_LOOPS = [
    '{"setup": "cat_joke' + "_fun" * 200,
    '{"punchline": "No punchline is possible. ' + "Please provide a joke about cats, no joke is possible. " * 12,
    '{"setup": "JokeO. Answer", "punchline": "' + "No, " * 150,
]

# JSON a model may legitimately write: repeats, but not a loop inside one string
LEGITIMATE = [
    json.dumps({"items": ["the same item"] * 200}),  # equal items: quotes between them
    json.dumps({"grid": [[0] * 30] * 30}),  # rows of numbers: brackets between the rows
    json.dumps({"text": "The cat is a cat, the cat is a cat, the cat is a cat"}),  # 3 repeats
    json.dumps({"text": " ".join(f"line {i}: the value is {i * i}." for i in range(120))}),  # long, not periodic
    json.dumps({"rule": "-" * 80, "title": "=" * 80}),  # separator lines
    json.dumps({"song": "la " * 60}),  # a chorus of 180 characters
]


@pytest.mark.parametrize("text", SMOLLM2_LOOPS)
def test_a_loop_inside_a_string_is_detected(text: str) -> None:
    detector = _pushed(text)
    assert detector.detected
    assert detector.unit and '"' not in detector.unit
    assert detector.text.endswith(detector.unit * 8)


@pytest.mark.parametrize("text", LEGITIMATE)
def test_legitimate_json_is_never_flagged(text: str) -> None:
    assert not _pushed(text).detected
    assert not _pushed(text, piece=1).detected  # however it is streamed


def test_detection_does_not_depend_on_how_the_text_is_split() -> None:
    text = SMOLLM2_LOOPS[1]
    assert all(_pushed(text, piece).detected for piece in (1, 3, 7, 40, len(text)))


def test_bad_thresholds_are_refused() -> None:
    with pytest.raises(ValueError, match="min_repeats"):
        RepetitionDetector(min_repeats=1)


def test_the_message_says_repetition_and_the_tokens_used() -> None:
    message = cut_off_message("Joke tool call", 512, 143, "repetition")
    assert "repetition" in message and "143 tokens used" in message and "max_tokens=512" in message
    assert "cut off at max_tokens=512 (143 tokens used)" in cut_off_message("Joke tool call", 512, 143)


# A raw prompt that sends the demo model's greedy decoding into a loop; the schema's minLength
# keeps the grammar from ending the string, as a small model's loop does in practice.
LOOP_PROMPT = 'la la la la la la la la {"text": "la la la la la la la la'
LONG_STRING = {"type": "object", "properties": {"text": {"type": "string", "minLength": 5000}}, "required": ["text"]}


@pytest.mark.slow
def test_a_looping_call_stops_early_with_the_greedy_prefix(demo_engine: SpeculativeEngine) -> None:
    budget = 900
    plan = plan_request(demo_engine, LOOP_PROMPT, json_schema=LONG_STRING, max_tokens=budget)
    output = plan.generate()
    used = len(output.token_ids)
    assert plan.repetition is not None and plan.finish_reason(output) == "repetition"
    assert used < budget * 0.6  # the budget was not spent
    message = plan.cut_message(output, "JSON answer")
    assert message is not None and "repetition" in message and f"{used} tokens used" in message
    # nothing but an early end: the same tokens as unguarded greedy decoding, cut at the stop
    assert plan.constraint is not None
    unguarded = demo_engine.generate_ids(
        plan.prompt_ids, max_new_tokens=used, constraint=plan.constraint.build(demo_engine)
    )
    assert unguarded.token_ids == output.token_ids
    # streamed: the same deltas, the same stop
    streamed = plan_request(demo_engine, LOOP_PROMPT, json_schema=LONG_STRING, max_tokens=budget)
    stream = streamed.stream()
    assert "".join(stream) == output.text
    assert stream.finish_reason == "repetition"


def test_free_text_and_optional_calls_are_not_watched(demo_engine: SpeculativeEngine) -> None:
    user = [{"role": "user", "content": "hi"}]
    assert not plan_request(demo_engine, "la la la", max_tokens=4).guards_repetition
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    assert not plan_request(demo_engine, user, tools=tools, max_tokens=4).guards_repetition
    assert plan_request(demo_engine, user, tools=tools, tool_choice="f", max_tokens=4).guards_repetition
    assert plan_request(demo_engine, user, json_schema=LONG_STRING, max_tokens=4).guards_repetition
