"""The static round's target forward: fixed shapes, the cache length on the device (issue 26).

The eager loop (:mod:`selfspec.decoding.loop`) keeps the cache length in Python and hands each
forward exactly the keys it sees: right for a CPU, where every host read is free, but a GPU then
waits on the host between kernels and no graph can be captured (the shapes change every round).
Here everything a round's forward depends on is either a tensor on the device or one of a few
fixed sizes:

- :class:`DeviceKVCache`: one key and one value buffer per layer, allocated once per engine and
  reused by every call (grown, rarely, when a call needs more room); the text's length is a
  0-d tensor on the device. A forward writes its positions with ``index_copy_`` and attends over
  a fixed number of slots (the *bucket*: the call's room rounded up to a power of two), with a
  causal mask built on the device from the length. Rolling back is the acceptance setting the
  length (:func:`accept_greedy_step`); a rejected token's slots are overwritten next round.
- :class:`StaticStep`: the verify forward of a fixed *width* (the last token and ``width - 1``
  draft tokens, a shorter draft padded: padded rows are never accepted), followed by greedy
  acceptance on the device, compiled once per ``(width, bucket)`` with
  ``torch.compile(fullgraph=True, dynamic=False)`` when asked (``mode="reduce-overhead"``, CUDA
  graphs, on CUDA). Varying accepted lengths never recompile: they only change tensor values.

Exactness: the prefill is ``is_causal`` attention over the prompt, as transformers' ``generate``;
the rounds attend through a mask over the bucket, so in float32 a row's bits may differ from a
one-token decode's in the last place (argmax ties aside, the text is ``generate``'s, and the tests
check it); in half precision this path is not batch-invariant (the eager loop's row calls are),
which is why it runs only where asked or on CUDA (see ``docs/static_round.md``). With
:attr:`ModelRunner.row_kernels` (``row_exact=``) every step runs through the row-invariant kernels
instead (:mod:`selfspec.modeling.kernels`): a row's bits then do not depend on the step's width.

Only the lean layer path (:mod:`selfspec.modeling.fastpath`) runs here. A quantized target runs
it too (bitsandbytes' layers called as modules), at the widths where its kernels give a row of a
block the bits it gets alone (:func:`exact_widths`), so that quantization adds no difference
between a verify's rows and a one-token step's to the one a float32 round already has (above). On
this CPU an NF4 target keeps every width, and its greedy text equals its own plain decoding and
``generate`` (``tests/exact/test_decoding_static_quantized.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from .attention import PREFILL, AttentionPlan
from .fastpath import layer_forward, row_invariant_widths
from .runner import SLIDING_ATTENTION, ModelRunner

#: the draft widths a round may verify (the last token plus ``width - 1`` drafts).
WIDTHS = (1, 2, 3, 5, 9, 17, 33)
#: the fewest slots a bucket holds.
MIN_BUCKET = 256

logger = logging.getLogger(__name__)


def static_round_supported(runner: ModelRunner) -> str | None:
    """Why ``runner``'s model cannot run the static round, or ``None`` when it can."""
    if runner.fast_layers is None:
        return "the static round needs the lean layer path (Llama, Mistral, Qwen2/3, Phi-3 with SDPA)"
    return None


def exact_widths(runner: ModelRunner) -> tuple[int, ...]:
    """The widths of :data:`WIDTHS` a round of ``runner``'s model verifies at.

    Every width for plain ``nn.Linear`` layers. A quantized layer's kernel (called as a module) may
    compute a row of a block otherwise than the row alone, and the round's plain decoding (width 1)
    would then not produce the speculative text: the widths stop before the first one at which a
    layer's kernel is not row-invariant (:func:`~selfspec.modeling.fastpath.row_invariant_widths`,
    probed once per module class, shape and dtype). On this CPU an NF4 target keeps every width;
    an 8-bit one (LLM.int8's outlier columns are chosen over the whole block) keeps width 1 only.
    """
    assert runner.fast_layers is not None, static_round_supported(runner)
    kinds = {(type(m), m.in_features, m.out_features): m for w in runner.fast_layers for m in w.modules}
    widths: tuple[int, ...] = WIDTHS
    for module in kinds.values():
        kept = row_invariant_widths(module, runner.dtype, widths)
        if kept != widths:
            logger.warning(
                "static round: drafting at most %d tokens a round (%s is not row-invariant at width %d here)",
                kept[-1] - 1,
                type(module).__name__,
                widths[len(kept)],
            )
        widths = kept
    return widths


def width_for(num_draft: int) -> int:
    """The smallest fixed width that holds the last token and ``num_draft`` drafts."""
    for width in WIDTHS:
        if width >= num_draft + 1:
            return width
    raise ValueError(f"a static round drafts at most {WIDTHS[-1] - 1} tokens, got {num_draft}")


def bucket_for(slots: int) -> int:
    """The slots a forward attends over: ``slots`` rounded up to a power of two (at least :data:`MIN_BUCKET`)."""
    bucket = MIN_BUCKET
    while bucket < slots:
        bucket *= 2
    return bucket


class DeviceKVCache:
    """One engine's KV cache whose length lives on the device.

    Args:
        runner: the target's runner (its lean layers give the buffers' shapes).
        max_length: slots per layer (every call's prompt, new tokens and widest draft must fit).

    Attributes:
        length: 0-d ``long`` tensor on the device: positions holding the text.
    """

    is_compileable = True
    batched: Literal[False] = False  # one generation's (KVCache.batched)

    def __init__(self, runner: ModelRunner, max_length: int) -> None:
        assert runner.fast_layers is not None, static_round_supported(runner)
        self.max_length = max_length
        self.num_layers = runner.num_layers
        device, dtype = runner.device, runner.dtype
        self.keys = [
            torch.zeros(1, w.num_kv_heads, max_length, w.head_dim, dtype=dtype, device=device)
            for w in runner.fast_layers
        ]
        self.values = [torch.zeros_like(k) for k in self.keys]
        self.length = torch.zeros((), dtype=torch.long, device=device)
        if device.type == "cuda":  # graph-captured steps read and write these in place
            for buffer in self.static_buffers():
                torch._dynamo.mark_static_address(buffer)

    def static_buffers(self) -> list[torch.Tensor]:
        """Every tensor a step mutates in place: the keys, the values and the length.

        On CUDA each is marked a static address: inductor runs a step that mutates any other input
        without CUDA graphs ("skipping cudagraphs due to mutated inputs"). The first GPU check
        (H100, 2026-12-05) found the length unmarked, and every static-round step launched its
        kernels one by one.
        """
        return [*self.keys, *self.values, self.length]

    def __repr__(self) -> str:
        return f"DeviceKVCache(num_layers={self.num_layers}, max_length={self.max_length})"

    def crop_to(self, length: int, layers: range | None = None) -> None:
        """Nothing to do: the acceptance set :attr:`length` on the device (the loop's rollback)."""


@dataclass
class _Writes:
    """One forward's view of a :class:`DeviceKVCache`: where its states go and how many slots it sees."""

    cache: DeviceKVCache
    slots: torch.Tensor  # [q] the positions written
    visible: int  # the slots attended over (the bucket, or the prompt for a prefill)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.cache.keys[layer_idx], self.cache.values[layer_idx]
        keys.index_copy_(2, self.slots, key_states)
        values.index_copy_(2, self.slots, value_states)
        return keys[:, :, : self.visible], values[:, :, : self.visible]


def _layers(
    runner: ModelRunner,
    hidden: torch.Tensor,
    positions: torch.Tensor,
    plans: dict[str, AttentionPlan],
    cache: Any,
    layers: range | None = None,
    feature_layers: tuple[int, ...] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The lean layers ``layers`` (all of them by default) over ``[1, q, hidden]`` at ``[q]`` positions.

    Returns:
        The ``[1, q, hidden]`` last layer's output, and the states the drafter reads: that
        output again, or with ``feature_layers`` (EAGLE-3's taps) the states *entering* those
        layers (``i == num_layers``: the last layer's output), concatenated in that order into
        ``[1, q, len(feature_layers) * hidden]``, as the eager verifier hands them over
        (:func:`selfspec.decoding.verify.drafter_states`).
    """
    assert runner.fast_layers is not None
    cos, sin = runner.rotary(hidden, positions[None])
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [1, 1, q, head_dim]: broadcast over heads
    taps: dict[int, torch.Tensor] = {}
    wanted = set(feature_layers or ())
    for i in layers if layers is not None else range(runner.num_layers):
        if i in wanted:  # EAGLE-3 tap: the state entering layer i
            taps[i] = hidden
        hidden = layer_forward(runner.fast_layers[i], hidden, cos, sin, plans[runner.layer_types[i]], cache, i)
    if not feature_layers:
        return hidden, hidden
    taps[runner.num_layers] = hidden  # a tap of index L: the last layer's output (before the final norm)
    missing = [i for i in feature_layers if i not in taps]
    if missing:
        raise ValueError(f"feature layers {missing} are not among the layers this forward runs")
    return hidden, torch.cat([taps[i] for i in feature_layers], dim=-1)


def _masked_plans(runner: ModelRunner, positions: torch.Tensor, visible: int) -> dict[str, AttentionPlan]:
    """A ``[1, 1, q, visible]`` mask per layer type: slot ``j`` (position ``j``) seen from ``positions``, causally.

    Sliding-window layers also hide slots at or before ``position - window``.
    """
    slots = torch.arange(visible, device=positions.device)[None, :]
    query = positions[:, None]
    causal = slots <= query  # [q, visible]
    plans = {}
    for layer_type in set(runner.layer_types):
        allowed = causal
        if layer_type == SLIDING_ATTENTION and runner.sliding_window is not None:
            allowed = causal & (slots > query - runner.sliding_window)
        plans[layer_type] = AttentionPlan(mask=allowed[None, None])
    return plans


def _kernel_plans(runner: ModelRunner, past: int | torch.Tensor) -> dict[str, AttentionPlan] | None:
    """With :attr:`ModelRunner.row_kernels`, every layer through the row-invariant kernels after ``past`` keys."""
    if not runner.row_kernels:
        return None
    return dict.fromkeys(set(runner.layer_types), AttentionPlan(kernel_past=past))


def _logits(runner: ModelRunner, hidden: torch.Tensor) -> torch.Tensor:
    """``[1, q, hidden]`` -> ``[q, vocab]`` float32 logits (final norm, LM head, softcap)."""
    normed = runner.norm(hidden)
    head = runner.lm_head
    if runner.row_kernels and isinstance(head, torch.nn.Linear):  # as the eager loop's (a plain nn.Linear head)
        from .kernels import linear as row_invariant_linear

        return runner.softcap(row_invariant_linear(normed, head.weight, head.bias)).float()[0]
    return runner.softcap(head(normed)).float()[0]


def static_prefill(
    runner: ModelRunner, cache: DeviceKVCache, ids: torch.Tensor, feature_layers: tuple[int, ...] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt ``[1, n]`` into slots ``0 .. n - 1`` (``is_causal``, as ``generate``); sets the length to ``n``.

    Returns:
        Every position's ``[1, n, hidden]`` last-layer output (with ``feature_layers``, the
        concatenated states entering those layers: :func:`_layers`) and the last position's
        ``[vocab]`` logits.
    """
    num = ids.shape[1]
    positions = torch.arange(num, device=ids.device)
    plans = _kernel_plans(runner, 0)
    if plans is None:
        plans = _masked_plans(runner, positions, num)  # windowed layers over a longer prompt keep their mask
        windowed = runner.sliding_window is not None and num > runner.sliding_window
        plans.update({t: PREFILL for t in set(runner.layer_types) if t != SLIDING_ATTENTION or not windowed})
    writes = _Writes(cache, positions, num)
    hidden, states = _layers(runner, runner.embed(ids), positions, plans, writes, feature_layers=feature_layers)
    cache.length.fill_(num)
    return states, _logits(runner, hidden[:, -1:])[0]


def verify_step(
    runner: ModelRunner,
    cache: DeviceKVCache,
    rows: torch.Tensor,
    bucket: int,
    exit_layer: int = 0,
    feature_layers: tuple[int, ...] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One fixed-width forward at positions ``length ..`` over ``bucket`` slots.

    Args:
        runner: the target's runner (lean layer path).
        cache: the engine's cache; the forward writes positions ``length .. length + w - 1``.
        rows: ``[1, w]`` token ids, or with ``exit_layer`` the early exit's ``[1, w, hidden]``
            states at that layer (the last token, then the drafts), whose first layers' keys and
            values :func:`exit_draft_step` already wrote: the forward runs layers ``[exit_layer, L)``.
        bucket: the slots attended over.
        exit_layer: the first layer to run (``0``: every layer, from the token ids).
        feature_layers: EAGLE-3's taps: the states handed back are those entering these layers.

    Returns:
        The ``[1, w, hidden]`` last-layer outputs (with ``feature_layers``, the
        ``[1, w, len(feature_layers) * hidden]`` tapped states) and ``[w, vocab]`` float32 logits.
    """
    width = rows.shape[1]
    positions = cache.length + torch.arange(width, device=rows.device)  # [w]
    plans = _kernel_plans(runner, cache.length) or _masked_plans(runner, positions, bucket)  # slot j: position j
    hidden = rows if exit_layer else runner.embed(rows)
    layers = range(exit_layer, runner.num_layers)
    writes = _Writes(cache, positions, bucket)
    hidden, states = _layers(runner, hidden, positions, plans, writes, layers, feature_layers)
    return states, _logits(runner, hidden)


def exit_draft_step(
    runner: ModelRunner, cache: DeviceKVCache, token: torch.Tensor, offset: torch.Tensor, exit_layer: int, bucket: int
) -> torch.Tensor:
    """The early exit's draft forward: layers ``[0, exit_layer)`` on one ``[1, 1]`` token, no host read.

    The token sits at position ``length + offset`` (``offset``: a 0-d tensor, the draft step); its
    keys and values go into that slot of the layers it runs, where the round's verify
    (:func:`verify_step` from ``exit_layer``) and, once accepted, every later forward reads them: the early
    exit's KV reuse. Returns the ``[1, 1, hidden]`` exit state.
    """
    positions = (cache.length + offset).view(1)
    plans = _kernel_plans(runner, positions) or _masked_plans(runner, positions, bucket)
    writes = _Writes(cache, positions, bucket)
    state, _ = _layers(runner, runner.embed(token), positions, plans, writes, range(exit_layer))
    return state


def accept_greedy_step(
    cache: DeviceKVCache, tokens: torch.Tensor, num_draft: torch.Tensor, logits: torch.Tensor
) -> torch.Tensor:
    """Greedy acceptance on the device; moves the cache length past the accepted text.

    Args:
        cache: the cache the forward wrote (its length becomes ``length + accepted + 1``).
        tokens: ``[1, w]`` the last token, then the drafts (padded).
        num_draft: 0-d: how many drafts are real (rows after them are never accepted).
        logits: ``[w, vocab]`` the forward's logits.

    Returns:
        ``[2]``: the accepted count and the next (recovered or bonus) token.
    """
    width = tokens.shape[1]
    predicted = logits.argmax(dim=-1)  # [w]
    real = torch.arange(width - 1, device=tokens.device) < num_draft
    matches = ((tokens[0, 1:] == predicted[:-1]) & real).long()
    accepted = matches.cumprod(dim=0).sum().view(1)
    cache.length.add_(accepted[0] + 1)
    return torch.cat([accepted, predicted.gather(0, accepted)])


def accept_sampled_step(
    tokens: torch.Tensor,
    num_draft: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """:func:`~selfspec.core.acceptance.accept_sampled` on the device, over a padded draft (no host read).

    The same rule (accept ``d_i`` when ``u * q(d_i) < p(d_i)``; on rejection sample the normalised
    residual, after a full acceptance the bonus row), so the emitted tokens follow the target's
    distribution exactly. It always draws ``w - 1`` uniforms, whatever the draft's real length:
    a seeded call's text differs from the eager loop's (same distribution).

    Returns:
        ``[2]``: the accepted count and the recovered or bonus token.
    """
    width = tokens.shape[1]
    drafts = tokens[0, 1:]  # [w - 1]
    rows = torch.arange(width - 1, device=tokens.device)
    target_of_draft = target_probs[rows, drafts]
    draft_of_draft = torch.ones_like(target_of_draft) if draft_probs is None else draft_probs[rows, drafts]
    uniform = torch.rand(width - 1, generator=generator, device=tokens.device, dtype=target_probs.dtype)
    kept = (uniform * draft_of_draft < target_of_draft) & (rows < num_draft)
    accepted = kept.long().cumprod(dim=0).sum().view(1)
    target_row = target_probs.index_select(0, accepted)[0]  # [vocab]
    if draft_probs is None:
        rejected = tokens[0].index_select(0, (accepted + 1).clamp(max=width - 1))  # the first rejected draft
        draft_row = torch.zeros_like(target_row).scatter_(0, rejected, 1.0)
    else:
        padded = torch.cat([draft_probs, torch.zeros_like(draft_probs[:1])])  # a full acceptance: no draft row
        draft_row = padded.index_select(0, accepted)[0]
    bonus = accepted == num_draft  # every real draft kept: the target's own row, unchanged
    residual = torch.clamp(target_row - torch.where(bonus, torch.zeros_like(draft_row), draft_row), min=0)
    total = residual.sum()
    recovered = torch.where(total > 0, residual / total.clamp_min(torch.finfo(residual.dtype).tiny), target_row)
    token = torch.multinomial(recovered[None], num_samples=1, generator=generator)[0]
    return torch.cat([accepted, token])


@dataclass
class StaticStep:
    """The static round's forwards for one engine: its :class:`DeviceKVCache` and compiled steps.

    Args:
        runner: the target's runner (:func:`static_round_supported` must hold).
        backend: ``None`` runs the steps eagerly; else a ``torch.compile`` backend
            (``"inductor"``, or ``"aot_eager"`` / ``"eager"`` to test tracing without code generation).

    Attributes:
        cache: the engine's cache (``None`` until the first call).
        compiled: the compiled greedy step of each ``(width, bucket)`` (``"sampled"`` steps: the forward only).
        widths: the widths its rounds verify at (:func:`exact_widths`: all of :data:`WIDTHS` but
            where a quantized layer's kernel is not row-invariant).
    """

    runner: ModelRunner
    backend: str | None = None
    cache: DeviceKVCache | None = None
    compiled: dict[tuple[str, int, int], Callable[..., Any]] = field(default_factory=dict)
    widths: tuple[int, ...] = field(init=False)
    _offsets: list[torch.Tensor] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self.widths = exact_widths(self.runner)

    @property
    def max_drafts(self) -> int:
        """The most drafts a round verifies: the widest of :attr:`widths`, less the last token."""
        return self.widths[-1] - 1

    def offsets(self) -> list[torch.Tensor]:
        """0-d ``long`` tensors ``0 .. WIDTHS[-1] - 1`` on the device, made once: draft steps' offsets."""
        if not self._offsets:
            device = self.runner.device
            self._offsets = [torch.full((), j, dtype=torch.long, device=device) for j in range(WIDTHS[-1])]
        return self._offsets

    def __repr__(self) -> str:
        widths = "" if self.widths == WIDTHS else f", widths={self.widths}"
        return f"StaticStep(backend={self.backend!r}{widths}, cache={self.cache!r}, steps={sorted(self.compiled)})"

    def reserve(self, slots: int) -> DeviceKVCache:
        """The engine's cache, (re)made with room for ``slots`` when it has less."""
        if self.cache is None or self.cache.max_length < slots:
            self.cache = DeviceKVCache(self.runner, bucket_for(slots))
            self.compiled.clear()  # new buffers: new graphs
        return self.cache

    def prepare(
        self,
        slots: int,
        widths: tuple[int, ...] | None = None,
        kinds: tuple[str, ...] = ("greedy",),
        exit_layer: int | None = None,
        adapter: Callable[[torch.Tensor], torch.Tensor] | None = None,
        feature_layers: tuple[int, ...] | None = None,
    ) -> None:
        """Compile (or trace) the steps a call of ``slots`` slots may use, ahead of its first round.

        ``widths``: :attr:`widths` by default. ``kinds``: ``"greedy"`` and/or ``"forward"`` (sampled
        rounds). With ``exit_layer``, the early exit's steps instead: its draft steps (with
        ``adapter``) and its verify of each width.
        With ``feature_layers`` (EAGLE-3), the verify steps that hand back those layers' inputs.
        Each step runs once on padding at the cache's current length, which is restored after:
        the cache's text is untouched (a draft step's slots are past it).
        """
        cache = self.reserve(slots)
        bucket = bucket_for(slots)
        saved = cache.length.clone()
        device = self.runner.device
        with torch.inference_mode():  # the rounds' tensors are inference tensors: so are these (no recompile)
            zero = torch.zeros((), dtype=torch.long, device=device)
            if exit_layer is not None:
                token = torch.zeros(1, 1, dtype=torch.long, device=device)
                self.exit_draft(token, zero, exit_layer, bucket, adapter=adapter)
                self.exit_draft(token, zero, exit_layer, bucket, logits=False)
            for width in self.widths if widths is None else widths:
                tokens = torch.zeros(1, width, dtype=torch.long, device=device)
                exits: tuple[torch.Tensor | None, int] = (None, 0)
                if exit_layer is not None:
                    hidden = self.runner.config.hidden_size
                    exits = (torch.zeros(1, width, hidden, dtype=self.runner.dtype, device=device), exit_layer)
                for kind in kinds:
                    if kind == "greedy":
                        self.greedy(tokens, zero, bucket, *exits, feature_layers=feature_layers)
                    else:
                        self.forward(tokens, bucket, *exits, feature_layers=feature_layers)
                    cache.length.copy_(saved)

    def greedy(
        self,
        tokens: torch.Tensor,
        num_draft: torch.Tensor,
        bucket: int,
        exit_states: torch.Tensor | None = None,
        exit_layer: int = 0,
        feature_layers: tuple[int, ...] | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """Verify ``[1, w]`` tokens and accept greedily: ``([accepted, next], hidden, logits)``.

        With the early exit's ``exit_states`` (``[1, w, hidden]`` at ``exit_layer``), the forward
        continues from them (:func:`verify_step`). With ``feature_layers`` (EAGLE-3), ``hidden``
        is the concatenated states entering those layers.
        """
        rows = tokens if exit_states is None else exit_states
        return self._step("greedy", tokens.shape[1], bucket, exit_layer, feature_layers)(tokens, rows, num_draft)

    def forward(
        self,
        tokens: torch.Tensor,
        bucket: int,
        exit_states: torch.Tensor | None = None,
        exit_layer: int = 0,
        feature_layers: tuple[int, ...] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Verify ``[1, w]`` tokens (or exit states): ``(hidden, logits)`` (a sampled round accepts after it)."""
        rows = tokens if exit_states is None else exit_states
        return self._step("forward", tokens.shape[1], bucket, exit_layer, feature_layers)(rows)

    def exit_draft(
        self,
        token: torch.Tensor,
        offset: torch.Tensor,
        exit_layer: int,
        bucket: int,
        logits: bool = True,
        adapter: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:func:`exit_draft_step` on a ``[1, 1]`` token: ``(exit state, [vocab] draft logits)``.

        The LM head reads the exit state, or ``adapter`` of it (the early exit's trained adapter);
        ``logits=False`` skips it (the chain's last token: only its state is needed). One
        compiled step per exit layer, bucket, and adapter.
        """
        name = "exit_state" if not logits else "exit_draft" if adapter is None else f"exit_draft+adapter{id(adapter)}"
        key = (f"{name}@{exit_layer}", 1, bucket)
        if key not in self.compiled:
            runner, cache = self.runner, self._cache()

            def draft(token: torch.Tensor, offset: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
                state = exit_draft_step(runner, cache, token, offset, exit_layer, bucket)
                if not logits:
                    return state, None
                return state, _logits(runner, state if adapter is None else adapter(state))[0]

            # no CUDA graphs: a round keeps every draft step's exit state, and a graph's replay
            # would overwrite the last one's outputs (untried on a GPU)
            self.compiled[key] = self._maybe_compiled(draft, graphs=False)
        return self.compiled[key](token, offset)

    def _cache(self) -> DeviceKVCache:
        assert self.cache is not None, "reserve() before a step"
        return self.cache

    def _maybe_compiled(self, step: Callable[..., Any], graphs: bool = True) -> Callable[..., Any]:
        return step if self.backend is None else _compiled(step, self.backend, self.runner.device, graphs)

    def _step(
        self, kind: str, width: int, bucket: int, exit_layer: int = 0, feature_layers: tuple[int, ...] | None = None
    ) -> Callable[..., Any]:
        """The ``greedy`` or ``forward`` step of this width and bucket.

        Named ``<kind>``, ``exit_<kind>@E`` from ``exit_layer``, ``<kind>+taps1,3,6`` with EAGLE-3's
        ``feature_layers``.
        """
        name = f"exit_{kind}@{exit_layer}" if exit_layer else kind
        if feature_layers:
            name += "+taps" + ",".join(str(i) for i in feature_layers)
        key = (name, width, bucket)
        if key not in self.compiled:
            runner, cache = self.runner, self._cache()

            def forward(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                return verify_step(runner, cache, rows, bucket, exit_layer, feature_layers)

            def greedy(tokens: torch.Tensor, rows: torch.Tensor, num_draft: torch.Tensor) -> tuple[torch.Tensor, ...]:
                hidden, logits = verify_step(runner, cache, rows, bucket, exit_layer, feature_layers)
                return accept_greedy_step(cache, tokens, num_draft, logits), hidden, logits

            self.compiled[key] = self._maybe_compiled(greedy if kind == "greedy" else forward)
        return self.compiled[key]


def _compiled(step: Callable[..., Any], backend: str, device: torch.device, graphs: bool = True) -> Callable[..., Any]:
    """``torch.compile`` of one step: whole graph, static shapes; CUDA graphs with inductor on CUDA.

    Each ``(kind, width, bucket)`` gets its own compiled function; dynamo keys its cache on the
    step's code, so the limit on cached graphs per code object is raised to hold them all.
    """
    limit = len(WIDTHS) * 4 * 8
    if torch._dynamo.config.recompile_limit < limit:
        torch._dynamo.config.recompile_limit = limit
    if torch._dynamo.config.accumulated_recompile_limit < limit * 4:
        torch._dynamo.config.accumulated_recompile_limit = limit * 4
    mode = "reduce-overhead" if graphs and backend == "inductor" and device.type == "cuda" else None
    return torch.compile(step, backend=backend, fullgraph=True, dynamic=False, mode=mode)
