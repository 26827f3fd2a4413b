"""Build a model of Qwen2.5-0.5B-Instruct's shape with random weights, for first-load timing.

Costs do not depend on the weights, so a random model of the real shape, saved in bfloat16 like
the real checkpoint, times first-load calibration as the real one would (its acceptance says
nothing). Give it a tokenizer (e.g. SmolLM2's) to get the chat prompt mix:

    python benchmarks/first_load_0p5b_model.py /tmp/q05/model
"""

from __future__ import annotations

import sys

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM


def main() -> None:
    config = Qwen2Config(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rope_theta=1e6,
        tie_word_embeddings=True,
        dtype="bfloat16",
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(sys.argv[1])
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.0f} M parameters")


if __name__ == "__main__":
    main()
