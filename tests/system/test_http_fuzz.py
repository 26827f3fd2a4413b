"""A hypothesis fuzz test of the HTTP API: random JSON, types, sizes and unicode never get a 500.

Besides random JSON, the bodies carry JSON schemas built from JSON Schema's own words (recursive,
unsatisfiable, self-referencing, invalid, and a few of 1.6-2 MB), tools with such parameters (up to
130 of them), stop lists up to 100,000 strings and tiny temperatures: the inputs of issue 29. Every
refusal must be one clean line.

The 2,000 bodies go through the whole ASGI app in-process (Starlette's ``TestClient``: the same
request guard, routes and error handlers a network client meets, with the bytes and headers
given here), which keeps the test to about a minute. What only a socket can show (body limits
before reading, header and body timeouts, disconnects) is tested against uvicorn on loopback
in ``test_serving_server.py`` and ``test_load.py``.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

MODEL = "selfspec-demo"
EXAMPLES = 2000
#: The most a fuzzed request may take (a valid one decodes at most 3 tokens); generous for a busy CI box.
SECONDS_PER_REQUEST = 10.0

# ------------------------------------------------------------------------------- strategies
SURROGATES = st.sampled_from(["a\ud800", "\udfff", "x\udc00y", "\ud83d"])  # lone halves of a pair
TEXT = st.one_of(st.text(max_size=40), SURROGATES, st.sampled_from(["", " ", "東京 🙂", "\x00", "<|im_start|>"]))
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    TEXT,
)
JSON = st.recursive(
    SCALARS,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=10,
)
#: a value that is not a usable small int (so a body never asks for a long generation)
NOT_A_SMALL_INT = st.one_of(
    st.none().map(lambda _: "none"),
    st.booleans(),
    st.floats(),
    TEXT,
    st.integers(max_value=0),
    st.integers(min_value=10**4),
    st.lists(SCALARS, max_size=2),
)
MAX_TOKENS = st.one_of(st.integers(min_value=1, max_value=3), NOT_A_SMALL_INT)


def mostly(valid: st.SearchStrategy[Any], junk: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """A valid value four times in five, else junk (so that many bodies are valid as a whole)."""
    return st.one_of(valid, valid, valid, valid, junk)


# issue 29: the schemas, tools and stop lists that found its bugs. A schema is built from JSON
# Schema's own words (types, properties, required, enums, anyOf, $ref into $defs or to "#"), so
# that recursive, unsatisfiable and self-referencing schemas come up, plus a few huge ones.
SCHEMA_TYPES = st.sampled_from(["object", "string", "integer", "number", "boolean", "array", "null", "strin"])
REFS = st.sampled_from(["#", "#/$defs/a", "#/$defs/b", "#/$defs/missing", "#/properties/x"])
SCHEMA = st.recursive(
    st.one_of(
        st.fixed_dictionaries({"type": SCHEMA_TYPES}),
        st.fixed_dictionaries({"$ref": REFS}),
        st.fixed_dictionaries({"enum": st.lists(SCALARS, max_size=4)}),
        st.fixed_dictionaries({"type": st.just("string")}, optional={"pattern": st.sampled_from(["(", "a+", "[z-a]"])}),
    ),
    lambda children: st.one_of(
        st.fixed_dictionaries(
            {"type": st.just("object"), "properties": st.dictionaries(st.sampled_from(["x", "y", "<|im_start|>"]),
                                                                      children, max_size=3)},
            optional={"required": st.lists(st.sampled_from(["x", "y", "z"]), max_size=3),
                      "additionalProperties": st.booleans()},
        ),
        st.fixed_dictionaries({"anyOf": st.lists(children, max_size=3)}),
        st.fixed_dictionaries({"type": st.just("array"), "items": children}, optional={"minItems": st.integers(0, 3)}),
        st.fixed_dictionaries({"$defs": st.fixed_dictionaries({"a": children}, optional={"b": children}),
                               "$ref": REFS}),
    ),
    max_leaves=8,
)  # fmt: skip
#: a few bodies near the size limit (built once; sampled rarely): issue 29's 1.6 MB enum and 2 MB tool
HUGE_ENUM = {"enum": [f"{i:06d}" + "x" * 74 for i in range(20_000)]}
HUGE_PROPERTIES = {"type": "object", "properties": {f"{i:06d}" + "k" * 90: {} for i in range(19_000)}}
ANY_SCHEMA = st.one_of(SCHEMA, SCHEMA, SCHEMA, SCHEMA, st.sampled_from([HUGE_ENUM, HUGE_PROPERTIES]), JSON)
TOOL = st.fixed_dictionaries(
    {
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {"name": st.one_of(st.sampled_from(["f", "g", "rec"]), TEXT)},
            optional={"parameters": ANY_SCHEMA, "description": TEXT},
        ),
    }
)
JSON_SCHEMA_FORMAT = st.fixed_dictionaries({"name": st.just("a"), "schema": ANY_SCHEMA})
SOME_TOOLS = st.lists(TOOL, max_size=3)
TOOLS = st.one_of(SOME_TOOLS, SOME_TOOLS, SOME_TOOLS, st.lists(TOOL, min_size=126, max_size=130), JSON)
SOME_STOPS = st.one_of(st.text(min_size=1, max_size=5), st.lists(st.text(min_size=1, max_size=5), max_size=3))
STOP = st.one_of(  # mostly a few short stops (valid), else too many or too long ones
    SOME_STOPS,
    SOME_STOPS,
    SOME_STOPS,
    st.lists(st.text(min_size=1, max_size=5), min_size=14, max_size=20),
    st.lists(st.text(min_size=250, max_size=260), min_size=1, max_size=2),
    st.just(["zq"] * 100_000),
)
OPTIONAL = {
    "temperature": mostly(st.sampled_from([0, 0.7, 1.0, 1e-3, 50, 1e-38, 5e-324, 1e-5]), SCALARS),
    "top_p": mostly(st.sampled_from([0.5, 1.0]), SCALARS),
    "top_k": mostly(st.sampled_from([0, 5]), SCALARS),
    "seed": mostly(st.integers(min_value=0, max_value=2**64 - 1), SCALARS),
    "stop": mostly(STOP, SCALARS),
    "top_logprobs": mostly(st.none(), SCALARS),
    "stream": mostly(st.booleans(), SCALARS),
    "stream_options": mostly(st.fixed_dictionaries({"include_usage": st.booleans()}), JSON),
    "n": mostly(st.just(1), SCALARS),
    "logprobs": mostly(st.none(), SCALARS),
    "truncate_prompt": mostly(st.booleans(), SCALARS),
    "frequency_penalty": mostly(st.just(0), SCALARS),
    "logit_bias": mostly(st.none(), JSON),
}
MESSAGE = st.fixed_dictionaries(
    {"role": mostly(st.sampled_from(["system", "user", "assistant", "developer", "function"]), TEXT)},
    optional={
        "content": mostly(st.text(max_size=40), JSON),
        "name": TEXT,
        # OpenAI's deprecated function calling (issue 44): an assistant's call
        "function_call": st.one_of(
            st.fixed_dictionaries({"name": st.sampled_from(["f", "rec"]), "arguments": st.just('{"x": 1}')}), JSON
        ),
    },
)
CHAT_ONLY = {
    "tools": TOOLS,
    "tool_choice": st.one_of(
        st.sampled_from(["auto", "none", "required", {"type": "function", "function": {"name": "rec"}}]), JSON
    ),
    "response_format": st.one_of(
        st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
        st.fixed_dictionaries({"type": st.just("json_schema"), "json_schema": JSON_SCHEMA_FORMAT}),
        JSON,
    ),
    "constrain_tool_calls": SCALARS,
    "functions": st.one_of(SOME_TOOLS.map(lambda tools: [tool["function"] for tool in tools]), JSON),
    "function_call": st.one_of(st.sampled_from(["auto", "none", {"name": "f"}, {"name": "rec"}]), JSON),
    "escape_special_tokens": mostly(st.booleans(), SCALARS),
}


def _request(path: str, required: dict[str, Any], optional: dict[str, Any]) -> st.SearchStrategy[Any]:
    body = st.fixed_dictionaries(required, optional=optional)
    return st.tuples(st.just(path), body)


COMPLETION = _request(
    "/v1/completions",
    {
        "model": st.one_of(st.just(MODEL), st.just(MODEL), TEXT),
        "prompt": st.one_of(
            TEXT,
            st.text(min_size=1, max_size=40),
            st.lists(st.integers(min_value=-5, max_value=70_000), max_size=8),
            st.lists(st.integers(min_value=0, max_value=1000), min_size=1, max_size=8),
            st.lists(TEXT, max_size=2),
            st.lists(st.lists(st.integers(min_value=-5, max_value=70_000), max_size=6), max_size=3),  # issue 44
            JSON,
        ),
        "max_tokens": MAX_TOKENS,
    },
    OPTIONAL,
)
CHAT = _request(
    "/v1/chat/completions",
    {
        "model": st.one_of(st.just(MODEL), st.just(MODEL), TEXT),
        "messages": st.one_of(st.lists(MESSAGE, min_size=1, max_size=3), JSON),
        "max_tokens": MAX_TOKENS,
    },
    {**OPTIONAL, **CHAT_ONLY},
)
#: Bodies built from valid values only, so that every run sends well-formed requests whatever the
#: hypothesis version's mix of the strategies above (the fully random ones are valid ~1% of the time).
VALID_OPTIONAL = {
    "temperature": st.sampled_from([0, 0.7, 1.0, 1e-3]),
    "top_p": st.sampled_from([0.5, 1.0]),
    "seed": st.integers(min_value=0, max_value=2**32),
    "stop": SOME_STOPS,
    "stream": st.booleans(),
}
VALID = st.one_of(
    _request(
        "/v1/completions",
        {"model": st.just(MODEL), "prompt": st.text(min_size=1, max_size=40), "max_tokens": st.integers(1, 3)},
        VALID_OPTIONAL,
    ),
    _request(
        "/v1/chat/completions",
        {
            "model": st.just(MODEL),
            "messages": st.lists(
                st.fixed_dictionaries({"role": st.just("user"), "content": st.text(min_size=1, max_size=40)}),
                min_size=1,
                max_size=2,
            ),
            "max_tokens": st.integers(1, 3),
        },
        VALID_OPTIONAL,
    ),
)
ANYTHING = st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions"]), JSON)
RAW = st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions"]), st.binary(max_size=64))
CONTENT_TYPES = st.sampled_from(
    ["application/json"] * 8
    + ["application/json; charset=utf-8", "text/plain", "", "application/x-www-form-urlencoded"]
)


def _encode(body: Any) -> bytes:
    """JSON with non-finite numbers written as NaN/Infinity (not JSON; the server must refuse them)."""
    text = json.dumps(body, allow_nan=True)
    if isinstance(body, dict) and body.get("max_tokens") == "none":  # a body without max_tokens would decode long
        text = text.replace('"max_tokens": "none"', '"max_tokens": null')
    return text.encode("utf-8", "surrogatepass")  # lone surrogates travel as invalid UTF-8 too


# ------------------------------------------------------------------------------- the test
@pytest.fixture(scope="module")
def client(demo_engine: Any) -> Any:
    from fastapi.testclient import TestClient

    from selfspec.serving.server import create_app

    app = create_app(demo_engine, model_id=MODEL)
    # raise_server_exceptions=False: a crash is seen as the client sees it (a status), and counted
    with TestClient(app, base_url="http://127.0.0.1", raise_server_exceptions=False) as http:
        yield http


@pytest.mark.slow
def test_fuzzed_bodies_never_get_a_500(client: Any, demo_engine: Any) -> None:
    seen: dict[int, int] = {}
    slowest = 0.0

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,  # the same 2,000 bodies on every run (no flaky CI)
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
    )
    @given(request=st.one_of(COMPLETION, CHAT, COMPLETION, CHAT, ANYTHING, RAW, VALID), content_type=CONTENT_TYPES)
    def one_request(request: tuple[str, Any], content_type: str) -> None:
        nonlocal slowest
        path, body = request
        content = body if isinstance(body, bytes) else _encode(body)
        started = time.perf_counter()
        response = client.post(path, content=content, headers={"Content-Type": content_type})
        elapsed = time.perf_counter() - started
        slowest = max(slowest, elapsed)
        seen[response.status_code] = seen.get(response.status_code, 0) + 1
        assert response.status_code < 500, (response.status_code, response.text[:500], content[:300])
        assert elapsed < SECONDS_PER_REQUEST, (elapsed, content[:300])
        if response.status_code != 200:
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"]
            # one clean line: no native backtrace, parser dump or build path (issue 29)
            assert "\n" not in error["message"] and len(error["message"]) < 1500, error["message"][:500]
        elif response.headers["content-type"].startswith("text/event-stream"):
            assert '"server_error"' not in response.text and response.text.rstrip().endswith("data: [DONE]")
            assert '"finish_reason": "cancelled"' not in response.text
        else:
            assert response.json()["object"] in ("text_completion", "chat.completion")

    one_request()
    total = sum(seen.values())
    assert total >= EXAMPLES, seen
    assert not any(status >= 500 for status in seen), seen
    assert seen.get(200, 0) > 100 and seen.get(400, 0) > 500, seen  # both valid and invalid bodies were sent
    print(f"\n{total} fuzzed requests, statuses {dict(sorted(seen.items()))}, slowest {slowest * 1000:.0f} ms")
    # a valid request is answered, with the engine's text
    expected = demo_engine.generate("It is a truth", max_new_tokens=8).text
    reply = client.post(
        "/v1/completions", json={"model": MODEL, "prompt": "It is a truth", "max_tokens": 8, "temperature": 0}
    )
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == expected
    assert 'status="500"' not in client.get("/metrics").text
