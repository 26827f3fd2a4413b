"""A prompt in, text out: the calls an engine answers, over the rounds it runs.

:class:`EngineCalls` holds :class:`~selfspec.SpeculativeEngine`'s ``generate``, ``generate_ids``,
``stream`` and ``stream_ids`` and the prompt encoding they share; the engine supplies its model
(:attr:`EngineCalls.runner`, :attr:`EngineCalls.tokenizer`) and how a request starts
(:meth:`EngineCalls._start`: validated, its rounds on the path they take).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..core.bounds import check_prompt_chars, check_tools_size, text_chars
from ..errors import ConfigurationError
from ..modeling.runner import ModelRunner
from .generation import Generation, GenerationRequest, GenerationStream, Prompt, encode_prompt
from .options import GenerateOptions
from .outputs import GenerationOutput

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from .options import GenerateKeywords


class EngineCalls:
    """The calls of :class:`~selfspec.SpeculativeEngine` (its base; see there).

    Attributes:
        runner: the target's runner (its context window bounds a prompt).
        tokenizer: the target's tokenizer, or ``None`` (token-level use only).
        escape_special_tokens: whether special-token strings in messages and tools are encoded as plain text.
    """

    runner: ModelRunner
    tokenizer: Any
    escape_special_tokens: bool

    def _start(self, request: GenerationRequest) -> Generation:
        """Validate a request, then set up its generation (nothing runs yet): the engine's own."""
        raise NotImplementedError

    # ----------------------------------------------------------------- prompts
    @property
    def context_window(self) -> int | None:
        """The model's maximum number of positions (prompt plus new tokens)."""
        return self.runner.max_positions

    def encode_prompt(
        self,
        prompt: Prompt,
        *,
        tools: list[dict[str, Any]] | None = None,
        escape_special_tokens: bool | None = None,
    ) -> list[int]:
        """Token ids of a prompt.

        A ``str`` is encoded as ``tokenizer(prompt)`` (default special tokens, no template);
        a list of ``{"role": ..., "content": ...}`` messages goes through the tokenizer's chat
        template with the generation prompt (and ``tools``, when given). With
        ``escape_special_tokens`` (``None``: the engine's setting, or ``True`` for this call)
        special-token strings in the messages and tools are encoded as plain text.
        """
        if tools:
            check_tools_size(list(tools))  # before the template renders them
        escape = self.escape_special_tokens or bool(escape_special_tokens)
        return encode_prompt(self._require_tokenizer("text prompts"), prompt, tools, escape_special_tokens=escape)

    def _encode_checked(self, prompt: Prompt, truncate_prompt: bool) -> list[int]:
        """:meth:`encode_prompt`, refusing first (unless ``truncate_prompt``) a text too long in characters to fit."""
        if not truncate_prompt:
            check_prompt_chars(text_chars(prompt), self._require_tokenizer("text prompts"), self.context_window)
        return self.encode_prompt(prompt)

    def _require_tokenizer(self, what: str) -> Any:
        if self.tokenizer is None:
            raise ConfigurationError(
                f"{what} need a tokenizer: pass tokenizer= to SpeculativeEngine, or use generate_ids"
            )
        return self.tokenizer

    # ----------------------------------------------------------------- public API
    def generate(
        self, prompt: Prompt, *, options: GenerateOptions | None = None, **keywords: Unpack[GenerateKeywords]
    ) -> GenerationOutput:
        """Generate text for a prompt.

        Args:
            prompt: text, or a list of chat messages (rendered by the chat template).
            options: the call's options as one value (:class:`~selfspec.decoding.options.GenerateOptions`);
                keywords given too replace its fields.
            **keywords: the fields of :class:`~selfspec.decoding.options.GenerateOptions`:
                ``max_new_tokens`` (default 256), ``temperature`` (0: greedy), ``top_k``, ``top_p``,
                ``stop``, ``seed``, ``constraint``, ``truncate_prompt`` and ``logprobs`` (each new
                token's log-probability and that many alternatives, :attr:`GenerationOutput.logprobs`).

        Returns:
            The text, new token ids, finish reason and speculation statistics.

        Raises:
            TypeError: an unknown keyword (the closest option is named).
        """
        chosen = GenerateOptions.of(options, keywords, "generate")
        return self.generate_ids(self._encode_checked(prompt, chosen.truncate_prompt), options=chosen)

    def generate_ids(
        self,
        prompt_ids: Sequence[int] | torch.Tensor,
        *,
        options: GenerateOptions | None = None,
        **keywords: Unpack[GenerateKeywords],
    ) -> GenerationOutput:
        """Like :meth:`generate`, from token ids (no tokenizer needed unless ``stop`` is given)."""
        chosen = GenerateOptions.of(options, keywords, "generate_ids")
        run = self._start(GenerationRequest.for_prompt(prompt_ids, chosen))
        for _ in run.deltas():
            pass
        return run.output()

    def stream(
        self, prompt: Prompt, *, options: GenerateOptions | None = None, **keywords: Unpack[GenerateKeywords]
    ) -> GenerationStream:
        """Stream the text of :meth:`generate` as ``str`` deltas (same arguments).

        The deltas join to exactly ``generate(...).text``. Call ``.close()`` to abandon the
        stream early; ``.stats`` and ``.output`` are set once it is exhausted or closed; with
        ``logprobs``, ``.logprobs`` holds the entries of the tokens generated so far.
        """
        chosen = GenerateOptions.of(options, keywords, "stream")
        return self.stream_ids(self._encode_checked(prompt, chosen.truncate_prompt), options=chosen)

    def stream_ids(
        self,
        prompt_ids: Sequence[int] | torch.Tensor,
        *,
        options: GenerateOptions | None = None,
        **keywords: Unpack[GenerateKeywords],
    ) -> GenerationStream:
        """Like :meth:`stream`, from token ids (a tokenizer is needed to produce text)."""
        chosen = GenerateOptions.of(options, keywords, "stream_ids")
        self._require_tokenizer("streams")
        return GenerationStream(self._start(GenerationRequest.for_prompt(prompt_ids, chosen)))
