"""Byte-level BPE tokenizer for the demo model, wrapped as a transformers fast tokenizer.

Special tokens: ``<|endoftext|>`` (padding and document separator), ``<|im_start|>`` and
``<|im_end|>`` (end of a chat turn, the chat eos). The tool tags ``<tool_call>``,
``</tool_call>``, ``<tool_response>`` and ``</tool_response>`` are added tokens that are *not*
special, so ``decode(..., skip_special_tokens=True)`` keeps them for tool-call parsers. Digits are
split one per token, which makes copying numbers from a prompt easy for a small model.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from demo_model.chat_template import CHAT_TEMPLATE

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

_MARKER_RE = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS + TOOL_TOKENS))


def _base_tokenizer() -> Tokenizer:
    """Build an untrained byte-level BPE tokenizer (digits split individually)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def _strip_markers(texts: Iterable[str]) -> Iterator[str]:
    """Yield texts with special and tool markers removed, so BPE learns no merges inside them."""
    for text in texts:
        yield from (piece for piece in _MARKER_RE.split(text) if piece)


def wrap_tokenizer(tok: Tokenizer) -> PreTrainedTokenizerFast:
    """Wrap a ``tokenizers`` object as a transformers fast tokenizer with the chat template.

    Args:
        tok: A tokenizer that already contains the special and tool tokens.

    Returns:
        The wrapped tokenizer (no BOS added, ``<|endoftext|>`` as pad, ``<|im_end|>`` as eos).
    """
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=ENDOFTEXT,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        unk_token=None,
        additional_special_tokens=[IM_START],
        clean_up_tokenization_spaces=False,
        model_max_length=2048,
        add_bos_token=False,
        add_eos_token=False,
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def train_tokenizer(texts: Iterable[str], vocab_size: int = 4096) -> PreTrainedTokenizerFast:
    """Train the byte-level BPE on ``texts`` and wrap it.

    Args:
        texts: Training texts (prose and rendered chats); markers are stripped before training.
        vocab_size: Total vocabulary size including the special and added tokens.

    Returns:
        The trained, wrapped tokenizer.
    """
    tok = _base_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(TOOL_TOKENS),
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(_strip_markers(texts), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    return wrap_tokenizer(tok)


def template_renderer() -> PreTrainedTokenizerFast:
    """Return an untrained wrapped tokenizer, good only for rendering the chat template to text."""
    tok = _base_tokenizer()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    return wrap_tokenizer(tok)
