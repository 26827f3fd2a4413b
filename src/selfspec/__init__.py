"""selfspec: lossless self-speculative decoding for Hugging Face causal LMs."""
