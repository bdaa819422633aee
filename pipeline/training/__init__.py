"""The train stage: the one training loop (`loop.py`) and its parts (runtime, optimizer, batches,
validation, resume, checkpoints, distributed), and `trainer.py`, the stage's work around it."""
