"""Models: one config dataclass, one nn.Module per block, llama and gpt2, their GGUF layouts, decoding."""
