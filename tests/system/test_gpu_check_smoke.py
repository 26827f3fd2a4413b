"""The GPU check's CPU smoke run (issue 40, item 7): every section present, inside its deadline.

The check itself runs on a lent GPU once (``benchmarks/gpu_check.sh``); here its smoke mode (a
tiny random Llama, ``torch.compile(backend="eager")``) runs every section's code on CPU, and the
forced-acceptance section proves, through the real static round, that the verify accepted exactly
the lengths the test-only drafter forced.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from selfspec.drafting import list_drafters

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "gpu_check.sh"
SECTIONS = (
    "env",
    "ceilings",
    "graphs",
    "widths",
    "forced",
    "eagle3",
    "eager_verify",
    "row_invariant",
    "hf_static",
    "long_context",
    "bnb4",
)


def _run(tmp_path: Path, *arguments: str) -> tuple[dict, subprocess.CompletedProcess]:
    env = dict(os.environ, PY=sys.executable, GPU_CHECK_THREADS="1", GPU_CHECK_TIMEOUT="200")
    done = subprocess.run(
        ["bash", str(SCRIPT), "--smoke", "--out", str(tmp_path), *arguments],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert (tmp_path / "gpu_check.md").is_file(), done.stderr[-3000:]
    return json.loads((tmp_path / "gpu_check.json").read_text()), done


def test_every_section_runs_in_smoke_mode_inside_its_deadline(tmp_path) -> None:
    result, done = _run(tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    sections = result["sections"]
    assert tuple(sections) == SECTIONS  # every section, in the decisive order
    failures = {name: s["reason"] for name, s in sections.items() if s["status"] not in ("ok", "skipped")}
    assert not failures, failures
    assert result["finished"] and result["elapsed_s"] < result["args"]["deadline"]
    # only the 4-bit section and the kernels' device bits cannot run on CPU; every other one runs its CPU equivalent
    assert [n for n, s in sections.items() if s["status"] == "skipped"] == ["row_invariant", "bnb4"]
    assert sections["bnb4"]["reason"].startswith("no CUDA")
    assert sections["row_invariant"]["reason"].startswith("no CUDA: the kernels' bits")
    assert sections["ceilings"]["copy"]["gb_s"] > 0 and "lm_head" in sections["ceilings"]["gemv_one_row"]
    fused = sections["ceilings"]["fused_gemv"]
    assert set(fused) == {"qkv", "gate_up"} and all(isinstance(g["keeps_bits"], bool) for g in fused.values())
    graphs = sections["graphs"]
    assert graphs["fused_projections"] == 0  # a CPU runner reads them apart unless asked
    assert graphs["graphs_recorded"] is None and graphs["cuda_only"].startswith("no CUDA")  # a figure, not a section
    bucket = graphs["bucket"]
    assert graphs["compiled_steps"] == [["greedy", 1, bucket]]  # the short call reused the width-1 step
    assert set(sections["widths"]["widths"]) == {"w1", "w3", "w5", "w9"}
    assert sections["widths"]["compiled_steps"] == [["greedy", w, bucket] for w in (1, 3, 5, 9)]
    assert sections["forced"]["compiled_steps"] == sections["widths"]["compiled_steps"]  # no call compiled more
    forced = sections["forced"]
    assert forced["every_accepted_length_forced"]  # the real verify accepted exactly what was forced
    for name in ("plain", "alpha_0.6", "alpha_0.8", "alpha_1.0"):
        assert forced[name]["paths"] == ["static"], (name, forced[name])  # the static round served every round
        assert forced[name]["text_follows_successor"]
        assert forced[name]["phases_median_ms"]["launch_ms"] is not None
    assert forced["alpha_1.0"]["tokens_per_round"] == 9.0  # 8 drafts and the bonus token every full round
    assert forced["plain"]["tokens_per_round"] == 1.0
    assert 1.0 < forced["alpha_0.6"]["tokens_per_round"] < forced["alpha_0.8"]["tokens_per_round"] < 9.0
    eagle = sections["eagle3"]
    assert eagle["static_round"] == "accepted" or eagle["static_round"].startswith("refused by static round: ")
    assert eagle["served_by"] == (["static"] if eagle["static_round"] == "accepted" else ["eager"])
    assert eagle["ms_per_round"] > 0
    assert set(sections["eager_verify"]["verify_ms"]) == {"w1", "w3", "w5", "w9"}
    assert sections["hf_static"]["compiled"] and sections["hf_static"]["tokens"] == 8
    assert set(sections["long_context"]["prefill"]) == {"256", "512"}
    markdown = (tmp_path / "gpu_check.md").read_text()
    assert "## Headline" in markdown and "## bnb4: skipped" in markdown
    assert "forced_acceptance" not in list_drafters()  # test-only: never a user drafter, never in auto


def test_a_section_past_its_budget_is_timed_out_and_the_run_goes_on(tmp_path) -> None:
    result, done = _run(tmp_path, "--sections", "env", "ceilings", "graphs", "--budget-scale", "0.0001")
    assert done.returncode == 0, done.stderr[-3000:]
    sections = result["sections"]
    assert sections["env"]["status"] == "ok"
    # each budget is at least 1 s: building the model and compiling take longer
    assert sections["graphs"]["status"] == "timed_out", sections["graphs"]
    assert "budget" in sections["graphs"]["reason"]
    assert list(sections) == ["env", "ceilings", "graphs"]


def _forced_module():
    import importlib

    sys.path.insert(0, str(SCRIPT.parent))
    try:
        return importlib.import_module("forced_acceptance")
    finally:
        sys.path.remove(str(SCRIPT.parent))


def test_forced_acceptance_through_the_eager_loop_and_the_weights_restored() -> None:
    """The eager loop's verify (not only the static round's) accepts exactly the forced lengths."""
    import torch
    import transformers

    from selfspec import SpeculativeEngine

    forced = _forced_module()
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        tie_word_embeddings=False,
    )
    config.eos_token_id = None
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(config, dtype=torch.float32, attn_implementation="sdpa").eval()
    model.generation_config.eos_token_id = None
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    context_free = forced.make_context_free(model)
    assert context_free.min_margin > 0
    drafter = forced.ForcedAcceptanceDrafter(context_free.successor, 4, alpha=0.5, seed=7)
    engine = SpeculativeEngine(model, None, drafter=drafter, num_draft_tokens=4, calibration={}, compile=False)
    with forced.record_rounds(engine) as records:
        output = engine.generate_ids(list(range(5, 15)), max_new_tokens=30)
    full = [r.accepted for r in records if r.drafted == 4]
    assert {r.path for r in records} == {"eager"}
    assert full == [n for n, d in zip(drafter.forced, drafter.drafted, strict=True) if d == 4]
    assert len(set(full)) > 1  # alpha 0.5 forces varying lengths, each one accepted exactly
    assert forced.follows_successor(output.token_ids, context_free.successor)
    context_free.restore()
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
