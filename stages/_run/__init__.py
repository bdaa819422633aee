"""What every stage entry point shares and a user never runs: the output paths, the run lifecycle (one
MLflow run per execution), Hydra/OmegaConf errors as one line, sweep checks, output modes, signals.
"""
