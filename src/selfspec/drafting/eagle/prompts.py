"""The built-in prompt mix ``selfspec train-eagle`` asks the model to answer (no dataset needed).

Five kinds, combined from templates and subjects with a seeded shuffle: chat turns (single and
multi-turn), RAG questions over a passage, summaries, code, and plain-text continuations.
The benchmark's held-out prompts (``benchmarks/eagle_bench.py``) use other subjects and tasks.
A prompt is a list of chat messages, a ``str`` for plain text (continuations, and every
prompt of a model without a chat template), or a list of token ids.
"""

from __future__ import annotations

import random
from typing import Any

CHAT_TOPICS = [
    "photosynthesis",
    "compound interest",
    "the water cycle",
    "remote work",
    "electric cars",
    "sleep hygiene",
    "the French Revolution",
    "black holes",
    "vaccines",
    "inflation",
    "machine learning",
    "the stock market",
    "climate change",
    "meditation",
    "the Roman Empire",
    "renewable energy",
    "time management",
    "public speaking",
    "healthy eating",
    "volcanoes",
    "the internet",
    "budgeting",
    "learning a new language",
    "gardening",
    "the human heart",
    "earthquakes",
    "recycling",
    "cloud computing",
    "job interviews",
    "the solar system",
    "coffee",
    "friendship",
    "museums",
    "bicycles",
    "rainforests",
    "chess",
    "honeybees",
    "the printing press",
    "credit scores",
    "running a marathon",
    "the immune system",
    "glaciers",
    "the Olympic Games",
    "renting an apartment",
    "electric guitars",
    "the moon landing",
    "recycling plastic",
    "dinosaurs",
    "starting a podcast",
    "the Renaissance",
    "electricity",
    "bread baking",
    "wind turbines",
    "first aid",
    "social media",
    "ancient Egypt",
    "saving for retirement",
    "hiking safety",
    "the periodic table",
    "car maintenance",
    "coral reefs",
    "online privacy",
    "jazz music",
    "the Industrial Revolution",
    "composting",
    "stress at work",
    "bird migration",
    "3D printing",
    "the Great Wall of China",
    "solar panels",
    "writing a resume",
    "octopuses",
    "the human brain",
    "travel insurance",
    "yoga",
    "smartphones",
    "the Silk Road",
    "desert ecosystems",
    "electric bikes",
    "team sports",
    "antibiotics",
    "the metric system",
    "weather forecasts",
    "home insulation",
    "photography",
    "cryptocurrency",
    "the Vikings",
    "urban gardening",
    "the speed of light",
    "negotiating a salary",
    "wolves",
    "tea",
    "the Eiffel Tower",
    "video games",
    "ocean currents",
    "board games",
    "password security",
    "the Amazon rainforest",
    "DNA",
    "minimalism",
]
CHAT_TEMPLATES = [
    "Explain {x} in simple terms.",
    "What are the main advantages and disadvantages of {x}?",
    "Give me three practical tips about {x}.",
    "Write a short paragraph about {x} for a school newsletter.",
    "How would you describe {x} to a ten-year-old?",
    "What is a common misconception about {x}?",
    "Write a friendly email inviting a colleague to a talk about {x}.",
    "List five interesting facts about {x}.",
    "Why does {x} matter in everyday life?",
    "Can you compare {x} with something most people already know?",
    "What should a beginner know about {x}?",
    "Write a short blog post introduction about {x}.",
    "Answer briefly: what is the history of {x}?",
    "What questions do people often ask about {x}, and what are the answers?",
]
MULTI_TURN = [
    (
        "Can you help me plan a weekend trip to the mountains?",
        "Of course! How many days do you have?",
        "Two days. What should I pack?",
    ),
    (
        "I want to start exercising. Where do I begin?",
        "Start small: a short walk every day is a good first step.",
        "How do I stay motivated after the first week?",
    ),
    (
        "What's a good way to learn to cook?",
        "Begin with a few simple recipes you enjoy eating.",
        "Which three dishes would you suggest first?",
    ),
    (
        "My houseplant's leaves are turning yellow.",
        "That is often a sign of too much water.",
        "How often should I water it then?",
    ),
    (
        "I have a job interview tomorrow.",
        "Good luck! Have you researched the company?",
        "Yes. How should I answer questions about my weaknesses?",
    ),
    (
        "Can you recommend a hobby for rainy days?",
        "Reading, drawing or puzzles are all good choices.",
        "Tell me more about getting started with drawing.",
    ),
]
PASSAGES = [
    "The Great Barrier Reef is the world's largest coral reef system, stretching over 2,300 kilometres "
    "along the coast of Queensland, Australia. It is made up of nearly 3,000 individual reefs and 900 "
    "islands. Rising sea temperatures cause coral bleaching, which has damaged large parts of the reef "
    "since 2016. Scientists monitor the reef with aerial surveys and underwater sensors.",
    "The city library opens at 9 a.m. on weekdays and at 10 a.m. on Saturdays; it is closed on Sundays. "
    "Members may borrow up to eight books for three weeks, and renew them twice online. Late returns "
    "cost 20 cents per book per day. The reading room on the second floor offers free Wi-Fi and quiet "
    "study desks that can be booked for two hours at a time.",
    "Marie Curie was born in Warsaw in 1867 and moved to Paris in 1891 to study physics and mathematics. "
    "With her husband Pierre she discovered the elements polonium and radium. She was the first woman to "
    "win a Nobel Prize and remains the only person to win Nobel Prizes in two different sciences, "
    "physics in 1903 and chemistry in 1911.",
    "Our return policy allows customers to return most items within 30 days of delivery for a full "
    "refund. Items must be unused and in their original packaging. Electronics can be returned within "
    "15 days. Refunds are issued to the original payment method within five business days after the "
    "returned item arrives at our warehouse. Shipping costs are not refunded.",
    "Honey never spoils when it is stored in a sealed container, because its low water content and high "
    "acidity stop bacteria from growing. Bees make honey from flower nectar, which they collect and "
    "store in wax cells. A single hive can produce more than 25 kilograms of honey in a good year. "
    "Beekeepers leave part of the honey in the hive so the colony can survive the winter.",
    "The Python release process publishes a new feature version every year, usually in October. Each "
    "version receives bug-fix releases for about two years and security fixes for three more years. "
    "Developers are encouraged to test their code against release candidates, which appear a few "
    "weeks before the final release.",
    "Mount Kilimanjaro in Tanzania is the highest mountain in Africa at 5,895 metres. It is a dormant "
    "volcano with three cones: Kibo, Mawenzi and Shira. Climbers usually take five to nine days to "
    "reach the summit, and most routes pass through five climate zones, from rainforest to arctic.",
    "The company's quarterly report shows revenue of 4.2 million dollars, up 12 percent from the same "
    "quarter last year. Operating costs rose by 5 percent, mainly because of new hires in the support "
    "team. The board approved a plan to open two new offices next year, in Lisbon and in Toronto.",
    "Sourdough bread is leavened by a starter, a mixture of flour and water that contains wild yeast "
    "and lactic acid bacteria. The bacteria give the bread its slightly sour taste. Bakers feed the "
    "starter regularly with fresh flour and water, and a healthy starter doubles in size within a few "
    "hours of feeding.",
    "The Apollo 11 mission launched on July 16, 1969. Four days later Neil Armstrong and Buzz Aldrin "
    "landed the lunar module Eagle on the Moon, while Michael Collins orbited above in the command "
    "module. The astronauts spent about two and a half hours outside the module and collected 21.5 "
    "kilograms of lunar samples before returning to Earth on July 24.",
]
RAG_QUESTIONS = [
    "What is the main topic of the context?",
    "Answer using only the context: what numbers are mentioned, and what do they describe?",
    "According to the context, what happens first and what happens next?",
    "Based on the context, write one question a reader might ask and answer it.",
    "What does the context say about time or dates?",
]
SUMMARY_TEMPLATES = [
    "Summarize the following text in two sentences.\n\n{x}",
    "List the key points of this text as bullet points.\n\n{x}",
    "Write a one-sentence summary of this text for a busy reader.\n\n{x}",
    "Rewrite this text in simpler words.\n\n{x}",
]
CODE_TASKS = [
    "reverses a string",
    "checks whether a number is prime",
    "returns the n-th Fibonacci number",
    "counts the words in a sentence",
    "removes duplicates from a list while keeping the order",
    "merges two sorted lists",
    "computes the average of a list of numbers",
    "finds the largest element in a list",
    "converts Celsius to Fahrenheit",
    "checks whether a string is a palindrome",
    "flattens a nested list",
    "reads a CSV file and returns its rows",
    "sorts a list of dictionaries by a key",
    "returns the factorial of a number",
    "counts how often each character appears in a string",
    "validates an email address with a regular expression",
    "splits a list into chunks of size n",
    "computes the greatest common divisor of two numbers",
    "capitalizes the first letter of every word",
    "returns the intersection of two lists",
    "checks whether two strings are anagrams",
    "converts a decimal number to binary",
    "returns the median of a list of numbers",
    "removes all whitespace from a string",
    "counts the lines in a text file",
    "finds the most common element in a list",
    "rotates a list by k positions",
    "checks whether parentheses in a string are balanced",
    "returns all even numbers from a list",
    "computes the sum of the digits of an integer",
    "converts a list of pairs into a dictionary",
    "finds the longest word in a sentence",
    "generates a random password of a given length",
    "transposes a matrix given as a list of lists",
    "computes the power set of a list",
    "computes the area of a circle from its radius",
    "reverses the order of words in a sentence",
    "returns the n smallest numbers in a list",
    "formats a number with thousands separators",
    "converts a string to snake_case",
]
CODE_TEMPLATES = [
    "Write a Python function that {x}.",
    "Write a Python function that {x}, with a docstring and type hints.",
    "Write a JavaScript function that {x}.",
    "Show me how to write a function that {x}, and explain each line.",
    "Write a Python function that {x}, and add a short usage example.",
    "Write a Python function that {x}. Keep it short.",
]
SNIPPETS = [
    "def f(xs):\n    out = []\n    for x in xs:\n        if x % 2 == 0:\n            out.append(x * x)\n    return out",
    "def g(s):\n    return s == s[::-1]",
    "def total(prices, tax):\n    return sum(p * (1 + tax) for p in prices)",
    "class Stack:\n    def __init__(self):\n        self.items = []\n"
    "    def push(self, x):\n        self.items.append(x)\n    def pop(self):\n        return self.items.pop()",
    "for i in range(1, 16):\n"
    "    print('FizzBuzz' if i % 15 == 0 else 'Fizz' if i % 3 == 0 else 'Buzz' if i % 5 == 0 else i)",
]
SNIPPET_TEMPLATES = [
    "Explain what this Python code does:\n```python\n{x}\n```",
    "Add comments to this code:\n```python\n{x}\n```",
    "Suggest an improvement to this code:\n```python\n{x}\n```",
]
CONTINUATIONS = [
    "The history of the printing press begins in the fifteenth century, when",
    "Once upon a time, in a small village by the sea, there lived",
    "The most important thing to remember when starting a small business is",
    "Photosynthesis is the process by which plants",
    "In the year 2050, cities will look very different because",
    "def binary_search(items, target):\n",
    "The recipe for a simple tomato soup is as follows.",
    "Dear hiring manager,\n\nI am writing to apply for",
    "Chapter 1\n\nThe rain had not stopped for three days when",
    "Here are the steps to set up a new Python project:",
    "The three laws of motion, formulated by Isaac Newton, state that",
    "import numpy as np\n\n",
]

Prompt = str | list[dict[str, str]] | list[int]


def _user(text: str) -> Prompt:
    return [{"role": "user", "content": text}]


def _turns(first: str, answer: str, second: str) -> Prompt:
    return [
        {"role": "user", "content": first},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": second},
    ]


def prompt_mix(seed: int = 0) -> list[tuple[str, Prompt]]:
    """Every built-in prompt as ``(kind, prompt)``, in a seeded order that interleaves the kinds."""
    kinds: dict[str, list[Prompt]] = {
        "chat": [_user(t.format(x=x)) for x in CHAT_TOPICS for t in CHAT_TEMPLATES],
        "multi_turn": [_turns(a, b, c) for a, b, c in MULTI_TURN],
        "rag": [_user(f"Context:\n{p}\n\nQuestion: {q}") for p in PASSAGES for q in RAG_QUESTIONS],
        "summarization": [_user(t.format(x=p)) for p in PASSAGES for t in SUMMARY_TEMPLATES],
        "code": [_user(t.format(x=x)) for x in CODE_TASKS for t in CODE_TEMPLATES]
        + [_user(t.format(x=s)) for s in SNIPPETS for t in SNIPPET_TEMPLATES],
        "continuation": [str(text) for text in CONTINUATIONS],
    }
    rng = random.Random(seed)
    for prompts in kinds.values():
        rng.shuffle(prompts)
    # interleave, weighted: chat and code (what the head is for) come most often
    weights = {"chat": 4, "multi_turn": 1, "rag": 2, "summarization": 2, "code": 4, "continuation": 1}
    mixed: list[tuple[str, Prompt]] = []
    cursors = dict.fromkeys(kinds, 0)
    while any(cursors[k] < len(kinds[k]) for k in kinds):
        for kind, weight in weights.items():
            for _ in range(weight):
                if cursors[kind] < len(kinds[kind]):
                    mixed.append((kind, kinds[kind][cursors[kind]]))
                    cursors[kind] += 1
    return mixed


def read_prompt_file(path: str) -> list[tuple[str, Prompt]]:
    """User prompts for ``--data``: JSON lines (``{"messages": [...]}`` or ``{"prompt": "..."}``) or plain lines.

    Raises:
        ValueError: the file holds no prompt, or a JSON line has neither key.
    """
    import json

    prompts: list[tuple[str, Prompt]] = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            line = line.strip()
            if not line:
                continue
            if line.startswith("{"):
                record: Any = json.loads(line)
                if isinstance(record.get("messages"), list):
                    prompts.append(("data", list(record["messages"])))
                elif isinstance(record.get("prompt"), str):
                    prompts.append(("data", _user(record["prompt"])))
                else:
                    raise ValueError(f"{path}:{number}: a JSON line needs 'messages' (a list) or 'prompt' (a string)")
            else:
                prompts.append(("data", _user(line.replace("\\n", "\n"))))
    if not prompts:
        raise ValueError(f"{path} holds no prompts (one per line, or JSON lines with 'messages' or 'prompt')")
    return prompts
