"""The tokenizer a GGUF carries, rebuilt exactly as llama.cpp runs it: BPE and SentencePiece, the
pre-tokenizers, user text kept apart from control tokens, and the chat template.
"""
