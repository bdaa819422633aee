"""The whole product on the real donor, in a scratch git repo: `dvc repro` of every stage, a no-op
second repro, `dvc exp run -S` changing only what depends on the lr, DVC metrics and plots, MLflow
runs grouped per pipeline execution and per sweep (basic, Optuna, parallel joblib), single-stage
overrides of keys the stage does not read refused, a queue of experiments that logs into the
project's own store and shows in `dvc exp show`, an in-place corpus edit re-running pack, and (last:
it changes the workspace) `dvc exp run -S preset=lora`, LoRA on the real SmolLM2 through every stage.

Slow (about four minutes) and the only proof of these features, so it runs in CI.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.gguf.quantize import llamacpp_installed
from tests.scratch import make_project, mlflow_runs, ran, run, sh

pytestmark = pytest.mark.slow
STAGES = ("pack", "donor", "teach", "realize", "train", "export", "evaluate", "report")


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """A copy of this repo with a tiny model and a few training steps, committed to git."""
    return make_project(tmp_path_factory.mktemp("project"))


@pytest.fixture(scope="module")
def first_repro(project: Path) -> str:
    return sh(project, "dvc", "repro")


def test_repro_runs_every_stage(project: Path, first_repro: str) -> None:
    assert ran(first_repro) == ["inputs", *STAGES]
    assert (project / "models" / "export" / "model.gguf").stat().st_size > 0
    evaluate = json.loads((project / "metrics" / "evaluate.json").read_text())
    train = json.loads((project / "metrics" / "train.json").read_text())
    assert abs(evaluate["val_loss"] - train["kept_val_loss"]) <= 1e-3
    samples = json.loads((project / "models" / "evaluate" / "samples.json").read_text())
    assert len(samples) == 3 and all({"prompt", "greedy", "sampled"} <= set(s) for s in samples)
    assert train["kept_val_bpb"] == pytest.approx(evaluate["val_bpb"], abs=1e-3)  # bits per byte in both
    report = (project / "reports" / "report.md").read_text()
    assert f"| val_bpb | {evaluate['val_bpb']:.4f} |" in report and "(this run)" in report
    assert (project / "reports" / "report.html").read_text().count('src="data:image/png;base64,') >= 4


def test_progress_under_dvc_is_plain_lines_not_redraws(first_repro: str) -> None:
    """Without a terminal a stage printed a tqdm redraw per step (~1,200 carriage returns on one line of
    the train stage's log); now it is a plain line each tenth of the work (or every 30 s)."""
    assert "\r" not in first_repro
    assert re.search(r"^train: (\d+)/\1 steps \(100%\), [\d.,]+ steps/s, ", first_repro, re.M), first_repro[-2000:]


def test_a_failed_evaluate_changes_none_of_its_outputs(project: Path, first_repro: str) -> None:
    """evaluate on a truncated export rewrote plots/evaluate/confusion.csv before it failed."""
    gguf = project / "models" / "export" / "model.gguf"
    outputs = [project / "plots" / "evaluate" / "confusion.csv", project / "metrics" / "evaluate.json"]
    outputs += [project / "models" / "evaluate" / "samples.json"]
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in outputs}
    whole = gguf.read_bytes()
    try:
        gguf.write_bytes(whole[: len(whole) // 2])
        args = ["--config-dir", ".", "--config-name", "params", "hydra.run.dir=logs", "hydra.output_subdir=null"]
        proc = run(project, sys.executable, "-m", "stages.evaluate", *args)
    finally:
        gguf.write_bytes(whole)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "model.gguf" in errors[0], proc.stderr[-2000:]
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in outputs} == before


def test_second_repro_does_nothing(project: Path, first_repro: str) -> None:
    out = sh(project, "dvc", "repro")
    assert ran(out) == ["inputs"]  # it only hashes the user's files; they did not change, so nothing else runs


def test_mlflow_has_one_run_per_stage(project: Path, first_repro: str) -> None:
    client, runs = mlflow_runs(project)
    by_stage = {r.data.tags["stage"]: r for r in runs if r.data.tags.get("parent") != "true"}
    assert set(by_stage) >= set(STAGES)
    train = by_stage["train"]
    assert train.info.status == "FINISHED"
    assert train.data.params["optim.lr"] == "0.003" and train.data.tags["recipe"] == "warm-start"
    assert {"git_commit", "config_hash", "input.init", "input.packed_meta"} <= set(train.data.tags)
    history = client.get_metric_history(train.info.run_id, "loss/train")
    assert [m.step for m in history] == [1, 2, 3, 4, 5, 6]
    artifacts = {a.path for a in client.list_artifacts(train.info.run_id)}
    assert any(p.endswith("config.yaml") for p in artifacts) and "train.json" in artifacts
    # the export carries its provenance: the train stage's MLflow run id
    from pipeline.gguf.reader import GGUFFile

    g = GGUFFile(project / "models" / "export" / "model.gguf")
    assert g.metadata["pipeline.mlflow_run_id"] == train.info.run_id


def test_metrics_and_plots_show(project: Path, first_repro: str) -> None:
    """`dvc metrics show` gives every stage's metrics file as the stage wrote it, and `dvc plots show`
    renders the train stage's curves with their values (not only a page)."""
    shown = json.loads(sh(project, "dvc", "metrics", "show", "--json", stderr=False))[""]["data"]
    for stage in ("pack", "donor", "train", "evaluate"):
        path = f"metrics/{stage}.json"
        assert shown[path]["data"] == json.loads((project / path).read_text()), path
    sh(project, "dvc", "plots", "show", "-o", str(project / "plots_html"))
    page = (project / "plots_html" / "index.html").read_text()
    rows = (project / "plots" / "train" / "val_loss.tsv").read_text().splitlines()[1:]
    assert rows and all(row.split("\t")[1] in page for row in rows)  # each validation's loss is on the chart


def test_exp_run_set_param_reruns_only_downstream_of_lr(project: Path, first_repro: str) -> None:
    out = sh(project, "dvc", "exp", "run", "-S", "optim.lr=0.002")
    assert ran(out) == ["inputs", "train", "export", "evaluate", "report"]
    _, runs = mlflow_runs(project)
    latest_train = max(
        (r for r in runs if r.data.tags.get("stage") == "train" and "parent" not in r.data.tags),
        key=lambda r: r.info.start_time,
    )
    assert latest_train.data.params["optim.lr"] == "0.002"


def test_a_misspelt_plus_key_fails_in_one_line_and_leaves_params_yaml_as_it_was(
    project: Path, first_repro: str
) -> None:
    proc = run(project, "dvc", "exp", "run", "-S", "+optim.lrr=0.01")  # the `+` Hydra's own hint suggests
    error = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error: config key")]
    assert proc.returncode != 0 and len(error) == 1 and "optim.lrr" in error[0], proc.stdout + proc.stderr
    # DVC composed conf/ + the override into params.yaml; what is left is that composition without the key
    composed = yaml.safe_load(sh(project, sys.executable, "-m", "stages.compose", stderr=False))
    assert yaml.safe_load((project / "params.yaml").read_text()) == composed


def test_hydra_multirun_sweep_logs_grouped_runs(project: Path, first_repro: str) -> None:
    sh(project, sys.executable, "-m", "stages.train", "-m", "optim.lr=1e-3,3e-4")
    _, runs = mlflow_runs(project)
    children = [r for r in runs if "sweep_id" in r.data.tags and r.data.tags.get("parent") != "true"]
    parents = [r for r in runs if "sweep_id" in r.data.tags and r.data.tags.get("parent") == "true"]
    assert len(children) == 2 and len(parents) == 1
    assert {r.data.params["optim.lr"] for r in children} == {"0.001", "0.0003"}
    assert {r.data.tags["mlflow.parentRunId"] for r in children} == {parents[0].info.run_id}
    # the parent holds the sweep as typed, not the first job's config (it said optim.lr=0.001)
    assert parents[0].data.tags["sweep_overrides"] == "optim.lr=1e-3,3e-4" and not parents[0].data.params


def test_repro_is_one_parent_run_with_a_child_per_stage(project: Path, first_repro: str) -> None:
    client, runs = mlflow_runs(project)
    first = min((r for r in runs if r.data.tags.get("pipeline_id")), key=lambda r: r.info.start_time)
    key = first.data.tags["pipeline_id"]
    group = [r for r in runs if r.data.tags.get("pipeline_id") == key]
    parent = next(r for r in group if r.data.tags.get("parent") == "true")
    children = [r for r in group if r is not parent]
    assert parent.info.run_name.startswith("repro@") and parent.data.params["optim.lr"] == "0.003"
    assert {r.info.run_name for r in children} == {f"{parent.info.run_name}/{s}" for s in STAGES}
    assert {r.data.tags["mlflow.parentRunId"] for r in children} == {parent.info.run_id}
    train = next(r for r in children if r.data.tags["stage"] == "train")
    commit = sh(project, "git", "rev-parse", "HEAD", stderr=False).strip()
    assert train.data.tags["mlflow.source.git.commit"] == commit and train.data.tags["mlflow.source.name"]
    assert "summary/median_tokens_per_second" in train.data.metrics and "mlflow.user" in train.data.tags
    assert "summary/final_val_loss" in train.data.metrics and "loss/train" in train.data.metrics
    assert "loss.png" in {a.path for a in client.list_artifacts(train.info.run_id)}  # both losses, one chart
    logs = [a.path for a in client.list_artifacts(train.info.run_id, "logs")]
    assert logs == ["logs/train.log"]  # the stage's own output, as Hydra's job log wrote it
    assert not (project / "outputs").exists()  # no stray Hydra folders under a DVC run


@pytest.mark.parametrize(
    "overrides, key, reader",
    [
        (["--config-dir", ".", "--config-name", "params", "model.d_model=64"], "model.d_model", "realize"),
        (["--config-dir", ".", "--config-name", "params", "-m", "model.d_model=32,64"], "model.d_model", "realize"),
        (["preset=lora"], "data.", "packed/meta.json"),  # group overrides compose conf/, as a hand run does
        (["recipe=from-scratch"], "recipe.", "realize.json"),
        (["-m", "recipe=from-scratch,warm-start"], "recipe", "realize"),
    ],
)
def test_a_stage_refuses_overrides_its_inputs_contradict(
    project: Path, first_repro: str, overrides, key, reader
) -> None:
    proc = run(project, sys.executable, "-m", "stages.train", *overrides)
    assert proc.returncode == 2, proc.stderr[-2000:]
    error = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and key in error[0] and reader in error[0] and "dvc exp run -S" in error[0], proc.stderr
    assert "train:" not in proc.stdout  # refused before any work


def test_output_json_is_one_object_on_stdout(project: Path, first_repro: str) -> None:
    out = sh(
        project,
        sys.executable,
        "-m",
        "stages.export",
        "--config-dir",
        ".",
        "--config-name",
        "params",
        "output=json",
        stderr=False,
    )
    record = json.loads(out)  # exactly one JSON document, nothing else on stdout
    assert record["stage"] == "export" and record["metrics"]["file_bytes"] > 0 and record["mlflow_run_id"]


def test_optuna_sweep_minimises_the_train_objective_under_one_parent(project: Path, first_repro: str) -> None:
    args = ["-m", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=3", "hydra.sweeper.direction=minimize"]
    args += ["hydra.sweep.dir=multirun/optuna", "optim.lr=interval(0.0005,0.01)"]
    out = sh(project, sys.executable, "-m", "stages.train", *args)
    assert "alembic" not in out  # the sweeper's database library narrates nothing
    _, runs = mlflow_runs(project)
    sweep = str((project / "multirun" / "optuna").resolve())
    parent = [r for r in runs if r.data.tags.get("sweep_dir") == sweep and r.data.tags.get("parent") == "true"]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent[0].info.run_id]
    assert len(parent) == 1 and len(children) == 3
    best = yaml.safe_load((project / "multirun" / "optuna" / "optimization_results.yaml").read_text())
    assert best["best_value"] == pytest.approx(min(r.data.metrics["summary/kept_val_loss"] for r in children))


def test_parallel_jobs_on_a_fresh_store_make_one_parent_and_lose_nothing(project: Path, first_repro: str) -> None:
    store = project / "parallel.db"
    args = ["-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=3", "train.threads=1", "++train.resume=never"]
    args += ["optim.lr=0.001,0.002,0.004"]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env["MLFLOW_TRACKING_URI"] = f"sqlite:///{store}"
    proc = subprocess.run(
        [sys.executable, "-m", "stages.train", *args], cwd=project, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{store}")
    runs = client.search_runs([client.get_experiment_by_name("smollm-pipeline").experiment_id])
    parents = [r for r in runs if r.data.tags.get("parent") == "true"]
    children = [r for r in runs if r.data.tags.get("parent") != "true"]
    assert len(parents) == 1 and len(children) == 3
    assert {r.data.tags["mlflow.parentRunId"] for r in children} == {parents[0].info.run_id}
    for r in children:
        assert [m.step for m in client.get_metric_history(r.info.run_id, "loss/train")] == [1, 2, 3, 4, 5, 6]


def test_a_sweep_through_the_submitit_launcher_runs_each_job_in_a_process_and_dir_of_its_own(
    project: Path, first_repro: str
) -> None:
    """The scale-out path of docs/training.md, run: `hydra/launcher=submitit_local` is the submitit plugin's own
    executor on this machine (`submitit_slurm` differs only in where the jobs run), so moving a sweep to a
    cluster changes one launcher line. One MLflow parent, a child per job, each job's outputs in its own dir."""
    sweep = project / "multirun" / "submitit"
    args = ["-m", "hydra/launcher=submitit_local", "hydra.launcher.timeout_min=15", f"hydra.sweep.dir={sweep}"]
    sh(project, sys.executable, "-m", "stages.train", *args, "optim.lr=0.002,0.005", timeout=900)
    _, runs = mlflow_runs(project)
    mine = str(sweep.resolve())
    parents = [r for r in runs if r.data.tags.get("sweep_dir") == mine and r.data.tags.get("parent") == "true"]
    assert len(parents) == 1
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id]
    assert sorted(r.data.params["optim.lr"] for r in children) == ["0.002", "0.005"]
    for job in ("0", "1"):
        assert (sweep / job / "train" / "model.safetensors").is_file()
        assert json.loads((sweep / job / "metrics.json").read_text())["final_val_loss"] > 0


def test_queued_experiments_log_to_the_project_store_and_compare(project: Path, first_repro: str) -> None:
    sh(project, "git", "add", "-A")
    sh(project, "git", "commit", "-qm", "baseline: dvc.lock, metrics and plots")
    sh(project, "dvc", "exp", "run", "--queue", "-S", "optim.lr=0.001,0.004", tracking_uri=False)
    sh(project, "dvc", "exp", "run", "--run-all", timeout=900, tracking_uri=False)  # no MLFLOW_TRACKING_URI set
    rows = json.loads(sh(project, "dvc", "exp", "show", "--json", stderr=False))
    baseline = next(row for row in rows if row.get("experiments"))  # rows[0] is the workspace
    exps = {rev["name"]: rev for e in baseline["experiments"] for rev in e["revs"]}
    assert len(exps) == 2
    for row in [baseline, *exps.values()]:  # metrics in every row, the baseline commit's included
        assert row["data"]["metrics"]["metrics/train.json"]["data"]["final_val_loss"] > 0, row["name"]
    lrs = {rev["data"]["params"]["params.yaml"]["data"]["optim"]["lr"] for rev in exps.values()}
    assert lrs == {0.001, 0.004}
    name = next(iter(exps))
    assert "final_val_loss" in sh(project, "dvc", "metrics", "diff", "HEAD", name)
    sh(project, "dvc", "plots", "diff", "HEAD", *exps, "-o", str(project / "plots_diff"))
    assert (project / "plots_diff" / "index.html").is_file()
    _, runs = mlflow_runs(project)  # the project's own mlflow.db, found through DVC_ROOT
    for exp_name in exps:
        parent = [r for r in runs if r.info.run_name == exp_name and r.data.tags.get("parent") == "true"]
        assert len(parent) == 1 and parent[0].data.tags["dvc_exp_name"] == exp_name
        children = {r.info.run_name for r in runs if r.data.tags.get("mlflow.parentRunId") == parent[0].info.run_id}
        assert children == {f"{exp_name}/{s}" for s in ("train", "export", "evaluate", "report")}


def test_editing_the_corpus_in_place_reruns_pack(project: Path, first_repro: str) -> None:
    corpus = project / "corpus.txt"
    corpus.write_text("\n---\n".join(f"document {i}: " + "the model reads text. " * 60 for i in range(12)))
    params = sh(project, sys.executable, "-m", "stages.compose", "data=text", "data.path=corpus.txt", stderr=False)
    (project / "params.yaml").write_text(params)
    assert ran(sh(project, "dvc", "repro", "pack")) == ["inputs", "pack"]
    assert ran(sh(project, "dvc", "repro", "pack")) == ["inputs"]  # unchanged file: nothing re-runs
    corpus.write_text(corpus.read_text() + "\n---\nan eleventh-hour document, edited in place")
    assert ran(sh(project, "dvc", "repro", "pack")) == ["inputs", "pack"]
    corpus.unlink()
    proc = run(project, "dvc", "repro", "pack")
    assert proc.returncode != 0 and "data.path=corpus.txt: expected an existing file" in proc.stdout + proc.stderr
    sh(project, "git", "checkout", "params.yaml")


def test_lora_preset_runs_through_every_stage_on_smollm2(project: Path, first_repro: str) -> None:
    overrides = [
        "preset=lora",
        "train.epochs=0",
        "train.steps=2",
        "train.batch_size=2",
        "train.eval_every=2",
        "train.device=cpu",
    ]
    overrides += ["train.checkpoint_every=0", "evaluate.max_new_tokens=4", "evaluate.prompts=[a]"]
    out = sh(project, "dvc", "exp", "run", *(x for o in overrides for x in ("-S", o)), timeout=1200)
    assert ran(out) == ["inputs", *STAGES]
    params = (project / "params.yaml").read_text()
    assert "trainable: lora" in params and "source: instruct" in params
    pack = json.loads((project / "metrics" / "pack.json").read_text())
    assert pack["examples_val"] > 0 and pack["chat_template"] == 1.0 and "truncated_train" in pack
    train = json.loads((project / "metrics" / "train.json").read_text())
    evaluate = json.loads((project / "metrics" / "evaluate.json").read_text())
    assert abs(evaluate["val_loss"] - train["kept_val_loss"]) <= 1e-3  # merged f32 GGUF == base + adapter
    assert abs(evaluate["base_val_loss"] - train["initial_val_loss"]) <= 1e-3  # the base GGUF == step 0
    val_rows = (project / "plots" / "train" / "val_loss.tsv").read_text().splitlines()
    assert val_rows[1].split("\t")[:2] == ["0", f"{train['initial_val_loss']:.8g}"]  # the curve starts at the base
    export = project / "models" / "export"
    named = "SmolLM2-135M-Instruct-lora-pydoc-F32.gguf"  # the conventional name beside the stable one
    assert {p.name for p in export.iterdir()} == {"model.gguf", named, "README.md", "adapter.gguf", "peft"}
    # evaluate runs the merged file in llama.cpp whenever llama-cpp-python is installed (CI installs it)
    assert ("llamacpp_mean_kl" in evaluate) == llamacpp_installed(), sorted(evaluate)
    if llamacpp_installed():
        assert evaluate["llamacpp_mean_kl"] < 0.03 and evaluate["llamacpp_top1_agreement"] > 0.9
    from pipeline.finetune.adapters import read_adapter_gguf

    adapter = read_adapter_gguf(export / "adapter.gguf")
    assert adapter.rank == 8 and adapter.targets == ("q", "v") and len(adapter.state) == 2 * 2 * 30
    _, runs = mlflow_runs(project)
    latest = max(
        (r for r in runs if r.data.tags.get("stage") == "train" and "parent" not in r.data.tags),
        key=lambda r: r.info.start_time,
    )
    assert latest.data.tags["recipe"] == "lora" and latest.data.params["recipe.lora.rank"] == "8"
    assert "summary/initial_val_loss" in latest.data.metrics and "epoch" in latest.data.metrics
