"""inputs: fingerprint the user's corpus and donor files so DVC re-runs pack when either changes.

Runs on every `dvc repro` (`always_changed` in dvc.yaml) and only hashes; no MLflow run.
"""

from __future__ import annotations

import logging

import hydra
from omegaconf import DictConfig

from pipeline.donor.locate import resolve_gguf_path
from pipeline.errors import PipelineError
from stages._input_records import run_inputs
from stages._run import output
from stages._run.exits import config_failed, entry, fail
from stages._run.lifecycle import CONFIG_NAME, CONFIG_PATH
from stages._run.paths import Paths
from stages._run.typed import typed_config

log = logging.getLogger(__name__)


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name=CONFIG_NAME)
def main(cfg: DictConfig) -> None:
    try:
        typed = typed_config(cfg)
    except PipelineError as e:
        config_failed(e)
    try:
        output.configure(typed.output)
        paths = Paths.here()
        donor_file = resolve_gguf_path(typed.donor.path)
        records = run_inputs(typed.data, typed.donor.path, donor_file, paths.inputs, paths.outputs())
    except PipelineError as e:
        fail(str(e))
    corpus, donor = records["corpus.json"], records["donor.json"]
    size = sum(f["bytes"] for f in corpus["files"]) / 1e6
    log.info(
        f"inputs: corpus {len(corpus['files'])} file(s), {size:.1f} MB; donor {donor['file']['name']} "
        f"sha256 {donor['file']['sha256'][:12]} -> {paths.inputs}"
    )


if __name__ == "__main__":
    entry(main)
