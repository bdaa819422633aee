"""GGUF files: a bounds-checked reader, the one writer, and the tokenizer and chat template a GGUF carries."""
