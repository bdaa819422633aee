"""generate: continue a prompt with a GGUF or checkpoint; prints the completion, writes generate.json.

`python -m stages.generate model_path=smollm2 prompt="The capital of France is" max_new_tokens=8`
Not a DVC stage and no MLflow run: a tool for looking at (and checking) a model's text.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from pipeline.config import GenerateConfig
from pipeline.errors import ConfigError, PipelineError, problem
from pipeline.inference.generate import run_generate
from pipeline.io.files import write_json
from stages._run.exits import entry, fail
from stages._run.lifecycle import CONFIG_PATH
from stages._run.typed import structured_config


def _run_dir() -> Path:
    return Path(HydraConfig.get().runtime.output_dir)


def with_prompt(cfg: GenerateConfig) -> GenerateConfig:
    """The prompt from `prompt_file` (a path, or `-` for stdin) when given: text exactly as written,
    less the one newline an editor ends a file with."""
    if not cfg.prompt_file:
        return cfg
    try:
        text = sys.stdin.read() if cfg.prompt_file == "-" else Path(cfg.prompt_file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(
            problem(f"prompt_file={cfg.prompt_file}", "a readable UTF-8 text file", type(e).__name__, "check the path")
        ) from None
    return replace(cfg, prompt=text[:-1] if text.endswith("\n") else text, prompt_file="")


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="generate")
def main(cfg: DictConfig) -> None:
    try:
        result = run_generate(with_prompt(structured_config(GenerateConfig, cfg, "conf/generate.yaml")))
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
    entry(main)
