"""generate: continue a prompt with a GGUF or checkpoint; prints the completion, writes generate.json.

`python -m stages.generate model_path=smollm2 prompt="The capital of France is" max_new_tokens=8`
Not a DVC stage and no MLflow run: a tool for looking at (and checking) a model's text.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from pipeline.config import GenerateConfig
from pipeline.errors import PipelineError
from pipeline.files import write_json
from pipeline.generate import run_generate
from stages.common import CONFIG_PATH, fail, structured_config


def _run_dir() -> Path:
    return Path(HydraConfig.get().runtime.output_dir)


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="generate")
def main(cfg: DictConfig) -> None:
    try:
        result = run_generate(structured_config(GenerateConfig, cfg, "conf/generate.yaml"))
    except PipelineError as e:
        fail(str(e))
    out = write_json(_run_dir() / "generate.json", result)
    print(result["completion"])
    print(
        f"generate: {result['n_tokens']} tokens ({result['stop_reason']}), {result['tokens_per_s']:.1f} tokens/s "
        f"({result['decode_tokens_per_s']:.1f} decode) -> {out}",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
