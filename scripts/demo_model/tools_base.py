"""Building blocks of the synthetic tool-use chats: tool schemas, argument values, made-up tools.

A :class:`Scenario` is one tool call: the user mentions every argument value, and the assistant's
``<tool_call>`` copies them. Schemas are rendered in both LangChain and transformers key order.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

from demo_model import banks
from demo_model.synthetic import Message


@dataclass
class Param:
    """One tool parameter."""

    name: str
    type: str
    description: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Tool:
    """A tool definition (rendered to a JSON schema by :func:`to_schema`)."""

    name: str
    description: str
    params: list[Param] = field(default_factory=list)


@dataclass
class Scenario:
    """One tool call: the tool, its arguments, the user's request, the result and the answer."""

    tool: Tool
    args: dict[str, Any]
    user: str
    result: str | None
    answer: str


def dumps(value: Any) -> str:
    """JSON-encode like the chat template's ``tojson`` filter (non-ASCII kept)."""
    return json.dumps(value, ensure_ascii=False)


def to_schema(tool: Tool, rng: random.Random) -> dict[str, Any]:
    """Render a tool as an OpenAI-style schema, in LangChain or transformers key order."""
    langchain = rng.random() < 0.5
    props: dict[str, Any] = {}
    for p in tool.params:
        prop: dict[str, Any] = dict(p.extra)
        if p.description:
            prop["description"] = p.description
        prop = {**prop, "type": p.type} if langchain else {"type": p.type, **prop}
        props[p.name] = prop
    required = [p.name for p in tool.params]
    if langchain:
        params: dict[str, Any] = {"properties": props, **({"required": required} if required else {})}
        params["type"] = "object"
    else:
        params = {"type": "object", "properties": props, "required": required}
    fn = {"name": tool.name, "description": tool.description, "parameters": params}
    return {"type": "function", "function": fn} if rng.random() < 0.85 else fn


def call_message(name: str, args: dict[str, Any], rng: random.Random) -> Message:
    """An assistant message holding one tool call (OpenAI form, sometimes flat)."""
    call: dict[str, Any] = {"name": name, "arguments": args}
    if rng.random() < 0.8:
        call = {"type": "function", "id": f"call_{rng.randrange(10**6)}", "function": call}
    return {"role": "assistant", "content": "", "tool_calls": [call]}


# -- values ------------------------------------------------------------------------------------
def int_value(rng: random.Random) -> int:
    """A random integer of varied magnitude."""
    lo, hi = rng.choice(((0, 10), (10, 100), (100, 10_000), (-100, 0), (10_000, 1_000_000)))
    return rng.randrange(lo, hi)


def num_value(rng: random.Random) -> float:
    """A random decimal whose JSON form is short and exact."""
    while True:
        frac = rng.randrange(1, 1000) if rng.random() < 0.3 else rng.randrange(1, 100)
        text = f"{rng.randrange(0, 1000)}.{frac}"
        if json.dumps(float(text)) == text:
            return float(text)


def str_value(rng: random.Random) -> str:
    """A random word, name or city, often non-ASCII."""
    pools = (banks.ASCII_WORDS, banks.NON_ASCII_WORDS, banks.CITIES, banks.CHARACTERS)
    return rng.choice(rng.choice(pools))


def value_for(kind: str, rng: random.Random) -> Any:
    """A random value for a JSON-schema type name."""
    makers = {"integer": int_value, "number": num_value, "string": str_value}
    return makers[kind](rng) if kind in makers else rng.random() < 0.5


def mention(value: Any, rng: random.Random) -> str:
    """How the user writes a value in the request."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str) and (" " in value or rng.random() < 0.4):
        return f'"{value}"'
    return str(value)


# -- random tools ------------------------------------------------------------------------------
def random_name(rng: random.Random) -> str:
    """A made-up function name, snake_case, camelCase or nonsense."""
    r = rng.random()
    if r < 0.2:
        return "".join(rng.choice(banks.SYLLABLES) for _ in range(rng.randrange(2, 4)))
    verb, noun = rng.choice(banks.TOOL_VERBS), rng.choice(banks.TOOL_NOUNS)
    return f"{verb}{noun.capitalize()}" if r < 0.35 else f"{verb}_{noun}"


def random_tool(rng: random.Random) -> Tool:
    """A made-up tool with 0-3 parameters of random types."""
    names = rng.sample(banks.PARAM_NAMES, rng.choice((0, 1, 1, 2, 2, 3)))
    params = [
        Param(
            n,
            rng.choice(("integer", "number", "string", "boolean")),
            rng.choice((None, f"The {n}.", f"The {n} to use.", f"Value of {n}.")),
        )
        for n in names
    ]
    noun = rng.choice(banks.TOOL_NOUNS)
    desc = rng.choice((f"Compute the {noun}.", f"Return a {noun}.", "A made-up function.", f"Look up a {noun} record."))
    return Tool(random_name(rng), desc, params)


def random_request(tool: Tool, args: dict[str, Any], rng: random.Random) -> str:
    """A user request that names the tool and mentions every argument value."""
    if not args:
        return rng.choice(
            (
                f"Call {tool.name}.",
                f"Please run {tool.name} for me.",
                f"What is the value of {tool.name}()? Use the tool.",
            )
        )
    sep = rng.choice((" ", "=", " set to ", ": "))
    pairs = [f"{k}{sep}{mention(v, rng)}" for k, v in args.items()]
    kv = ", ".join(pairs[:-1]) + (" and " if len(pairs) > 1 else "") + pairs[-1]
    values = " and ".join(mention(v, rng) for v in args.values())
    return rng.choice(
        (
            f"Please call {tool.name} with {kv}.",
            f"Use {tool.name} on {values}.",
            f"Run the {tool.name} tool with {kv}.",
            f"I need {tool.name} for {kv}.",
            f"What does {tool.name} give for {kv}?",
        )
    )


def random_scenario(rng: random.Random) -> Scenario:
    """A call to a made-up tool with a random result."""
    tool = random_tool(rng)
    args = {p.name: value_for(p.type, rng) for p in tool.params}
    result: Any = rng.choice(
        (int_value(rng), num_value(rng), str_value(rng), {"status": "ok", "value": int_value(rng)})
    )
    text = dumps(result) if isinstance(result, dict) else str(result)
    answer = rng.choice((f"The result is {text}.", f"{tool.name} returned {text}.", f"Done: the result is {text}."))
    return Scenario(tool, args, random_request(tool, args, rng), text, answer)
