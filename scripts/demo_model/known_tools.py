"""Synthetic scenarios for familiar tools (weather, sums, magic_function, lookups, ...).

The LangChain standard-test tools are reproduced with the schemas LangChain itself produces
(``magic_function`` with ``input`` bounded to (-1000, 1000), ``magic_function_no_args``,
``my_adder_tool``, ``get_weather(location)``).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from decimal import Decimal

from demo_model import banks
from demo_model.tools_base import Param, Scenario, Tool, int_value, num_value

MAGIC = Tool(
    "magic_function",
    "Apply a magic function to an input.",
    [Param("input", "integer", None, {"exclusiveMaximum": 1000, "exclusiveMinimum": -1000})],
)
MAGIC_NO_ARGS = Tool("magic_function_no_args", "Calculate a magic function.")
ADDER = Tool(
    "my_adder_tool", "Take two integers, a and b, and return their sum.", [Param("a", "integer"), Param("b", "integer")]
)
LC_WEATHER = Tool("get_weather", "Get the weather at a location.", [Param("location", "string")])
JOKE = Tool(
    "Joke",
    "Joke to tell user.",
    [
        Param("setup", "string", "question to set up a joke"),
        Param("punchline", "string", "answer to resolve the joke"),
    ],
)


def weather(rng: random.Random) -> Scenario:
    """get_weather for a city; LangChain's form answers "It's sunny."."""
    city = rng.choice(banks.CITIES)
    user = rng.choice(
        (
            f"What is the weather in {city}?",
            f"What's the weather like in {city} today?",
            f"Is it raining in {city}?",
            f"How is the weather in {city}?",
        )
    )
    if rng.random() < 0.4:
        return Scenario(LC_WEATHER, {"location": city}, user, "It's sunny.", f"It's sunny in {city}.")
    tool = Tool("get_weather", "Get the current weather for a city.", [Param("city", "string", "The city name.")])
    temp, cond = rng.randrange(-5, 35), rng.choice(banks.WEATHER)
    return Scenario(tool, {"city": city}, user, f"{temp}°C and {cond}", f"It is {temp}°C and {cond} in {city}.")


def add(rng: random.Random) -> Scenario:
    """Add two integers or decimals with add_numbers or LangChain's my_adder_tool."""
    a: float
    b: float
    if rng.random() < 0.4:
        tool, a, b = ADDER, int_value(rng), int_value(rng)
    else:
        kind = rng.choice(("integer", "number"))
        maker = int_value if kind == "integer" else num_value
        a, b = maker(rng), maker(rng)
        tool = Tool(
            "add_numbers",
            "Add two numbers.",
            [Param("a", kind, "The first number."), Param("b", kind, "The second number.")],
        )
    total = f"{(Decimal(json.dumps(a)) + Decimal(json.dumps(b))).normalize():f}"
    user = rng.choice(
        (f"What is {a} + {b}", f"What is {a} + {b}?", f"Add {a} and {b}.", f"What is {a} plus {b}? Use the tool.")
    )
    result = f'{{"result": {total}}}' if rng.random() < 0.3 else str(total)
    answer = rng.choice((f"The result is {total}.", f"{a} + {b} = {total}."))
    return Scenario(tool, {"a": a, "b": b}, user, result, answer)


def multiply(rng: random.Random) -> Scenario:
    """Multiply two small integers with the multiply tool."""
    x, y = rng.randrange(-20, 100), rng.randrange(0, 100)
    tool = Tool("multiply", "Multiply two integers.", [Param("x", "integer"), Param("y", "integer")])
    user = rng.choice((f"What is {x} times {y}?", f"Multiply {x} by {y}.", f"Use multiply on {x} and {y}."))
    return Scenario(tool, {"x": x, "y": y}, user, str(x * y), f"The result is {x * y}.")


def magic(rng: random.Random) -> Scenario:
    """LangChain's magic_function(n) = n + 2."""
    n = 3 if rng.random() < 0.25 else rng.randrange(-999, 1000)
    user = rng.choice(
        (
            f"What is the value of magic_function({n})? Use the tool.",
            f"What is magic_function({n})?",
            f"Call magic_function with input {n}.",
        )
    )
    answer = rng.choice((f"The value of magic_function({n}) is {n + 2}.", f"The result is {n + 2}."))
    return Scenario(MAGIC, {"input": n}, user, str(n + 2), answer)


def magic_no_args(rng: random.Random) -> Scenario:
    """LangChain's magic_function_no_args() = 5."""
    user = rng.choice(
        (
            "What is the value of magic_function_no_args()? Use the tool.",
            "What is the value of magic_function_no_args()? You must use the tool.",
            "Call magic_function_no_args.",
        )
    )
    return Scenario(MAGIC_NO_ARGS, {}, user, "5", "The value of magic_function_no_args() is 5.")


def lookup(rng: random.Random) -> Scenario:
    """lookup_word on a word from a small dictionary (or an unknown word)."""
    word = rng.choice(sorted(banks.DEFINITIONS) + list(banks.NON_ASCII_WORDS[:6]))
    meaning = banks.DEFINITIONS.get(word)
    tool = Tool("lookup_word", "Look up the definition of a word.", [Param("word", "string", "The word to look up.")])
    user = rng.choice(
        (f'Look up the word "{word}".', f'What does "{word}" mean? Look it up.', f"Use lookup_word for {word}.")
    )
    if meaning is None:
        return Scenario(tool, {"word": word}, user, "No entry found.", f'I could not find "{word}" in the dictionary.')
    return Scenario(tool, {"word": word}, user, meaning, f'"{word}" means {meaning}.')


def clock(rng: random.Random) -> Scenario:
    """get_time for a city."""
    city = rng.choice(banks.CITIES)
    now = f"{rng.randrange(24):02d}:{rng.randrange(60):02d}"
    tool = Tool("get_time", "Get the current local time in a city.", [Param("city", "string")])
    return Scenario(tool, {"city": city}, f"What time is it in {city}?", now, f"It is {now} in {city}.")


def currency(rng: random.Random) -> Scenario:
    """convert_currency with an amount and two currency codes."""
    amount = num_value(rng) if rng.random() < 0.5 else int_value(rng)
    src, dst = rng.sample(("GBP", "USD", "EUR", "JPY", "CHF"), 2)
    tool = Tool(
        "convert_currency",
        "Convert an amount between currencies.",
        [
            Param("amount", "number", "The amount to convert."),
            Param("from_currency", "string"),
            Param("to_currency", "string"),
        ],
    )
    out = (Decimal(json.dumps(amount)) * Decimal(rng.choice(("0.8", "1.25", "1.1", "150")))).normalize()
    user = rng.choice((f"Convert {amount} {src} to {dst}.", f"How much is {amount} {src} in {dst}?"))
    args = {"amount": amount, "from_currency": src, "to_currency": dst}
    return Scenario(tool, args, user, f"{out:f}", f"{amount} {src} is {out:f} {dst}.")


def alarm(rng: random.Random) -> Scenario:
    """set_alarm with an hour and a minute."""
    h, m = rng.randrange(24), rng.randrange(60)
    tool = Tool("set_alarm", "Set an alarm.", [Param("hour", "integer"), Param("minute", "integer")])
    user = rng.choice((f"Set an alarm for hour {h}, minute {m}.", f"Wake me at {h}:{m:02d}."))
    return Scenario(tool, {"hour": h, "minute": m}, user, "Alarm set.", f"Your alarm is set for {h}:{m:02d}.")


def message(rng: random.Random) -> Scenario:
    """send_message to a character with a short text."""
    who, text = (
        rng.choice(banks.CHARACTERS),
        rng.choice(("I shall call tomorrow.", "Thank you!", "See you at the ball.", "À bientôt !")),
    )
    tool = Tool(
        "send_message",
        "Send a short message.",
        [Param("recipient", "string", "Who receives it."), Param("text", "string", "The message.")],
    )
    user = f'Send a message to {who} saying "{text}"'
    return Scenario(tool, {"recipient": who, "text": text}, user, "sent", f"Your message to {who} has been sent.")


def light(rng: random.Random) -> Scenario:
    """toggle_light with a boolean."""
    room, on = rng.choice(banks.ROOMS), rng.random() < 0.5
    tool = Tool("toggle_light", "Turn a light on or off.", [Param("room", "string"), Param("on", "boolean")])
    user = f"Turn {'on' if on else 'off'} the light in the {room}."
    return Scenario(
        tool, {"room": room, "on": on}, user, "ok", f"The light in the {room} is now {'on' if on else 'off'}."
    )


def population(rng: random.Random) -> Scenario:
    """get_population for a city."""
    city, n = rng.choice(banks.CITIES), rng.randrange(10_000, 20_000_000)
    tool = Tool("get_population", "Get the population of a city.", [Param("city", "string")])
    return Scenario(
        tool, {"city": city}, f"How many people live in {city}?", str(n), f"{city} has a population of {n}."
    )


def translate(rng: random.Random) -> Scenario:
    """translate_text into a language."""
    lang, src, dst = rng.choice(banks.TRANSLATIONS)
    tool = Tool(
        "translate_text",
        "Translate text into another language.",
        [Param("text", "string"), Param("target_language", "string")],
    )
    user = f'Translate "{src}" into {lang} using the tool.'
    return Scenario(tool, {"text": src, "target_language": lang}, user, dst, f'In {lang}, "{src}" is "{dst}".')


def joke(rng: random.Random) -> Scenario:
    """LangChain structured output: the Joke tool, arguments invented by the model."""
    topic, setup, punchline = rng.choice(banks.JOKES)
    return Scenario(JOKE, {"setup": setup, "punchline": punchline}, f"Tell me a joke about {topic}.", None, "")


KNOWN: tuple[tuple[Callable[[random.Random], Scenario], float], ...] = (
    (weather, 3),
    (add, 3),
    (multiply, 1),
    (magic, 3),
    (magic_no_args, 1.5),
    (lookup, 1.5),
    (clock, 1),
    (currency, 1),
    (alarm, 1),
    (message, 1),
    (light, 1),
    (population, 1),
    (translate, 1),
    (joke, 1),
)


def known_scenario(rng: random.Random) -> Scenario:
    """One scenario from a familiar tool, weighted."""
    makers, weights = zip(*KNOWN, strict=True)
    return rng.choices(makers, weights)[0](rng)
