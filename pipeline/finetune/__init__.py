"""Fine-tuning a pretrained GGUF: LoRA adapters, QLoRA's quantized frozen base, adapter files."""
