"""A scratch copy of this project (tiny model, a few steps) in its own git repo, and a shell in it:
what the end-to-end and experiment tests run DVC, the stages and MLflow against."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT

TINY_MODEL = """arch: llama
d_model: 32
n_layer: 1
n_head: 2
n_kv_head: 1
d_ff: 64
context_length: 64
rope_theta: 10000.0
norm_eps: 1.0e-05
tie_embeddings: true
init_std: 0.02
"""
TINY_TRAIN = """steps: 6
batch_size: 4
seq_len: 32
grad_accum: 1
precision: auto
eval_every: 3
log_every: 1
device: cpu
threads: 0
vocab: auto              # DVC's params must all be in params.yaml (teach declares train.vocab*)
vocab_negatives: 8192
qat: ''                  # DVC's params must all be in params.yaml (evaluate declares train.qat)
distill:                 # DVC's params must all be in params.yaml (the teach stage declares these)
  weight: 0.0
  temperature: 1.0
  top_k: 32
  mode: cached
  context: 512
  cache_tokens: 262144
  span: 8192
  source: corpus
  prompt_tokens: 32
  share: 0.0
"""
TINY_VAL_FRACTION = 0.03


def env(cwd: Path, tracking_uri: bool = True) -> dict[str, str]:
    """The venv first on PATH, a git identity, and (unless told not to) the scratch MLflow store."""
    out = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@t",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@t",
    }
    out.pop("MLFLOW_TRACKING_URI", None)
    if tracking_uri:
        out["MLFLOW_TRACKING_URI"] = f"sqlite:///{cwd / 'mlflow.db'}"
    return out


def run(cwd: Path, *args: str, timeout: int = 600, tracking_uri: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, env=env(cwd, tracking_uri), capture_output=True, text=True, timeout=timeout)


def sh(cwd: Path, *args: str, timeout: int = 600, stderr: bool = True, tracking_uri: bool = True) -> str:
    proc = run(cwd, *args, timeout=timeout, tracking_uri=tracking_uri)
    assert proc.returncode == 0, f"{' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout + (proc.stderr if stderr else "")


def ran(output: str) -> list[str]:
    return re.findall(r"Running stage '(\w+)'", output)


def tiny_defaults(config: str) -> str:
    """The top config with the fast shape as its default: warm start of model=llama-tiny (the default
    recipe, a subclone of the real donor, has its own end-to-end test)."""
    for group, option in (("model", "llama-tiny"), ("optim", "adamw"), ("recipe", "warm-start")):
        config, n = re.subn(rf"^  - {group}: \S+", f"  - {group}: {option}", config, count=1, flags=re.M)
        assert n == 1, f"conf/config.yaml has no default for {group}"
    return config


def make_project(dst: Path) -> Path:
    """Copy the code, config and DVC files into `dst`, shrink model and training, commit."""
    for name in ("conf", "stages", "pipeline", ".dvc"):
        shutil.copytree(ROOT / name, dst / name, ignore=shutil.ignore_patterns("__pycache__", "tmp", "cache"))
    for name in ("dvc.yaml", ".dvcignore", ".gitignore"):
        shutil.copy(ROOT / name, dst / name)
    (dst / "conf" / "model" / "llama-tiny.yaml").write_text(TINY_MODEL)
    (dst / "conf" / "config.yaml").write_text(tiny_defaults((ROOT / "conf" / "config.yaml").read_text()))
    (dst / "conf" / "train" / "default.yaml").write_text(TINY_TRAIN)
    # 2 of pydoc's 79 documents to val (630 tokens, not 7191): teach's fp32 donor val loss on SmolLM2 was
    # most of the first `dvc repro`; every stage still reads, measures and compares the same split
    pydoc = dst / "conf" / "data" / "pydoc.yaml"
    text, n = re.subn(r"^val_fraction: \S+", f"val_fraction: {TINY_VAL_FRACTION}", pydoc.read_text(), flags=re.M)
    assert n == 1, "conf/data/pydoc.yaml has no val_fraction"
    pydoc.write_text(text)
    (dst / "params.yaml").write_text(sh(dst, sys.executable, "-m", "stages.compose", stderr=False))
    sh(dst, "git", "init", "-q")
    sh(dst, "git", "add", "-A")
    sh(dst, "git", "commit", "-qm", "init")
    return dst


def mlflow_runs(project: Path, experiment: str = "smollm-pipeline"):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{project / 'mlflow.db'}")
    exp = client.get_experiment_by_name(experiment)
    return client, client.search_runs([exp.experiment_id], max_results=1000)
