r"""Checks of every argument a caller hands the engine, with messages that name the fix.

One place for the rules, so the engine, the command line, the server and the adapters give
the same answer to the same mistake:

- ``bool`` is not a number: ``True`` is refused wherever an int or a float is expected.
- Numbers are finite: ``inf`` and ``NaN`` are refused (``temperature=inf`` would sample
  uniform gibberish).
- Integers may be Python, NumPy or 0-d PyTorch integers; floats are never taken as ids or
  counts (``3.0`` is refused, not truncated).
- Size options have upper bounds checked when the engine is built, so a typo cannot ask for
  a 77 GB allocation on every call.
- Text must be encodable: a lone surrogate (``"a\ud800"``) is refused before the tokenizer
  sees it; ``bytes`` are refused with a hint to decode them first.

Every function raises a :mod:`selfspec.errors` class (all ``ValueError`` subclasses) and
returns the value normalised to plain Python types.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Sequence
from typing import Any

import torch

from ..errors import ConfigurationError, InvalidPromptError, SamplingError

#: Temperatures below this decode greedily (see :func:`check_temperature`).
GREEDY_TEMPERATURE = 1e-5
#: Largest token tree (``tree_nodes``): every call sizes attention masks and cache slots by it.
MAX_TREE_NODES = 1024
#: Largest draft length (``num_draft_tokens``).
MAX_DRAFT_TOKENS = 128
#: Largest ``max_new_tokens`` when the model declares no context window (the KV cache is
#: allocated for prompt + max_new_tokens up front).
MAX_NEW_TOKENS_WITHOUT_WINDOW = 1 << 20
#: Seeds are unsigned 64-bit integers (``torch.Generator.manual_seed``).
MAX_SEED = 2**64 - 1
#: The most stop strings a call may give (the matcher checks each one after every token; OpenAI allows 4).
MAX_STOP_STRINGS = 16
#: The longest stop string, in characters.
MAX_STOP_CHARS = 256
#: The most alternatives ``logprobs`` may ask for per token (OpenAI's ``top_logprobs`` bound).
MAX_LOGPROBS = 20

_SURROGATE = re.compile("[\ud800-\udfff]")


def _kind(value: Any) -> str:
    return type(value).__name__


def _is_bool(value: Any) -> bool:
    """``bool`` and NumPy's ``bool_`` (and 0-d bool tensors): never numbers here."""
    if isinstance(value, torch.Tensor):
        return value.dtype == torch.bool
    return isinstance(value, bool) or _kind(value) == "bool_"


def as_integer(value: Any) -> int | None:
    """``value`` as a Python int when it is an integer (Python, NumPy, 0-d integer tensor), else ``None``.

    Booleans and floats (even integral ones such as ``3.0``) are not integers.
    """
    if _is_bool(value):
        return None
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or value.dtype.is_floating_point or value.dtype.is_complex:
            return None
        return int(value.item())
    if isinstance(value, numbers.Integral):  # int and numpy.integer
        return int(value)
    return None


# ----------------------------------------------------------------------------- sampling
def as_real(value: Any) -> float | None:
    """``value`` as a Python float when it is a real number (not a bool, str or tensor of many values)."""
    if _is_bool(value) or isinstance(value, (str, bytes)):
        return None
    if isinstance(value, torch.Tensor):
        return float(value.item()) if value.dim() == 0 and not value.dtype.is_complex else None
    if isinstance(value, numbers.Real):
        return float(value)
    return None


def check_temperature(value: Any) -> float:
    """``0`` (greedy) or a finite positive number; below :data:`GREEDY_TEMPERATURE` it is ``0``.

    Dividing logits by a temperature such as ``1e-38`` (or a subnormal) overflows them to
    infinity; the distribution it asks for is, to float precision, all on the most likely token,
    so such temperatures decode greedily (vLLM draws the line at the same ``1e-5``).
    """
    temperature = as_real(value)
    if temperature is None or not math.isfinite(temperature) or temperature < 0:
        raise SamplingError(f"temperature must be >= 0 and finite (0 means greedy), got {_kind(value)} {value!r}")
    return 0.0 if temperature < GREEDY_TEMPERATURE else temperature


def check_top_k(value: Any) -> int | None:
    """``None``, or an int ``>= 0`` (0 and None: off)."""
    if value is None:
        return None
    top_k = as_integer(value)
    if top_k is None or top_k < 0:
        raise SamplingError(f"top_k must be an integer >= 0 (0 or None: off), got {_kind(value)} {value!r}")
    return top_k


def check_top_p(value: Any) -> float | None:
    """``None``, or a number in ``(0, 1]`` (1 and None: off)."""
    if value is None:
        return None
    top_p = as_real(value)
    if top_p is None or not 0.0 < top_p <= 1.0:  # NaN fails the comparison too
        raise SamplingError(f"top_p must be in (0, 1] (1 or None: off), got {_kind(value)} {value!r}")
    return top_p


def check_seed(value: Any) -> int | None:
    """``None`` or an int in ``[0, 2**64 - 1]``."""
    if value is None:
        return None
    seed = as_integer(value)
    if seed is None or not 0 <= seed <= MAX_SEED:
        raise SamplingError(f"seed must be None or an int in [0, 2**64 - 1], got {_kind(value)} {value!r}")
    return seed


def check_logprobs(value: Any) -> int | None:
    """``None`` (no log-probabilities), or an int in ``[0, MAX_LOGPROBS]``: alternatives per token."""
    if value is None:
        return None
    count = as_integer(value)
    if count is None or not 0 <= count <= MAX_LOGPROBS:
        raise SamplingError(
            f"logprobs must be None or an int in [0, {MAX_LOGPROBS}] (the most likely alternatives reported per "
            f"token), got {_kind(value)} {value!r}"
        )
    return count


def check_max_new_tokens(value: Any, context_window: int | None = -1, *, name: str = "max_new_tokens") -> int:
    """An int ``>= 1``, and at most ``2**20`` when ``context_window`` is ``None`` (the model declares none).

    The default ``-1`` means "the window is not known here": only the type and sign are checked.
    ``name`` is what the caller called the budget (``max_tokens`` in the adapters and the server):
    the error names it.
    """
    number = as_integer(value)
    if number is None or number < 1:
        raise SamplingError(f"{name} must be an int >= 1, got {_kind(value)} {value!r}")
    if context_window is None and number > MAX_NEW_TOKENS_WITHOUT_WINDOW:
        raise SamplingError(
            f"{name} must be at most {MAX_NEW_TOKENS_WITHOUT_WINDOW} for a model without a declared "
            f"context window (the KV cache is allocated up front), got {number}"
        )
    return number


def check_stop(stop: Any) -> list[str]:
    """``None``, a non-empty str, or a list/tuple of non-empty str, as a list."""
    if stop is None:
        return []
    if isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, (list, tuple)):
        stops = list(stop)
    else:
        raise SamplingError(f"stop must be a str or a list of non-empty str, got {_kind(stop)} {stop!r:.100}")
    if len(stops) > MAX_STOP_STRINGS:
        raise SamplingError(f"stop holds {len(stops)} strings; at most {MAX_STOP_STRINGS} are accepted")
    for item in stops:
        if not isinstance(item, str):
            raise SamplingError(f"stop strings must be str, got {_kind(item)}: {item!r}")
        if item == "":
            raise SamplingError("stop strings must not be empty (an empty stop would match at once)")
        if len(item) > MAX_STOP_CHARS:
            raise SamplingError(f"stop strings are at most {MAX_STOP_CHARS} characters long, got one of {len(item)}")
        check_text(item, "a stop string", error=SamplingError)
    return stops


# ----------------------------------------------------------------------------- engine options
def check_tree_nodes(value: Any) -> int | str | None:
    """``None`` (a chain), ``"auto"``, or an int in ``[1, MAX_TREE_NODES]``."""
    if value is None or (isinstance(value, str) and value == "auto"):
        return value
    nodes = as_integer(value)
    if nodes is None or not 1 <= nodes <= MAX_TREE_NODES:
        raise ConfigurationError(
            f"tree_nodes must be None, 'auto' or an int >= 1 and <= {MAX_TREE_NODES} (every call sizes its "
            f"attention mask and cache by it), got {_kind(value)} {value!r}"
        )
    return nodes


def check_num_draft_tokens(value: Any) -> int | str:
    """``"auto"`` or an int in ``[1, MAX_DRAFT_TOKENS]``."""
    if isinstance(value, str) and value == "auto":
        return "auto"
    number = as_integer(value)
    if number is None or not 1 <= number <= MAX_DRAFT_TOKENS:
        raise ConfigurationError(
            f"num_draft_tokens must be 'auto' or an int >= 1 and <= {MAX_DRAFT_TOKENS}, got {_kind(value)} {value!r}"
        )
    return number


# ----------------------------------------------------------------------------- prompts
def check_text(text: str, what: str = "the prompt", *, error: type[ValueError] = InvalidPromptError) -> str:
    r"""Refuse text that cannot be encoded as UTF-8 (lone surrogates such as ``"\ud800"``)."""
    match = None if text.isascii() else _SURROGATE.search(text)  # isascii: a fast C scan
    if match is not None:
        raise error(
            f"{what} contains a lone surrogate {match.group()!r} at character {match.start()}, which is not "
            "valid Unicode text; fix the string's encoding (e.g. decode bytes with 'utf-8')"
        )
    return text


def check_prompt(prompt: Any) -> None:
    """Refuse what cannot be a text prompt or a message list before the tokenizer sees it.

    ``bytes`` (a prompt, a message, or a message's content) are refused with "decode to str
    first"; text with lone surrogates is refused; messages must be dicts with a ``role``.
    Shape errors of other kinds (empty prompts, no chat template) are left to the caller.
    """
    if isinstance(prompt, (bytes, bytearray, memoryview)):
        raise InvalidPromptError(f"the prompt is {_kind(prompt)}; decode to str first (e.g. prompt.decode('utf-8'))")
    if isinstance(prompt, str):
        check_text(prompt)
        return
    if not isinstance(prompt, Sequence):
        return
    for i, message in enumerate(prompt):
        if isinstance(message, (bytes, bytearray, memoryview)):
            raise InvalidPromptError(
                f"chat message {i} is {_kind(message)}; a prompt is a str or a list of "
                "{'role': ..., 'content': str} dicts (decode to str first)"
            )
        if not isinstance(message, dict) or "role" not in message:
            raise InvalidPromptError(
                f"each chat message must be a dict with 'role' and 'content', got {_kind(message)} at index {i}: "
                f"{message!r:.200}"
            )
        content = message.get("content")
        if isinstance(content, (bytes, bytearray, memoryview)):
            raise InvalidPromptError(f"the content of chat message {i} is {_kind(content)}; decode to str first")
        if isinstance(content, str):
            check_text(content, f"the content of chat message {i}")


def check_prompt_ids(prompt_ids: Any, vocab_size: int) -> list[int]:
    """Token ids as a list of Python ints in ``[0, vocab_size)``.

    Accepts a list or tuple of ints (Python, NumPy or 0-d tensors), a 1-D (or ``[1, n]``)
    integer tensor or NumPy array. Float or bool ids are refused (never truncated).

    Raises:
        InvalidPromptError: an empty prompt, a wrong shape or dtype, or an id out of range.
    """
    if isinstance(prompt_ids, (str, bytes, bytearray)):
        raise InvalidPromptError(
            f"prompt_ids must be token ids (ints), got {_kind(prompt_ids)}; use generate() for text"
        )
    array_like = isinstance(prompt_ids, torch.Tensor) or _kind(prompt_ids) == "ndarray"
    if array_like:
        shape = tuple(prompt_ids.shape)
        dtype = str(prompt_ids.dtype)
        if len(shape) == 2 and shape[0] == 1:
            prompt_ids = prompt_ids[0]
            shape = shape[1:]
        if len(shape) != 1:
            raise InvalidPromptError(f"prompt_ids must be 1-D (or [1, n]); got shape {shape}")
        if "int" not in dtype or "bool" in dtype:
            raise InvalidPromptError(f"prompt_ids must hold integers, got dtype {dtype}")
        ids = [int(i) for i in prompt_ids.tolist()]
    elif isinstance(prompt_ids, Sequence):
        ids = []
        for position, token in enumerate(prompt_ids):
            number = as_integer(token)
            if number is None:
                raise InvalidPromptError(f"token ids must be ints, got {_kind(token)} {token!r} at position {position}")
            ids.append(number)
    else:
        raise InvalidPromptError(f"prompt_ids must be a list of ints or a 1-D integer tensor, got {_kind(prompt_ids)}")
    if not ids:
        raise InvalidPromptError("the prompt is empty: pass at least one token")
    for token in ids:
        if not 0 <= token < vocab_size:
            raise InvalidPromptError(f"token id {token!r} is not in the vocabulary [0, {vocab_size})")
    return ids
