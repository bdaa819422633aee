"""The one training loop (`loop.py`) and its parts: runtime, optimizer, batches, validation, resume,
checkpoints, distributed."""
