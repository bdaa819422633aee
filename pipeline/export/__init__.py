"""The export stage: the trained model as a ship-ready GGUF (conventional names and `general.*` keys,
quantization, adapters) with its model card.
"""
