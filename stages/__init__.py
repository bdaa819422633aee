"""Thin Hydra entry points, one per DVC stage: `python -m stages.<name> key=value ...`.

`${run_token:}` (conf/config.yaml's `hydra.sweep.dir`) is six random hex digits, drawn once per
composed config and shared by every job of a multirun (Hydra copies the resolver cache into each
job's config), so two multiruns started in the same second get directories of their own.
"""

import secrets

from omegaconf import OmegaConf

OmegaConf.register_new_resolver("run_token", lambda: secrets.token_hex(3), use_cache=True, replace=True)
