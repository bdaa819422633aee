"""Library of the small-LM experiment pipeline: pure Python + torch/numpy/gguf/tokenizers.

Nothing here imports hydra, omegaconf or dvc; only `pipeline.tracking` touches mlflow.
"""
