"""Assemble synthetic tool-use chats from scenarios, and the full seeded chat mix.

A tool chat offers one to four tools (the needed one among them), has the user ask, the assistant
emit exactly one ``<tool_call>`` and, usually, a ``tool`` result followed by an answer that uses
it. Other chats offer tools that the question does not need, replay LangChain's few-shot and
error histories, or ask for JSON-only answers.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator, Sequence

from demo_model import banks
from demo_model.known_tools import ADDER, JOKE, LC_WEATHER, MAGIC, known_scenario
from demo_model.synthetic import Chat, Message, TextChats, turn
from demo_model.tools_base import (
    Scenario,
    call_message,
    dumps,
    random_scenario,
    random_tool,
    to_schema,
)


class ToolChats:
    """Generators for the tool-use and JSON part of the mix.

    Args:
        text: The plain-chat generators (for system prompts and tool-free turns).
        rng: Random generator shared with ``text``.
    """

    def __init__(self, text: TextChats, rng: random.Random) -> None:
        self.text = text
        self.rng = rng

    def _scenario(self) -> Scenario:
        """A known-tool scenario (60%) or a made-up one."""
        return known_scenario(self.rng) if self.rng.random() < 0.6 else random_scenario(self.rng)

    def _offer(self, scenario: Scenario) -> list[dict]:
        """Schemas of the needed tool plus 0-3 distractors, shuffled."""
        tools = [scenario.tool] + [self._scenario().tool for _ in range(self.rng.choice((0, 0, 1, 2, 3)))]
        unique = {t.name: t for t in tools}
        if scenario.tool.name in unique:
            unique[scenario.tool.name] = scenario.tool
        offered = list(unique.values())
        self.rng.shuffle(offered)
        return [to_schema(t, self.rng) for t in offered]

    def tool_call(self) -> Chat:
        """One tool call, usually followed by its result and an answer that uses it."""
        sc = self._scenario()
        messages = self.text.system_prompt(0.25)
        if self.rng.random() < 0.15:
            messages += self.text.single_turn()
        messages += [{"role": "user", "content": sc.user}, call_message(sc.tool.name, sc.args, self.rng)]
        if sc.result is not None and self.rng.random() < 0.85:
            messages += [{"role": "tool", "content": sc.result}, {"role": "assistant", "content": sc.answer}]
        return Chat(messages, self._offer(sc), "tool_call")

    def tool_unneeded(self) -> Chat:
        """Tools are offered but the question needs none: a plain text answer."""
        tools = [to_schema(random_tool(self.rng), self.rng) for _ in range(self.rng.randrange(1, 3))]
        if self.rng.random() < 0.3:
            tools = [to_schema(MAGIC, self.rng), to_schema(LC_WEATHER, self.rng)]
        return Chat(self.text.system_prompt(0.2) + self.text.single_turn(), tools, "tool_unneeded")

    def few_shot(self) -> Chat:
        """LangChain's few-shot history: an adder call, its result, then a new question."""
        a, b, c, d = (self.rng.randrange(0, 20) for _ in range(4))
        result = dumps({"result": a + b})
        messages: list[Message] = [
            {"role": "user", "content": f"What is {a} + {b}"},
            call_message(ADDER.name, {"a": a, "b": b}, self.rng),
            {"role": "tool", "content": result},
            {"role": "assistant", "content": result},
            {"role": "user", "content": f"What is {c} + {d}"},
            call_message(ADDER.name, {"a": c, "b": d}, self.rng),
        ]
        if self.rng.random() < 0.5:
            messages += [
                {"role": "tool", "content": dumps({"result": c + d})},
                {"role": "assistant", "content": f"{c} + {d} = {c + d}."},
            ]
        return Chat(messages, [to_schema(ADDER, self.rng)], "few_shot")

    def tool_error(self) -> Chat:
        """A call that returns an error, and an answer that reports it."""
        a = self.rng.randrange(0, 20)
        messages: list[Message] = [
            {"role": "user", "content": f"What is {a} + {self.rng.randrange(0, 20)}"},
            call_message(ADDER.name, {"a": a}, self.rng),
            {"role": "tool", "content": "Error: Missing required argument 'b'."},
            {"role": "assistant", "content": "The tool reported an error: Missing required argument 'b'."},
        ]
        return Chat(messages, [to_schema(ADDER, self.rng)], "tool_error")

    def json_answer(self) -> Chat:
        """A request for a JSON-only answer (jokes, or an object copied from the request)."""
        if self.rng.random() < 0.6:
            topic, setup, punch = self.rng.choice(banks.JOKES)
            ask = self.rng.choice(
                (
                    f"Tell me a joke about {topic}. Respond in JSON with keys setup and punchline.",
                    f"Tell me a joke about {topic}. Return the result as a JSON with 'setup' and "
                    "'punchline' keys. Return nothing other than JSON.",
                )
            )
            return Chat(turn(ask, dumps({"setup": setup, "punchline": punch})), None, "json")
        name, city = self.rng.choice(banks.CHARACTERS), self.rng.choice(banks.CITIES)
        ask = f"Give me a JSON object with keys name and city for {name}, who lives in {city}."
        return Chat(turn(ask, dumps({"name": name, "city": city})), None, "json")

    def joke_setup_only(self) -> Chat:
        """LangChain's optional-field structured output: a Joke call with only a setup."""
        topic, setup, _ = self.rng.choice(banks.JOKES)
        messages = [
            {"role": "user", "content": f"Give me the setup to a joke about {topic}, no punchline."},
            call_message(JOKE.name, {"setup": setup}, self.rng),
        ]
        return Chat(messages, [to_schema(JOKE, self.rng)], "tool_call")


# Weights of each kind of synthetic chat (relative).
MIX: tuple[tuple[str, float], ...] = (
    ("greeting", 3),
    ("fact", 5),
    ("style", 7),
    ("multi_turn", 6),
    ("rewrite", 9),
    ("rag_span", 15),
    ("rag_summary", 5),
    ("tool_call", 30),
    ("tool_unneeded", 6),
    ("few_shot", 3),
    ("tool_error", 1),
    ("json_answer", 4),
    ("joke_setup_only", 0.5),
)


def chat_stream(paragraphs: Sequence[str], seed: int) -> Iterator[Chat]:
    """Yield an endless, seeded stream of synthetic chats.

    Args:
        paragraphs: Austen training paragraphs to draw prose and passages from.
        seed: Random seed.

    Yields:
        Synthetic chats, kinds drawn according to :data:`MIX`.
    """
    rng = random.Random(seed)
    text = TextChats(paragraphs, rng)
    tools = ToolChats(text, rng)
    makers: dict[str, Callable[[], Chat | list[Message]]] = {
        name: getattr(tools, name, None) or getattr(text, name) for name, _ in MIX
    }
    names, weights = zip(*MIX, strict=True)
    while True:
        name = rng.choices(names, weights)[0]
        made = makers[name]()
        yield made if isinstance(made, Chat) else Chat(made, None, name)


def drill_stream(paragraphs: Sequence[str], seed: int) -> Iterator[Chat]:
    """Yield an endless, seeded stream of copy drills (random sequences and JSON to echo).

    Args:
        paragraphs: Austen training paragraphs (their words fill the random sequences).
        seed: Random seed.

    Yields:
        ``copy_drill`` (70%) and ``copy_json`` (30%) chats.
    """
    rng = random.Random(seed)
    text = TextChats(paragraphs, rng)
    while True:
        if rng.random() < 0.7:
            yield Chat(text.copy_drill(), None, "copy_drill")
        else:
            yield Chat(text.copy_json(), None, "copy_json")


def chat_to_json(chat: Chat) -> str:
    """Serialise a chat for inspection (one JSON object per line)."""
    return json.dumps({"kind": chat.kind, "tools": chat.tools, "messages": chat.messages}, ensure_ascii=False)
