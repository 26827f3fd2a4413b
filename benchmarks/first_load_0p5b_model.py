import torch, sys
from transformers import Qwen2Config, Qwen2ForCausalLM, AutoTokenizer
# Qwen2.5-0.5B-Instruct's shape, random weights (costs do not depend on the weights), saved in bf16 like the real checkpoint
cfg = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1e6, tie_word_embeddings=True, dtype="bfloat16")
torch.manual_seed(0)
m = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
m.save_pretrained(sys.argv[1])
print(sum(p.numel() for p in m.parameters()) / 1e6, "M params")
