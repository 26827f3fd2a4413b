"""Built-in prompt banks: calibration's mix, and the benchmark's sets, one per Spec-Bench category.

The passages are from Jane Austen's novels (public domain). Each prompt is a list of chat
messages (rendered by the model's chat template) or, for ``continuation``, plain text.
Calibration (:func:`selfspec.calibration.measure.default_prompts`) measures on
:data:`DEFAULT_CALIBRATION_PROMPTS` (models without a chat template) or
:data:`CHAT_CALIBRATION_PROMPTS` (chat models).
"""

from __future__ import annotations

from typing import Any

PASSAGES = [
    "Mr. Bingley arrived. Mrs. Bennet, through the assistance of servants, contrived to have the "
    "earliest tidings of it, that the period of anxiety and fretfulness on her side might be as long "
    "as it could. She counted the days that must intervene before their invitation could be sent; "
    "hopeless of seeing him before. But on the third morning after his arrival in Hertfordshire, she "
    "saw him, from her dressing-room window, enter the paddock and ride towards the house.",
    "Elinor thought it wisest to touch that point no more. She knew her sister's temper. Opposition "
    "on so tender a subject would only attach her the more to her own opinion. But by an appeal to "
    "her affection for her mother, by representing the inconveniences which that indulgent mother "
    "must draw on herself, Marianne was shortly subdued; and she promised not to tempt her mother to "
    "such imprudent kindness by mentioning the offer, and to tell Willoughby when she saw him next, "
    "that it must be declined.",
    "Lady Bertram seemed quite resigned to waiting. Fanny did not share her aunt's composure: she "
    "thought of the morrow a great deal, for if the three acts were rehearsed, Edmund and Miss "
    "Crawford would then be acting together for the first time; the third act would bring a scene "
    "between them which interested her most particularly, and which she was longing and dreading to "
    "see how they would perform.",
    "He made no answer; and soon afterwards, by the removal of the tea-things, and the arrangement of "
    "the card parties, the subject was necessarily dropped. Mrs. Jennings, who had watched them with "
    "pleasure while they were talking, saw him, with amazement, remain the whole evening more serious "
    "and thoughtful than usual.",
]


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


#: category -> prompts (a ``str`` is plain text; a list is chat messages).
PROMPT_SETS: dict[str, list[Any]] = {
    "multi_turn_chat": [
        [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Hello! Who is Mr. Darcy?"},
            {"role": "assistant", "content": "Mr. Darcy is a proud gentleman of Derbyshire."},
            {"role": "user", "content": "And what does Elizabeth think of him at first?"},
        ],
        [
            {"role": "user", "content": "Good morning. How should one behave at a ball?"},
            {"role": "assistant", "content": "With good humour, and with attention to one's partner."},
            {"role": "user", "content": "Tell me more about dancing at Netherfield."},
        ],
    ],
    "translation": [
        _user("Rewrite this sentence in plain modern words: " + PASSAGES[0].split(". ")[1] + "."),
        _user("Repeat after me: " + PASSAGES[2].split(":")[0] + "."),
    ],
    "summarization": [
        _user("Summarize the following passage.\n\n" + PASSAGES[0]),
        _user("Summarize the following passage.\n\n" + PASSAGES[1]),
    ],
    "qa": [
        _user("Who is the heroine of Pride and Prejudice?"),
        _user("What is a truth universally acknowledged?"),
    ],
    "reasoning": [
        _user("If Elizabeth has three sisters and each sister has one bonnet, how many bonnets are there?"),
        _user("Mr. Bennet has five daughters. Two marry. How many remain unmarried? Explain."),
    ],
    "rag": [
        _user("Context:\n" + PASSAGES[0] + "\n\n" + PASSAGES[3] + "\n\nQuestion: From where did Mrs. Bennet see him?"),
        _user("Context:\n" + PASSAGES[1] + "\n\n" + PASSAGES[2] + "\n\nQuestion: What did Marianne promise?"),
    ],
    "continuation": [
        "It is a truth universally acknowledged, that a single man in possession of a good fortune,",
        "Emma Woodhouse, handsome, clever, and rich, with a comfortable home and happy disposition,",
    ],
    # text the drafter cannot predict: the engine must fall back, not slow down
    "adversarial": [
        "xq7 Zv!k 93Jd wPo# 0ll Qe2 mm@ Kf9 trU5 %gh Lp0 vvX",
        _user("Continue this random sequence: 8f Kq 1z Wm 4r Tt 9p Xc 2b Yn 7g"),
    ],
}


# ----------------------------------------------------------------------------- stock models

ARTICLES = [
    "The Great Barrier Reef is the world's largest coral reef system. It lies in the Coral Sea, off the "
    "coast of Queensland, Australia, and stretches for over 2,300 kilometres. The reef is made of about "
    "2,900 individual reefs and 900 islands. It can be seen from outer space and is the largest single "
    "structure made by living organisms. It was selected as a World Heritage Site in 1981. Climate change, "
    "pollution and crown-of-thorns starfish are the main threats to its health.",
    "Photosynthesis is the process by which green plants turn light into chemical energy. Inside the "
    "chloroplasts, chlorophyll absorbs sunlight. The plant takes in carbon dioxide from the air through "
    "small pores called stomata, and water from the soil through its roots. Using the energy of light, it "
    "converts the carbon dioxide and water into glucose and releases oxygen as a by-product. The glucose is "
    "used for growth or stored as starch.",
    "The city library will close for renovation from March 1 to June 30. During this time, books can be "
    "returned at the community centre on Elm Street, which will also offer a small lending collection. "
    "Online services, including e-books and the catalogue, will stay available. The renovated library will "
    "have a new children's area, longer opening hours on weekends and twenty additional study rooms.",
]

_CODE = [
    "def average(values):\n    total = 0\n    for v in values:\n        total = total + v\n"
    "    return total / len(values)\n",
    "class Counter:\n    def __init__(self):\n        self.count = 0\n\n    def increment(self):\n"
    "        self.count = self.count + 1\n        return self.count\n",
]

#: Prompts for stock chat checkpoints (SmolLM2, Llama, Qwen, ...): category -> chat messages.
STOCK_PROMPT_SETS: dict[str, list[Any]] = {
    "rag": [
        _user(
            "Answer the question using only the context.\n\nContext:\n"
            + ARTICLES[0]
            + "\n\nQuestion: How long is the Great Barrier Reef, and what threatens it?"
        ),
        _user(
            "Answer the question using only the context.\n\nContext:\n"
            + ARTICLES[2]
            + "\n\nQuestion: Where can books be returned while the library is closed, and what will be new?"
        ),
    ],
    "summarization": [
        _user("Summarize the following text in a few sentences.\n\n" + ARTICLES[1]),
        _user("Summarize the following announcement.\n\n" + ARTICLES[2]),
    ],
    "chat": [
        _user("What are three good habits for staying healthy?"),
        [
            {"role": "user", "content": "I want to learn to cook. Where should I start?"},
            {"role": "assistant", "content": "Start with simple dishes like pasta, eggs and soups."},
            {"role": "user", "content": "What equipment do I need for those?"},
        ],
    ],
    "code": [
        _user("Rename the variable `total` to `running_sum` in this Python function:\n\n" + _CODE[0]),
        _user("Add a method `reset` that sets the count back to 0 to this Python class:\n\n" + _CODE[1]),
    ],
}

#: Other names accepted for a category of the built-in sets.
CATEGORY_ALIASES: dict[str, str] = {"chat": "multi_turn_chat", "multi_turn_chat": "chat"}


def as_plain_text(messages: list[dict[str, Any]]) -> str:
    """Chat messages as plain-text turns, ending where the assistant answers.

    For base checkpoints without a chat template (Gemma 3 270M): each message is a ``User: ...``
    or ``Assistant: ...`` paragraph, and a last ``Assistant:`` follows, so the built-in chat prompt
    sets run on them too.
    """
    turns = [f"{str(m.get('role', 'user')).capitalize()}: {m.get('content', '')}" for m in messages]
    return "\n\n".join([*turns, "Assistant:"])


# ----------------------------------------------------------------------------- calibration

#: Prose openings: the prompt mix for models without a chat template (and the demo model's).
DEFAULT_CALIBRATION_PROMPTS: tuple[str, ...] = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune,",
    "Emma Woodhouse, handsome, clever, and rich, with a comfortable home and happy disposition,",
    '"My dear Mr. Bennet," said his lady to him one day, "have you heard that',
    "The family of Dashwood had long been settled in Sussex. Their estate was large, and",
    "Sir Walter Elliot, of Kellynch Hall, in Somersetshire, was a man who, for his own amusement,",
    "No one who had ever seen Catherine Morland in her infancy would have supposed her born to be",
)

_NOTE = (
    "The museum opens at 9 am and closes at 5 pm from Tuesday to Sunday. It is closed on Mondays. "
    "Entry is free for children under twelve; adults pay eight euros. Guided tours start every hour "
    "at the main entrance and last forty-five minutes."
)
_STORY = (
    "Maria planted tomatoes, beans and basil in her small garden in April. In June the beans grew "
    "faster than she expected, so she built a trellis from old bamboo sticks. By August she had more "
    "tomatoes than her family could eat, and she gave the rest to her neighbours."
)

#: The prompt mix for chat models: something to copy (RAG, summary, code edit) and open chat.
CHAT_CALIBRATION_PROMPTS: tuple[list[dict[str, str]], ...] = (
    [{"role": "user", "content": f"Context:\n{_NOTE}\n\nQuestion: When is the museum open, and what does entry cost?"}],
    [{"role": "user", "content": f"Summarize this story in two sentences.\n\n{_STORY}"}],
    [
        {
            "role": "user",
            "content": "Add a docstring to this function:\n\ndef area(width, height):\n    return width * height\n",
        }
    ],
    [{"role": "user", "content": "What should I pack for a weekend hiking trip?"}],
    [{"role": "user", "content": "Explain in simple words why the sky is blue."}],
    [{"role": "user", "content": "Write a short, friendly message inviting a colleague to lunch."}],
)
