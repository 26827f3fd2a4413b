"""Cost curves on the hardware at hand: what verification and drafting cost, per precision.

For a randomly initialised model of a given shape (weights need not be trained: costs do not
depend on them) and each precision (bf16, bitsandbytes NF4, 8-bit), it measures through
selfspec's own model adapter:

* the verify-cost curve: time of a 1, 2, 4, 8, 16-token forward of all layers, relative to a
  1-token forward (with a few hundred cached positions);
* the draft cost ratio per exit layer: layers ``[0, E)`` + final norm + LM head for one
  token, relative to a full 1-token forward.

    python benchmarks/gpu_check.py --shape llama3-8b --out benchmarks/results   # on a GPU
    python benchmarks/gpu_check.py --shape tiny --device cpu                     # smoke test
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import transformers

from selfspec.modeling import ModelRunner

SHAPES: dict[str, dict[str, Any]] = {
    "llama3-8b": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
    },
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 512,
        "max_position_embeddings": 1024,
    },
}
TOKENS = (1, 2, 4, 8, 16)


def build_model(shape: str, precision: str, device: torch.device) -> Any:
    """A random Llama of ``shape`` in ``precision`` (bf16, fp32, nf4 or int8) on ``device``."""
    config = transformers.LlamaConfig(**SHAPES[shape])
    compute = torch.float32 if device.type == "cpu" else torch.bfloat16
    with torch.device(device):
        model = transformers.LlamaForCausalLM._from_config(
            config, dtype=compute if precision != "fp32" else torch.float32, attn_implementation="sdpa"
        )
    if precision in ("nf4", "int8"):
        quantize_linears(model, precision, compute, device)
    return model.eval()


def quantize_linears(model: Any, precision: str, compute: torch.dtype, device: torch.device) -> None:
    """Swap every decoder linear layer for its bitsandbytes version (the LM head stays)."""
    import bitsandbytes as bnb

    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, linear in list(parent.named_children()):
                if not isinstance(linear, torch.nn.Linear):
                    continue
                weight = linear.weight.data.to("cpu", torch.float16 if precision == "int8" else compute)
                if precision == "nf4":
                    new = bnb.nn.Linear4bit(
                        linear.in_features, linear.out_features, bias=False, compute_dtype=compute, quant_type="nf4"
                    )
                    new.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4")
                else:
                    new = bnb.nn.Linear8bitLt(
                        linear.in_features, linear.out_features, bias=False, has_fp16_weights=False, threshold=6.0
                    )
                    new.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
                setattr(parent, name, new.to(device))


def _median_seconds(fn: Any, device: torch.device, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure(model: Any, context: int, repeats: int) -> dict[str, Any]:
    """Verify-cost curve and draft cost ratio per exit layer for one model."""
    adapter = ModelRunner(model)
    device = adapter.device
    cache = adapter.new_cache(context + max(TOKENS) + 1)
    prompt = torch.randint(0, adapter.vocab_size, (1, context), device=device)
    with torch.inference_mode():
        adapter.run_layers(adapter.embed(prompt), 0, adapter.num_layers, torch.arange(context, device=device), cache)

        def forward(start: int, end: int, n: int) -> None:
            ids = prompt[:, :n]
            positions = torch.arange(context, context + n, device=device)
            adapter.logits(adapter.run_layers(adapter.embed(ids), start, end, positions, cache))
            cache.crop_to(context)

        one = _median_seconds(lambda: forward(0, adapter.num_layers, 1), device, repeats)
        verify = {
            n: _median_seconds(lambda n=n: forward(0, adapter.num_layers, n), device, repeats) / one for n in TOKENS
        }
        layers = sorted(
            {1, 2, 4, 8, adapter.num_layers // 4, adapter.num_layers // 2} & set(range(1, adapter.num_layers))
        )
        draft = {e: _median_seconds(lambda e=e: forward(0, e, 1), device, repeats) / one for e in layers}
    return {
        "one_token_ms": round(one * 1000, 3),
        "verify_cost": {str(n): round(v, 3) for n, v in verify.items()},
        "draft_cost": {str(e): round(c, 3) for e, c in draft.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--precisions", nargs="*", default=["bf16", "nf4", "int8"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", default=None, help="folder for gpu_check.json")
    args = parser.parse_args()
    device = torch.device(args.device)
    results: dict[str, Any] = {
        "shape": args.shape,
        "device": str(device),
        "context": args.context,
        "gpu": torch.cuda.get_device_name(0) if device.type == "cuda" else None,
        "precisions": {},
    }
    print(f"{'precision':>9} {'1-tok ms':>9}  verify cost (n tokens / 1)            draft cost (E layers / all)")
    for precision in args.precisions:
        model = build_model(args.shape, precision, device)
        row = measure(model, args.context, args.repeats)
        if device.type == "cuda":
            row["memory_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
            torch.cuda.reset_peak_memory_stats()
        results["precisions"][precision] = row
        verify = " ".join(f"{n}:{v}" for n, v in row["verify_cost"].items())
        draft = " ".join(f"{e}:{c}" for e, c in row["draft_cost"].items())
        print(f"{precision:>9} {row['one_token_ms']:>9}  {verify:<38} {draft}")
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.out:
        path = Path(args.out) / f"gpu_check_{args.shape}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
