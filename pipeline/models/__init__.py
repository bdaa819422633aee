"""Models: one config dataclass, one nn.Module per block (llama, gpt2, vit), their GGUF layouts; the
numerical kernels they call live in `ops/`."""
