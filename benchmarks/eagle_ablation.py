"""Which features should the EAGLE head read on SmolLM2? Last layer (EAGLE-1) vs fused (EAGLE-3).

EAGLE-3 (Li et al. 2025) feeds its head the hidden states of a low, a middle and a high layer,
concatenated and projected (``fc: 3H -> H``, then an RMSNorm), instead of the last layer's
output. This script trains both kinds of head on the same written data (the ``data.pt`` that
``selfspec train-eagle`` keeps in its state folder), with the same schedule counted in optimizer
steps (so that other jobs on the machine change the wall time, not the result), and reports
held-out top-1 agreement with the model's greedy token at draft steps 1-3.

The fused variant is built here by subclassing :class:`~selfspec.drafting.eagle.head.EagleHead` and feeding
``train_eagle_head`` extra per-sample inputs; nothing in the library changes for it.

    python benchmarks/eagle_ablation.py --variant last --steps 400
    python benchmarks/eagle_ablation.py --variant fused --layers 2 15 27 --steps 400

Each run appends its result to ``benchmarks/results/eagle_ablation_cpu.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

RESULTS = Path(__file__).parent / "results" / "eagle_ablation_cpu.json"
STATE = Path.home() / ".cache" / "selfspec" / "eagle_train" / "smollm2-135m-instruct"


@torch.no_grad()
def aux_features(model: Any, samples: list[Any], layers: list[int], cache: Path) -> list[torch.Tensor]:
    """Per sample ``[T, len(layers) * H]`` float16: the chosen layers' outputs (before the final norm)."""
    if cache.is_file():
        return list(torch.load(cache, weights_only=True))
    out = []
    for i, sample in enumerate(samples):
        hidden = model.model(input_ids=sample.ids[None], output_hidden_states=True).hidden_states
        out.append(torch.cat([hidden[layer][0] for layer in layers], dim=-1).half())
        if i % 50 == 0:
            print(f"aux features {i}/{len(samples)}", flush=True)
    torch.save(out, cache)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", choices=["last", "fused"], required=True)
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 15, 27])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--noise", type=float, default=0.0, help="feature_noise (EAGLE-1's uniform noise)")
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    import selfspec.drafting.eagle.train as training
    from selfspec.drafting.eagle.head import EagleHead
    from selfspec.modeling.realmodels import fetch_model

    path = fetch_model()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    data_file = STATE / "data.pt"
    samples = torch.load(data_file, weights_only=False)["samples"]
    hidden_size = int(model.config.hidden_size)

    if args.variant == "fused":
        name = "aux_" + "_".join(map(str, args.layers)) + ".pt"
        aux = aux_features(model, samples, args.layers, STATE / name)
        # train_eagle_head reloads the samples from data.pt: find each one's states by its tokens
        aux_of = {sample.ids.numpy().tobytes(): extra for sample, extra in zip(samples, aux, strict=True)}
        width = len(args.layers) * hidden_size

        class FusedHead(EagleHead):
            """EAGLE-3 style first-step input: ``fc([embed, norm(fuse(rms(low), rms(mid), rms(high)))])``."""

            def __init__(self, *a: Any, **k: Any) -> None:
                super().__init__(*a, **k)
                self.fuse = nn.Linear(width, hidden_size, bias=False)
                self.fuse_norm = nn.RMSNorm(hidden_size, eps=float(model.config.rms_norm_eps))

            def forward(self, features: torch.Tensor, *a: Any, **k: Any) -> torch.Tensor:
                if features.shape[-1] == width:
                    # each layer's state RMS-normalised first (mid layers carry activations of 1e4)
                    parts = features.unflatten(-1, (-1, hidden_size))
                    parts = parts * torch.rsqrt(parts.pow(2).mean(-1, keepdim=True) + 1e-6)
                    features = self.fuse_norm(self.fuse(parts.flatten(-2)))
                return super().forward(features, *a, **k)

        original_collate = training.collate

        def collate(batch_samples: list[Any], device: torch.device) -> Any:
            batch = original_collate(batch_samples, device)
            inputs = torch.zeros(len(batch_samples), batch.ids.shape[1], width)
            for row, s in enumerate(batch_samples):
                extra = aux_of[s.ids.numpy().tobytes()]
                inputs[row, : extra.shape[0]] = extra.float()
            batch.inputs = inputs.to(device)
            return batch

        def unrolled_forward(head: Any, batch: Any, steps: int, noise: float = 0.0) -> list[torch.Tensor]:
            b, n = batch.ids.shape[0], batch.ids.shape[1] - 1
            positions = torch.arange(n)[None].expand(b, -1)
            cache = training._UnrollCache()
            features = batch.inputs[:, :n]
            if noise > 0:
                features = features + (torch.rand_like(features) * 2 - 1) * noise
            predictions = []
            for step in range(steps):
                allowed = training.unroll_mask(n, step, batch.ids.device)[None].expand(b, -1, -1)
                predicted = head(features, batch.ids[:, 1:], positions, cache, allowed=allowed)
                predictions.append(predicted)
                features = torch.cat([torch.zeros_like(predicted[:, :1]), predicted[:, :-1]], dim=1)
            return predictions

        training.collate = collate
        training.unrolled_forward = unrolled_forward
        training.EagleHead = FusedHead

    # a private state folder holding only the written data (no checkpoint: training starts fresh)
    state = Path(tempfile.mkdtemp(prefix="eagle_ablation_"))
    try:
        os.symlink(data_file, state / "data.pt")
        cfg = training.EagleTrainConfig(
            max_seconds=1e6, max_steps=args.steps, lr=args.lr, threads=args.threads, feature_noise=args.noise
        )
        started = time.perf_counter()
        result = training.train_eagle_head(model, None, cfg, state_dir=state, progress=False)
        seconds = time.perf_counter() - started
    finally:
        shutil.rmtree(state, ignore_errors=True)
    entry = {
        "variant": args.variant,
        "layers": args.layers if args.variant == "fused" else [int(model.config.num_hidden_layers)],
        "tag": args.tag,
        "steps": args.steps,
        "lr": args.lr,
        "feature_noise": args.noise,
        "threads": args.threads,
        "parameters": result.head.num_parameters(),
        "train_seconds": round(seconds, 1),
        "load_average": os.getloadavg(),
        "heldout_agreement_per_step": result.figures["heldout_agreement_per_step"],
        "history": result.history,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": platform.processor() or platform.machine(),
    }
    runs = json.loads(RESULTS.read_text()) if RESULTS.is_file() else []
    runs.append(entry)
    RESULTS.write_text(json.dumps(runs, indent=1) + "\n")
    print(json.dumps({k: v for k, v in entry.items() if k != "history"}))


if __name__ == "__main__":
    main()
