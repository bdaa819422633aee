"""Thin Hydra entry points, one per DVC stage: `python -m stages.<name> key=value ...`."""
