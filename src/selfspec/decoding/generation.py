"""One generation: the request, its state while it runs, and the stream of its text.

A :class:`GenerationRequest` carries everything a call asks for (prompt ids, sampling, stop
strings, seed, constraint, limits) and validates itself; a :class:`Generation` runs it
(rounds from the engine's loop or its batching scheduler), tracking the text, stop strings and
statistics; a :class:`GenerationStream` hands the text out as deltas.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..core.constraints import TokenConstraint
from ..core.sampling import SamplingParams
from ..core.validation import check_logprobs, check_max_new_tokens, check_prompt, check_prompt_ids, check_seed
from ..errors import ConfigurationError, GenerationMemoryError, InvalidPromptError
from .controller import DraftController
from .options import GenerateOptions
from .outputs import FinishReason, GenerationOutput, GenerationStats, TokenLogprob
from .stopping import IncrementalDetokenizer, StopStringMatcher, normalize_stop

#: A prompt: text, or a list of chat messages.
Prompt = str | Sequence[dict[str, Any]]

#: ``rounds(generation)``: decode, yielding each round's tokens; return the finish reason.
Rounds = Callable[["Generation"], Generator[list[int], None, FinishReason]]


@dataclass
class GenerationRequest(GenerateOptions):
    """What one call of ``generate`` / ``stream`` asks for: its prompt ids and its options.

    The options are :class:`~selfspec.decoding.options.GenerateOptions`' fields (``max_new_tokens``,
    ``temperature``, ``top_k``, ``top_p``, ``stop``, ``seed``, ``constraint``, ``truncate_prompt``,
    ``logprobs``).

    Attributes:
        prompt_ids: the prompt's token ids (a list, a 1-D tensor or a ``[1, n]`` tensor); a keyword.
    """

    prompt_ids: Sequence[int] | torch.Tensor = field(kw_only=True)

    @classmethod
    def for_prompt(cls, prompt_ids: Sequence[int] | torch.Tensor, options: GenerateOptions) -> GenerationRequest:
        """The request for ``prompt_ids`` with ``options``."""
        return cls(prompt_ids=prompt_ids, **options.as_dict())

    def checked_prompt(self, vocab_size: int) -> list[int]:
        """The prompt ids, validated (and ``max_new_tokens`` with them).

        Raises:
            InvalidPromptError: an empty or malformed prompt.
            SamplingError: a bad ``max_new_tokens``.
        """
        ids = check_prompt_ids(self.prompt_ids, vocab_size)  # numpy/torch ints accepted, floats refused
        self.max_new_tokens = check_max_new_tokens(self.max_new_tokens)
        return ids

    def fit_window(self, ids: list[int], context_window: int | None) -> list[int]:
        """The prompt ids, (with ``truncate_prompt``) cut to fit the context window.

        Raises:
            InvalidPromptError: the prompt plus ``max_new_tokens`` does not fit.
        """
        max_new_tokens = check_max_new_tokens(self.max_new_tokens, context_window)  # bounded without a window
        if context_window is not None and len(ids) + max_new_tokens > context_window:
            keep = context_window - max_new_tokens
            if self.truncate_prompt and keep >= 1:
                return ids[-keep:]  # left truncation: keep the end of the prompt, nearest the answer
            hint = "" if self.truncate_prompt else " (or pass truncate_prompt=True to keep only its end)"
            raise InvalidPromptError(
                f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                f"context window of {context_window} tokens; shorten the prompt or lower max_new_tokens{hint}"
            )
        return ids

    def sampling(self) -> SamplingParams:
        """The validated sampling parameters."""
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)

    def generator(self, device: torch.device) -> torch.Generator:
        """The call's random source, seeded with ``seed`` (or a random seed)."""
        seed = check_seed(self.seed)  # an int in [0, 2**64 - 1] or None
        generator = torch.Generator(device=device)
        generator.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, (1,))))
        return generator


def encode_prompt(
    tokenizer: Any, prompt: Prompt, tools: list[dict[str, Any]] | None = None, *, escape_special_tokens: bool = False
) -> list[int]:
    """Token ids of a prompt (see :meth:`SpeculativeEngine.encode_prompt`).

    With ``escape_special_tokens``, special-token strings in chat messages and tools are
    encoded as plain text (:mod:`selfspec.escaping`); a raw text prompt is encoded as given.
    """
    check_prompt(prompt)  # bytes ("decode to str first"), lone surrogates, non-dict messages
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidPromptError("the prompt is empty; pass some text")
        return list(tokenizer(prompt)["input_ids"])
    if not isinstance(prompt, Sequence) or not prompt:
        raise InvalidPromptError("the prompt must be a non-empty string or a non-empty list of chat messages")
    for message in prompt:
        if not isinstance(message, dict) or "role" not in message:
            raise InvalidPromptError(f"each chat message must be a dict with 'role' and 'content', got {message!r}")
    if getattr(tokenizer, "chat_template", None) is None:
        raise InvalidPromptError("this tokenizer has no chat template; pass a plain string prompt")
    if escape_special_tokens:
        from .escaping import render_escaped

        return render_escaped(tokenizer, [message for message in prompt if isinstance(message, dict)], tools)
    text = tokenizer.apply_chat_template(list(prompt), tools=tools, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def is_out_of_memory(error: BaseException) -> bool:
    """Whether an exception is an allocation failure (CUDA, or the CPU allocator)."""
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return True
    message = str(error)
    return "can't allocate memory" in message or "out of memory" in message.lower()


class Generation:
    """One generation's state: tokens so far, text tracking, stop strings, statistics.

    Args:
        rounds: the engine's decoding (``rounds(self)`` yields each round's tokens).
        tokenizer: the engine's tokenizer (``None``: no text).
        controller: the engine's draft-length controller; greedy text never depends on draft
            lengths, so greedy calls share it (timed); sampled calls get an untimed copy, so
            that a seed gives the same text.
        prompt_ids: the checked prompt ids.
        max_new_tokens: the most new tokens.
        params: the sampling parameters.
        stops: stop strings.
        generator: the random source.
        constraint: the call's constraint, if any.
        logprobs: ``None``, or the alternatives reported per token with its log-probability.
    """

    def __init__(
        self,
        rounds: Rounds,
        tokenizer: object,
        controller: DraftController,
        prompt_ids: list[int],
        max_new_tokens: int,
        params: SamplingParams,
        stops: list[str],
        generator: torch.Generator,
        constraint: TokenConstraint | None,
        logprobs: int | None = None,
    ) -> None:
        self._rounds = rounds
        self.top_logprobs = logprobs
        self.computed_logprobs: list[TokenLogprob] = []  # written by the loop, one per token it emits
        self.prompt_ids = prompt_ids
        self.max_new_tokens = max_new_tokens
        self.params = params
        self.generator = generator
        self.constraint = constraint
        self.stats = GenerationStats()
        if params.greedy:
            controller.start_call()
        self.controller = controller if params.greedy else controller.for_sampling()
        self.token_ids: list[int] = []
        self.text_parts: list[str] = []
        self.finish_reason: FinishReason | None = None
        self.detokenizer = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self.stop_matcher = StopStringMatcher(stops)
        self._started = 0.0
        self._finished = False

    @classmethod
    def start(
        cls,
        rounds: Rounds,
        tokenizer: object,
        controller: DraftController,
        request: GenerationRequest,
        vocab_size: int,
        context_window: int | None,
        device: torch.device,
    ) -> Generation:
        """Validate ``request`` and set up its generation (nothing runs yet)."""
        ids = request.checked_prompt(vocab_size)
        params = request.sampling()
        stops = normalize_stop(request.stop)
        if stops and tokenizer is None:
            raise ConfigurationError(
                "stop strings need a tokenizer: pass tokenizer= to SpeculativeEngine, or use generate_ids"
            )
        ids = request.fit_window(ids, context_window)
        generator = request.generator(device)
        logprobs = check_logprobs(request.logprobs)
        return cls(
            rounds,
            tokenizer,
            controller,
            ids,
            request.max_new_tokens,
            params,
            stops,
            generator,
            request.constraint,
            logprobs,
        )

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        """One entry per token in :attr:`token_ids` so far (``None`` unless the call asked for them).

        The loop computes the entries of a round's tokens before it hands the tokens out; tokens
        past a stop string are never added to :attr:`token_ids`, and their entries are left out.
        """
        if self.top_logprobs is None:
            return None
        return self.computed_logprobs[: len(self.token_ids)]

    def deltas(self) -> Generator[str, None, None]:
        """Run the generation, yielding text deltas (none without a tokenizer)."""
        self._started = time.perf_counter()
        rounds = self._rounds(self)
        try:
            while True:
                try:
                    tokens = next(rounds)
                except StopIteration as done:
                    self.finish_reason = done.value
                    break
                except (torch.OutOfMemoryError, MemoryError, RuntimeError) as error:
                    if not is_out_of_memory(error):
                        raise
                    raise self._memory_error(error) from error
                for token in tokens:
                    self.token_ids.append(token)
                    delta = self._push_text(token)
                    if delta:
                        yield delta
                    if self.stop_matcher.stopped:
                        self.finish_reason = "stop"
                        return
            tail = self._flush_text()
            if tail:
                yield tail
        finally:
            rounds.close()
            if self.finish_reason is None:
                self.finish_reason = "cancelled"
            self.finish()

    def _memory_error(self, error: BaseException) -> GenerationMemoryError:
        """The clear error for an allocation failure; the failed round's cache is already gone."""
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # hand the failed generation's blocks back
        return GenerationMemoryError(
            f"out of memory after {len(self.token_ids)} new tokens (prompt {len(self.prompt_ids)} tokens, "
            f"max_new_tokens {self.max_new_tokens}; the KV cache is sized for both up front). Lower "
            f"max_new_tokens, shorten the prompt, or load the model with quantization='4bit'/'8bit'. "
            f"The engine is still usable. Cause: {str(error).splitlines()[0][:200]}"
        )

    def _push_text(self, token: int) -> str:
        if self.detokenizer is None:
            return ""
        delta = self.stop_matcher.push(self.detokenizer.push(token))
        self.text_parts.append(delta)
        return delta

    def _flush_text(self) -> str:
        if self.detokenizer is None:
            return ""
        tail = self.stop_matcher.push(self.detokenizer.flush())
        tail += self.stop_matcher.flush()
        self.text_parts.append(tail)
        return tail

    def finish(self) -> None:
        """Close the books: tau, acceptance rate, tokens per second (once)."""
        if self._finished:
            return
        self._finished = True
        stats = self.stats
        elapsed = time.perf_counter() - self._started
        steps = stats.target_forwards - 1  # verify steps after the prefill
        decoded = max(0, len(self.token_ids) - 1)
        stats.mean_accepted_length = decoded / steps if steps > 0 else 1.0
        stats.acceptance_rate = stats.num_accepted / stats.num_drafted if stats.num_drafted else 0.0
        stats.tokens_per_second = len(self.token_ids) / elapsed if elapsed > 0 else 0.0

    def output(self) -> GenerationOutput:
        """The finished result."""
        assert self.finish_reason is not None
        return GenerationOutput(
            text="".join(self.text_parts) if self.detokenizer is not None else None,
            token_ids=list(self.token_ids),
            finish_reason=self.finish_reason,
            stats=self.stats,
            prompt_tokens=len(self.prompt_ids),
            logprobs=self.logprobs,
        )


class GenerationStream(Iterator[str]):
    """An iterator of text deltas from :meth:`SpeculativeEngine.stream`.

    Attributes:
        stats: the :class:`GenerationStats`, once the stream is exhausted or closed.
        output: the full :class:`GenerationOutput`, once the stream is exhausted or closed.
    """

    def __init__(self, run: Generation) -> None:
        self._run = run
        self._deltas = run.deltas()
        self.stats: GenerationStats | None = None
        self.output: GenerationOutput | None = None

    def __iter__(self) -> GenerationStream:
        return self

    def __next__(self) -> str:
        try:
            return next(self._deltas)
        except BaseException:  # StopIteration included: the stream is over
            self._complete()
            raise

    def close(self) -> None:
        """Stop generating (the KV cache is released); ``finish_reason`` becomes ``"cancelled"``."""
        self._deltas.close()
        if self._run.finish_reason is None:  # closed before it started
            self._run.finish_reason = "cancelled"
            self._run.finish()
        self._complete()

    @property
    def finish_reason(self) -> FinishReason | None:
        """``"stop"``, ``"length"`` or ``"cancelled"`` once finished, else ``None``."""
        return self._run.finish_reason if self.output is not None else None

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        """With ``logprobs=N``, one entry per token generated so far, else ``None``.

        The text so far may lag behind the tokens by a held-back character or stop-string prefix.
        """
        return self._run.logprobs

    def _complete(self) -> None:
        if self.output is None and self._run.finish_reason is not None:
            self.output = self._run.output()
            self.stats = self.output.stats

    def __enter__(self) -> GenerationStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"GenerationStream(finish_reason={self.finish_reason!r}, tokens={len(self._run.token_ids)})"
