"""How large should an EAGLE head's draft vocabulary be? Coverage of the target's greedy tokens (issue 43).

A head drafts only tokens of its draft vocabulary (``train-eagle --draft-vocab``: the most frequent
tokens of the written text and of the model's greedy choices), so the share of the target's greedy
next tokens inside it caps every draft step's acceptance. This reads the data ``selfspec
train-eagle`` keeps in its state folder (``<cache>/eagle_training/<model>/<format>/data.*``), splits
it as training does (the same seed and held-out share), chooses the vocabulary from the training
part at several sizes, and reports the share of held-out answer positions whose greedy token it
holds, per kind of prompt. A larger vocabulary costs a larger LM head in every draft step
(``size x hidden`` multiply-adds): the figure to weigh against it. Counts only, no timing.

    PYTHONPATH=src python benchmarks/draft_vocab_coverage.py --state ~/.cache/selfspec/eagle_training/<key>/eagle3
"""

from __future__ import annotations

import argparse
import random
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from result_files import write_result  # beside this file

from selfspec.drafting.eagle import resume
from selfspec.drafting.eagle.train import EagleTrainConfig, Sample, choose_draft_vocab

RESULTS = Path(__file__).parent / "results" / "draft_vocab_coverage_cpu"
SIZES = (1024, 2048, 4096, 8192, 16384, 32768)


def coverage(samples: list[Sample], vocab: torch.Tensor | None) -> dict[str, float]:
    """Share of answer positions whose greedy next token is in ``vocab``, per kind and overall."""
    inside: dict[str, int] = defaultdict(int)
    total: dict[str, int] = defaultdict(int)
    member = None
    if vocab is not None:
        member = torch.zeros(int(vocab.max()) + 1, dtype=torch.bool)
        member[vocab] = True
    for sample in samples:
        greedy = sample.argmax[sample.answer_start : -1]  # the next token at each answer position
        if member is None:
            hits = len(greedy)
        else:
            ok = greedy < len(member)
            hits = int(member[greedy.clamp(max=len(member) - 1)][ok].sum())
        for kind in (sample.kind or "other", "all"):
            inside[kind] += hits
            total[kind] += len(greedy)
    return {kind: round(inside[kind] / total[kind], 4) for kind in sorted(total) if total[kind]}


def run(state: Path, vocab_size: int, seed: int, heldout_share: float) -> dict[str, Any]:
    loaded = resume.load_data(state, Sample)
    if loaded is None:
        raise SystemExit(f"no readable train-eagle data in {state}")
    samples, figures = loaded
    order = list(range(len(samples)))
    random.Random(seed).shuffle(order)  # as train_eagle_head splits them
    count = max(1, int(len(samples) * heldout_share))
    heldout = [samples[i] for i in order[:count]]
    train = [samples[i] for i in order[count:]]
    rows = {str(size): coverage(heldout, choose_draft_vocab(train, size, vocab_size)) for size in SIZES}
    rows["full"] = coverage(heldout, None)
    return {
        "state": str(state),
        "samples": len(samples),
        "train_samples": len(train),
        "heldout_samples": len(heldout),
        "heldout_answer_positions": sum(len(s.argmax[s.answer_start : -1]) for s in heldout),
        "vocab_size": vocab_size,
        "coverage": rows,
        "write_figures": figures,
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def markdown(result: dict[str, Any]) -> str:
    kinds = list(next(iter(result["coverage"].values())))
    lines = [
        "# Draft vocabulary size: the share of held-out greedy tokens it holds",
        "",
        f"{result['when']}; `train-eagle` data of {result['samples']} answers ({result['train_samples']} choose "
        f"the vocabulary, {result['heldout_samples']} held out: {result['heldout_answer_positions']} answer "
        f"positions); target vocabulary {result['vocab_size']}; produced by `benchmarks/draft_vocab_coverage.py`.",
        "",
        "| draft vocabulary | " + " | ".join(kinds) + " |",
        "|---:|" + "---:|" * len(kinds),
    ]
    for size, row in result["coverage"].items():
        lines.append(f"| {size} | " + " | ".join(f"{row.get(k, float('nan')):.3f}" for k in kinds) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--state", type=Path, required=True, help="train-eagle's state folder (data.safetensors)")
    parser.add_argument("--vocab-size", type=int, default=49152, help="the target's vocabulary (SmolLM2: 49152)")
    parser.add_argument("--seed", type=int, default=EagleTrainConfig.seed)
    parser.add_argument("--heldout-share", type=float, default=EagleTrainConfig.heldout_share)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    result = run(args.state, args.vocab_size, args.seed, args.heldout_share)
    write_result(args.out, result, markdown(result))


if __name__ == "__main__":
    main()
