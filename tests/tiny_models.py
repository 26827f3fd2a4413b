"""Tiny random models of every supported architecture, built from transformers configs.

``agreeing=True`` scales the deeper layers' output projections down so that the early exits
agree with the last layer most of the time (drafts get accepted); otherwise a random model's
early exits almost never agree (drafts get rejected). Both paths must give exact text.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers

VOCAB = 96
#: A shape bitsandbytes quantizes on CPU: every linear's output size a multiple of 32 (its 4-bit rule).
QUANTIZABLE_SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
}
COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

ARCHITECTURES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    # a short window so that prompts + new tokens cross it
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 12}),
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        {"use_sliding_window": True, "sliding_window": 12, "max_window_layers": 3},
    ),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 8}),
    # default init makes a tiny Gemma repeat one token; a wider init gives varied text
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 8, "initializer_range": 0.3}),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {
            "head_dim": 8,
            "sliding_window": 12,
            "query_pre_attn_scalar": 8,
            "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0,
        },
    ),
    "gemma3_text": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {"head_dim": 8, "sliding_window": 12, "query_pre_attn_scalar": 8, "sliding_window_pattern": 2},
    ),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
}


def make_config(arch: str, **overrides: Any) -> Any:
    config_name, _, extra = ARCHITECTURES[arch]
    kwargs = {**COMMON, **extra, **overrides}
    return getattr(transformers, config_name)(**kwargs)


def make_model(
    arch: str,
    *,
    agreeing: bool = True,
    dtype: torch.dtype = torch.float64,
    seed: int = 0,
    **overrides: Any,
) -> Any:
    """A randomly initialised ``*ForCausalLM`` of ``arch``, in eval mode."""
    _, model_name, _ = ARCHITECTURES[arch]
    torch.manual_seed(seed)
    config = make_config(arch, **overrides)
    attn = "eager" if arch == "gemma2" else "sdpa"
    model = getattr(transformers, model_name)._from_config(config, attn_implementation=attn)
    model = model.to(dtype).eval()
    if agreeing:
        scale_deep_layers(model, start=1, factor=0.05)
    return model


def scale_deep_layers(model: Any, start: int, factor: float) -> None:
    """Shrink the residual contributions of layers ``>= start``.

    Pre-norm layers are scaled at their output projections; Gemma 2/3 normalise those outputs
    again (``post_*_layernorm``, weight used as ``1 + w``), so there the norms are scaled.
    """
    with torch.no_grad():
        for layer in model.model.layers[start:]:
            post_norms = [getattr(layer, n, None) for n in ("post_attention_layernorm", "post_feedforward_layernorm")]
            if getattr(layer, "post_feedforward_layernorm", None) is not None:
                for norm in post_norms:
                    norm.weight.copy_((1 + norm.weight) * factor - 1)
                continue
            for name, module in layer.named_modules():
                if name.endswith(("o_proj", "down_proj")) and hasattr(module, "weight"):
                    module.weight.mul_(factor)


def reference_greedy(model: Any, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy ``generate``: the output selfspec must equal."""
    ids = torch.tensor([prompt_ids])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        pad_token_id=model.config.pad_token_id,
        eos_token_id=model.config.eos_token_id,
    )
    return [int(t) for t in out[0, len(prompt_ids) :]]


def lean_and_module_logits(runner: Any, ids: Any) -> list[tuple[Any, Any]]:
    """``(prefill, 3-token step)`` logits of ``ids`` [1, n] through the runner's lean path, then its model's modules.

    The runner's lean layers are put back afterwards; the two pairs should be bit-identical in float32.
    """
    import torch

    n = ids.shape[1]
    outputs = []
    lean = runner.fast_layers
    try:
        for layers in (lean, None):
            runner.fast_layers = layers
            cache = runner.new_cache(n + 10)
            with torch.inference_mode():
                prefill = runner.run_layers(runner.embed(ids), 0, runner.num_layers, torch.arange(n), cache)
                step = runner.run_layers(runner.embed(ids[:, :3]), 0, runner.num_layers, torch.arange(n, n + 3), cache)
            outputs.append((runner.logits(prefill), runner.logits(step)))
    finally:
        runner.fast_layers = lean
    return outputs
