"""The whole product on the real donor, in a scratch git repo: `dvc repro` of all six stages,
a no-op second repro, `dvc exp run -S` changing only what depends on the lr, DVC metrics and
plots, MLflow runs per stage, a Hydra multirun sweep grouped under a parent run, and (last: it
changes the workspace) `dvc exp run -S preset=lora`, LoRA on the real SmolLM2 through every stage.

Slow (about two minutes) and the only proof of these features, so it runs in CI.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow

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
precision: bf16
eval_every: 3
log_every: 1
device: cpu
threads: 0
"""


def sh(cwd: Path, *args: str, timeout: int = 600, stderr: bool = True) -> str:
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@t",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@t",
        "MLFLOW_TRACKING_URI": f"sqlite:///{cwd / 'mlflow.db'}",
    }
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout + (proc.stderr if stderr else "")


def ran(output: str) -> list[str]:
    return re.findall(r"Running stage '(\w+)'", output)


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """A copy of this repo with a tiny model and a few training steps, committed to git."""
    dst = tmp_path_factory.mktemp("project")
    for name in ("conf", "stages", "pipeline", ".dvc"):
        shutil.copytree(ROOT / name, dst / name, ignore=shutil.ignore_patterns("__pycache__", "tmp", "cache"))
    for name in ("dvc.yaml", ".dvcignore", ".gitignore"):
        shutil.copy(ROOT / name, dst / name)
    (dst / "conf" / "model" / "llama-tiny.yaml").write_text(TINY_MODEL)
    (dst / "conf" / "train" / "default.yaml").write_text(TINY_TRAIN)
    (dst / "params.yaml").write_text(sh(dst, sys.executable, "-m", "stages.compose", stderr=False))
    sh(dst, "git", "init", "-q")
    sh(dst, "git", "add", "-A")
    sh(dst, "git", "commit", "-qm", "init")
    return dst


@pytest.fixture(scope="module")
def first_repro(project: Path) -> str:
    return sh(project, "dvc", "repro")


def mlflow_runs(project: Path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{project / 'mlflow.db'}")
    exp = client.get_experiment_by_name("smollm-pipeline")
    return client, client.search_runs([exp.experiment_id], max_results=1000)


def test_repro_runs_every_stage(project: Path, first_repro: str) -> None:
    assert ran(first_repro) == ["pack", "donor", "realize", "train", "export", "evaluate"]
    assert (project / "models" / "export" / "model.gguf").stat().st_size > 0
    evaluate = json.loads((project / "metrics" / "evaluate.json").read_text())
    train = json.loads((project / "metrics" / "train.json").read_text())
    assert abs(evaluate["val_loss"] - train["final_val_loss"]) <= 1e-3
    samples = json.loads((project / "models" / "evaluate" / "samples.json").read_text())
    assert len(samples) == 3 and all({"prompt", "greedy", "sampled"} <= set(s) for s in samples)


def test_second_repro_does_nothing(project: Path, first_repro: str) -> None:
    out = sh(project, "dvc", "repro")
    assert ran(out) == []


def test_mlflow_has_one_run_per_stage(project: Path, first_repro: str) -> None:
    client, runs = mlflow_runs(project)
    by_stage = {r.data.tags["stage"]: r for r in runs}
    assert set(by_stage) >= {"pack", "donor", "realize", "train", "export", "evaluate"}
    train = by_stage["train"]
    assert train.info.status == "FINISHED"
    assert train.data.params["optim.lr"] == "0.003" and train.data.tags["recipe"] == "warm-start"
    assert {"git_commit", "config_hash", "input.init", "input.packed_meta"} <= set(train.data.tags)
    history = client.get_metric_history(train.info.run_id, "train_loss")
    assert [m.step for m in history] == [1, 2, 3, 4, 5, 6]
    artifacts = {a.path for a in client.list_artifacts(train.info.run_id)}
    assert any(p.endswith("config.yaml") for p in artifacts) and "train.json" in artifacts
    # the export carries its provenance: the train stage's MLflow run id
    from pipeline.gguf.reader import GGUFFile

    g = GGUFFile(project / "models" / "export" / "model.gguf")
    assert g.metadata["pipeline.mlflow_run_id"] == train.info.run_id


def test_metrics_and_plots_show(project: Path, first_repro: str) -> None:
    out = sh(project, "dvc", "metrics", "show")
    assert "final_val_loss" in out and "explained_variance_total" in out
    sh(project, "dvc", "plots", "show", "-o", str(project / "plots_html"))
    assert (project / "plots_html" / "index.html").is_file()


def test_exp_run_set_param_reruns_only_downstream_of_lr(project: Path, first_repro: str) -> None:
    out = sh(project, "dvc", "exp", "run", "-S", "optim.lr=0.002")
    assert ran(out) == ["train", "export", "evaluate"]
    _, runs = mlflow_runs(project)
    latest_train = max((r for r in runs if r.data.tags["stage"] == "train"), key=lambda r: r.info.start_time)
    assert latest_train.data.params["optim.lr"] == "0.002"


def test_hydra_multirun_sweep_logs_grouped_runs(project: Path, first_repro: str) -> None:
    sh(project, sys.executable, "-m", "stages.train", "-m", "optim.lr=1e-3,3e-4")
    _, runs = mlflow_runs(project)
    children = [r for r in runs if "sweep_id" in r.data.tags and r.data.tags.get("sweep_parent") != "true"]
    parents = [r for r in runs if r.data.tags.get("sweep_parent") == "true"]
    assert len(children) == 2 and len(parents) == 1
    assert {r.data.params["optim.lr"] for r in children} == {"0.001", "0.0003"}
    assert {r.data.tags["mlflow.parentRunId"] for r in children} == {parents[0].info.run_id}


def test_lora_preset_runs_through_every_stage_on_smollm2(project: Path, first_repro: str) -> None:
    overrides = ["preset=lora", "train.steps=2", "train.batch_size=2", "train.eval_every=2", "train.device=cpu"]
    overrides += ["train.checkpoint_every=0", "evaluate.max_new_tokens=4", "evaluate.prompts=[a]"]
    out = sh(project, "dvc", "exp", "run", *(x for o in overrides for x in ("-S", o)), timeout=1200)
    assert ran(out) == ["pack", "donor", "realize", "train", "export", "evaluate"]
    params = (project / "params.yaml").read_text()
    assert "trainable: lora" in params and "source: instruct" in params
    pack = json.loads((project / "metrics" / "pack.json").read_text())
    assert pack["examples_val"] > 0 and pack["chat_template"] == 1.0 and "truncated_train" in pack
    train = json.loads((project / "metrics" / "train.json").read_text())
    evaluate = json.loads((project / "metrics" / "evaluate.json").read_text())
    assert abs(evaluate["val_loss"] - train["final_val_loss"]) <= 1e-3  # merged f32 GGUF == base + adapter
    assert abs(evaluate["base_val_loss"] - train["initial_val_loss"]) <= 1e-3  # the base GGUF == step 0
    export = project / "models" / "export"
    assert {p.name for p in export.iterdir()} == {"model.gguf", "adapter.gguf", "peft"}
    from pipeline.finetune.adapters import read_adapter_gguf

    adapter = read_adapter_gguf(export / "adapter.gguf")
    assert adapter.rank == 8 and adapter.targets == ("q", "v") and len(adapter.state) == 2 * 2 * 30
    _, runs = mlflow_runs(project)
    latest = max((r for r in runs if r.data.tags["stage"] == "train"), key=lambda r: r.info.start_time)
    assert latest.data.tags["recipe"] == "lora" and latest.data.params["recipe.lora.rank"] == "8"
    assert "initial_val_loss" in latest.data.metrics and "epoch" in latest.data.metrics
