"""Print the composed config (what DVC writes to params.yaml): `python -m stages.compose [overrides]`."""

from __future__ import annotations

import sys
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


def compose_config(overrides: list[str] | None = None) -> DictConfig:
    """Compose `conf/config.yaml` with overrides and resolve it, as DVC's Hydra integration does (the
    subclone groups read the donor group's `donor.student`: params.yaml holds the values)."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides or [])
    OmegaConf.resolve(cfg)
    return cfg


def main() -> None:
    sys.stdout.write(OmegaConf.to_yaml(compose_config(sys.argv[1:])))


if __name__ == "__main__":
    main()
