"""Never lose work: atomic checkpoints, newest-valid resume, bit-identical continuation (ten SIGKILLs: test_kill),
SIGTERM stopping with a checkpoint, non-finite steps stopping (or skipped), and named errors for a
checkpoint of another configuration."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from pipeline.config import DataConfig, ModelConfig, OptimConfig, TrainConfig
from pipeline.data.packed import load_split
from pipeline.data.text import pack
from pipeline.errors import CheckpointError, ConfigError, NonFiniteError
from pipeline.init.realize import realize
from pipeline.modeldir import MODEL_FILE, load_model_dir, save_model_dir
from pipeline.training import checkpoint as ckpt
from pipeline.training.loop import TrainJob, train
from pipeline.training.resume import plan_checkpoints
from pipeline.training.runtime import interrupted
from tests.conftest import ROOT

TINY = ModelConfig(d_model=32, n_layer=2, n_head=4, n_kv_head=2, d_ff=64, context_length=64)
TCFG = TrainConfig(steps=8, batch_size=4, seq_len=32, eval_every=4, log_every=1, checkpoint_every=2, keep_checkpoints=3)


def make_project(root: Path, gguf, n_docs: int = 12) -> Path:
    """A project directory as the stages see it: real packed text and tiny initial weights."""
    from pipeline.data.corpus import load_documents
    from pipeline.tokenizer.gguf_tokenizer import tokenizer_from_gguf

    root.mkdir(parents=True, exist_ok=True)
    docs = load_documents(DataConfig())[:n_docs]
    meta, _ = pack(docs, tokenizer_from_gguf(gguf), DataConfig(val_fraction=0.2), root / "data" / "packed")
    (root / "models" / "init").mkdir(parents=True)
    save_model_dir(root / "models" / "init", realize(TINY, "scratch", meta.vocab_size, 0))
    return root


@pytest.fixture(scope="module")
def project(tmp_path_factory, smollm2) -> Path:
    return make_project(tmp_path_factory.mktemp("resume"), smollm2)


def run_lib(
    project: Path,
    tcfg: TrainConfig,
    ckpt_dir: Path,
    optim: OptimConfig | None = None,
    seed: int = 0,
    init: str = "init",
):
    """The library path of the train stage: plan checkpoints, train the initial weights."""
    optim = optim or OptimConfig(lr=3e-3, warmup_steps=2)
    plan = plan_checkpoints(tcfg, optim, seed, project / "models" / init, project / "data" / "packed", ckpt_dir)
    model = load_model_dir(project / "models" / init)
    packed = project / "data" / "packed"
    result = train(
        model,
        load_split(packed, "train"),
        load_split(packed, "val"),
        TrainJob(tcfg, optim, seed, plan=plan, progress=False),
    )
    return model, result, plan


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("optimizer", ["adamw", "lbfgs", "adamw-frozen-table"])
def test_resume_from_a_middle_checkpoint_is_bit_identical(project: Path, tmp_path: Path, optimizer: str) -> None:
    """Also with the token table frozen (optim.table_lr_scale=0): its checkpoints hold only what trains."""
    optim = (
        OptimConfig(lr=3e-3, warmup_steps=2) if optimizer == "adamw" else OptimConfig(name="lbfgs", lr=0.5, grad_clip=0)
    )
    if optimizer == "adamw-frozen-table":
        optim = OptimConfig(warmup_steps=2, table_lr_scale=0.0)
    full, full_result, plan = run_lib(project, TCFG, tmp_path, optim)
    assert [s for s, _ in ckpt.step_dirs(plan.root)] == [8, 6, 4]
    saved = safe_open(str(plan.root / ckpt.step_name(4) / MODEL_FILE), "pt").keys()
    assert set(saved) == set(full.state_dict())  # every weight, a frozen table too (export reads them)
    for s in (8, 6):  # as if the process had died right after writing step 4
        ckpt.shutil.rmtree(plan.root / ckpt.step_name(s))
    resumed, result, _ = run_lib(project, TCFG, tmp_path, optim)
    assert result.resumed_from == 4
    assert_same_weights(full.state_dict(), resumed.state_dict())
    assert [h["train_loss"] for h in result.history] == [h["train_loss"] for h in full_result.history]
    assert [h["step"] for h in result.history] == list(range(1, 9))


def test_keeps_the_newest_k(project: Path, tmp_path: Path) -> None:
    _, _, plan = run_lib(project, replace(TCFG, steps=5, checkpoint_every=1, keep_checkpoints=2), tmp_path)
    assert [s for s, _ in ckpt.step_dirs(plan.root)] == [5, 4]
    state = json.loads((plan.root / ckpt.step_name(5) / "state.json").read_text())
    assert {"model.safetensors", "optimizer.pt", "rng.pt", "config.json"} <= set(state["files"])
    assert {"sampler", "rng", "history", "compat", "mlflow_run_id"} <= set(state)


def test_corrupt_newest_checkpoint_is_reported_and_the_one_before_used(project: Path, tmp_path: Path) -> None:
    _, _, plan = run_lib(project, TCFG, tmp_path)
    weights = plan.root / ckpt.step_name(8) / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0xFF
    weights.write_bytes(bytes(data))
    reports: list[str] = []
    again = plan_checkpoints(
        TCFG,
        OptimConfig(lr=3e-3, warmup_steps=2),
        0,
        project / "models/init",
        project / "data/packed",
        tmp_path,
        reports.append,
    )
    assert again.resume is not None and again.resume.step == 6
    assert len(reports) == 1 and "step-00000008" in reports[0] and "corrupt" in reports[0]


def test_corrupt_newer_checkpoints_never_prune_the_new_ones(project: Path, tmp_path: Path, monkeypatch) -> None:
    """Every checkpoint corrupt (a disk that filled up): the re-run starts over, and each checkpoint it writes
    is there right after (the corrupt step-8 and step-6 outranked and pruned the new step-2 and step-4)."""
    _, _, plan = run_lib(project, TCFG, tmp_path)
    for s in (4, 6, 8):
        weights = plan.root / ckpt.step_name(s) / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:100])
    written: list[tuple[int, bool]] = []
    write = ckpt.write

    def checked(root: Path, step: int, *args, **kw) -> Path:
        path = write(root, step, *args, **kw)
        written.append((step, path.is_dir()))
        return path

    monkeypatch.setattr(ckpt, "write", checked)
    _, result, again = run_lib(project, TCFG, tmp_path)
    assert again.resume is None and result.resumed_from == 0
    assert written == [(2, True), (4, True), (6, True), (8, True)]
    assert [s for s, _ in ckpt.step_dirs(plan.root)] == [8, 6, 4]
    assert ckpt.validate(plan.root / ckpt.step_name(8)).step == 8


@pytest.fixture(scope="module")
def trained(project: Path, tmp_path_factory) -> Path:
    """The checkpoints of one TCFG run (steps 4, 6, 8), for tests that spoil a copy."""
    ckpt_dir = tmp_path_factory.mktemp("trained")
    run_lib(project, TCFG, ckpt_dir)
    return ckpt_dir


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        ({"step": "8"}, "step: expected int, found str '8'"),
        ({"history": {"1": 2}}, "history: expected list"),
        ({"mlflow_run_id": 7}, "mlflow_run_id: expected str or null, found int 7"),
        ({"best_val_loss": "low", "skipped_steps": -1}, "(>= 0), found -1; best_val_loss: expected float or null"),
        ({"files": None}, "files: expected dict"),
    ],
)
def test_a_checkpoint_state_of_wrong_types_is_named_and_skipped(project, trained: Path, tmp_path: Path, edit, named):
    ckpt.shutil.copytree(trained, tmp_path, dirs_exist_ok=True)
    (root,) = [d for d in tmp_path.iterdir() if d.is_dir()]
    state_file = root / ckpt.step_name(8) / "state.json"
    state_file.write_text(json.dumps({**json.loads(state_file.read_text()), **edit}))
    reports: list[str] = []
    again = plan_checkpoints(
        TCFG,
        OptimConfig(lr=3e-3, warmup_steps=2),
        0,
        project / "models/init",
        project / "data/packed",
        tmp_path,
        reports.append,
    )
    assert again.resume is not None and again.resume.step == 6  # train.resume=auto: the one before it
    assert len(reports) == 1 and f"{state_file}: expected a checkpoint state as train writes it" in reports[0]
    assert named in reports[0] and "fix: delete that step directory" in reports[0], reports[0]
    with pytest.raises(CheckpointError, match="train.resume=never") as info:  # an explicit path: refused
        ckpt.resolve(state_file.parent)
    assert named in str(info.value) and "\n" not in str(info.value)


def test_when_every_checkpoint_is_corrupt_the_last_report_says_the_run_starts_over(
    project, trained: Path, tmp_path: Path
) -> None:
    ckpt.shutil.copytree(trained, tmp_path, dirs_exist_ok=True)
    (root,) = [d for d in tmp_path.iterdir() if d.is_dir()]
    for step in (4, 6, 8):
        (root / ckpt.step_name(step) / "state.json").write_text("{")
    reports: list[str] = []
    again = plan_checkpoints(
        TCFG,
        OptimConfig(lr=3e-3, warmup_steps=2),
        0,
        project / "models/init",
        project / "data/packed",
        tmp_path,
        reports.append,
    )
    assert again.resume is None and len(reports) == 3
    assert all("trying the one before it" in r for r in reports[:2]), reports
    assert "no older checkpoint, starting from step 0" in reports[2], reports[2]


def test_a_train_state_of_wrong_types_is_one_named_line_from_export(project: Path, tmp_path: Path) -> None:
    from pipeline.modeldir import TrainState, read_train_state

    train_dir = tmp_path / "models" / "train"
    ckpt.shutil.copytree(project / "models" / "init", train_dir)
    good = TrainState(steps=8, tokens_seen=1024, final_train_loss=3.0, final_val_loss=3.5, seq_len=32, batch_size=4)
    (train_dir / "train_state.json").write_text(json.dumps({**vars(good), "steps": "eight", "kept_step": 2.5}))
    with pytest.raises(ConfigError) as info:
        read_train_state(train_dir)
    message = str(info.value)
    assert message.startswith(f"{train_dir / 'train_state.json'}: expected a train state as the train stage writes it")
    assert "steps: expected int, found str 'eight'; kept_step: expected int or null, found float 2.5" in message
    assert message.endswith("fix: the train stage writes it: re-run `dvc repro -f train`")
    (train_dir / "train_state.json").write_text(json.dumps({k: v for k, v in vars(good).items() if k != "seq_len"}))
    with pytest.raises(ConfigError, match="seq_len: missing"):
        read_train_state(train_dir)
    env = {**stage_env(project), "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    cmd = [sys.executable, "-m", "stages.export", "tracking.enabled=false"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "seq_len: missing" in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and not (tmp_path / "models" / "export").exists()


def test_a_crash_mid_write_leaves_the_previous_checkpoints(tmp_path: Path) -> None:
    def good(p: Path) -> None:
        p.write_bytes(b"weights")

    ckpt.write(tmp_path, 2, lambda d: good(d / "w.bin"), {"x": 1}, keep=3)

    def dies(p: Path) -> None:
        p.write_bytes(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError):
        ckpt.write(tmp_path, 4, lambda d: (good(d / "w.bin"), dies(d / "opt.pt")), {"x": 2}, keep=3)
    # what a SIGKILL mid-write leaves: a temp dir of a process that no longer runs
    stale = tmp_path / ".step-00000006.tmp-999999999"
    stale.mkdir()
    (stale / "w.bin").write_bytes(b"half")
    found = ckpt.newest_valid(tmp_path)
    assert found is not None and found.step == 2 and found.state["x"] == 1
    assert [s for s, _ in ckpt.step_dirs(tmp_path)] == [2]
    ckpt.write(tmp_path, 4, lambda d: good(d / "w.bin"), {"x": 3}, keep=3)
    assert not stale.exists() and ckpt.newest_valid(tmp_path).step == 4


def test_explicit_resume_from_another_config_names_the_differing_keys(project: Path, tmp_path: Path) -> None:
    _, _, plan = run_lib(project, replace(TCFG, steps=4), tmp_path)
    other = replace(TCFG, resume=str(plan.root / ckpt.step_name(4)))
    with pytest.raises(ConfigError) as err:
        plan_checkpoints(other, OptimConfig(lr=1e-3), 0, project / "models/init", project / "data/packed", tmp_path)
    message = str(err.value)
    assert "train.steps" in message and "optim.lr" in message and "optim.warmup_steps" in message
    assert "model." not in message and "\n" not in message
    # the same checkpoint with its own configuration is accepted
    same = plan_checkpoints(
        replace(TCFG, steps=4, resume=str(plan.root)),
        OptimConfig(lr=3e-3, warmup_steps=2),
        0,
        project / "models/init",
        project / "data/packed",
        tmp_path,
    )
    assert same.resume.step == 4


def test_explicit_resume_of_another_model_names_the_model_keys(project: Path, tmp_path: Path) -> None:
    wider = project / "models" / "init-wider"
    wider.mkdir()
    save_model_dir(wider, realize(replace(TINY, d_model=48, n_head=6, n_kv_head=3), "scratch", 49152, 0))
    _, _, plan = run_lib(project, replace(TCFG, steps=2), tmp_path, init="init-wider")
    with pytest.raises(ConfigError) as err:
        plan_checkpoints(
            replace(TCFG, steps=2, resume=str(plan.root)),
            OptimConfig(lr=3e-3, warmup_steps=2),
            0,
            project / "models/init",
            project / "data/packed",
            tmp_path,
        )
    message = str(err.value)
    for key in ("model.d_model", "model.n_head", "model.n_kv_head", "init_weights"):
        assert key in message
    assert "train.steps" not in message and "optim." not in message


def test_auto_resume_ignores_checkpoints_of_other_configs(project: Path, tmp_path: Path) -> None:
    run_lib(project, replace(TCFG, steps=4), tmp_path)
    plan = plan_checkpoints(TCFG, OptimConfig(), 0, project / "models/init", project / "data/packed", tmp_path)
    assert plan.resume is None


def nan_after(model: torch.nn.Module, calls: int) -> None:
    """Make the final norm's output NaN from its `calls`-th training call on."""
    seen = {"n": 0}

    def hook(module, inputs, output):
        if not torch.is_grad_enabled():
            return None
        seen["n"] += 1
        return output * float("nan") if seen["n"] == calls else None

    model.norm.register_forward_hook(hook)


def test_nonfinite_loss_stops_naming_the_step_and_keeps_the_last_checkpoint(project: Path, tmp_path: Path) -> None:
    optim = OptimConfig(lr=3e-3, warmup_steps=2)
    plan = plan_checkpoints(TCFG, optim, 0, project / "models/init", project / "data/packed", tmp_path)
    model = load_model_dir(project / "models/init")
    nan_after(model, 5)
    packed = project / "data/packed"
    with pytest.raises(NonFiniteError) as err:
        train(
            model,
            load_split(packed, "train"),
            load_split(packed, "val"),
            TrainJob(TCFG, optim, 0, plan=plan, progress=False),
        )
    message = str(err.value)
    assert message.startswith("train step 5:") and "step-00000004" in message and "skip_nonfinite" in message
    assert [s for s, _ in ckpt.step_dirs(plan.root)] == [4, 2]


def test_skip_nonfinite_skips_and_counts(project: Path, tmp_path: Path) -> None:
    tcfg = replace(TCFG, skip_nonfinite=True)
    optim = OptimConfig(lr=3e-3, warmup_steps=2)
    model = load_model_dir(project / "models/init")
    nan_after(model, 3)
    packed = project / "data/packed"
    result = train(
        model, load_split(packed, "train"), load_split(packed, "val"), TrainJob(tcfg, optim, 0, progress=False)
    )
    assert result.skipped_steps == 1
    assert [h["skipped_steps"] for h in result.history] == [0, 0, 1, 1, 1, 1, 1, 1]
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert np.isfinite(result.final_val_loss)


# --- the train stage as a process: SIGKILL, SIGTERM, MLflow continuity -------------------------


def stage_cmd(ckpt_dir: Path, steps: int, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "stages.train",
        "recipe=from-scratch",  # the tiny scratch init of make_project, trained without distillation
        "optim=adamw",  # the optimizer the library references use (OptimConfig's defaults)
        f"train.steps={steps}",
        "train.batch_size=4",
        "train.seq_len=32",
        "train.eval_every=8",
        "train.log_every=1",
        "train.checkpoint_every=2",
        "train.keep_checkpoints=3",
        "train.device=cpu",
        "train.threads=1",
        f"train.checkpoint_dir={ckpt_dir}",
        "optim.warmup_steps=4",
        "data.val_fraction=0.2",  # what make_project packed with: the lineage check compares
        *extra,
    ]


def stage_env(project: Path) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "MLFLOW_TRACKING_URI": f"sqlite:///{project / 'mlflow.db'}",
        "HYDRA_FULL_ERROR": "0",
    }


def start(project: Path, cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        cmd, cwd=project, env=stage_env(project), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def newest_step(ckpt_dir: Path) -> int:
    steps = [s for d in ckpt_dir.glob("*") if d.is_dir() for s, _ in ckpt.step_dirs(d)]
    return max(steps, default=0)


def wait_for_checkpoint(proc: subprocess.Popen, ckpt_dir: Path, step: int, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while newest_step(ckpt_dir) < step:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.005)


def metric_history(project: Path, run_id: str, key: str = "loss/train") -> dict[int, list[float]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{project / 'mlflow.db'}")
    out: dict[int, list[float]] = {}
    for m in client.get_metric_history(run_id, key):
        out.setdefault(m.step, []).append(m.value)
    return out


def run_status(project: Path, run_id: str) -> str:
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{project / 'mlflow.db'}").get_run(run_id).info.status


def mark_killed(project: Path, run_id: str) -> None:
    """What a killed job leaves in the store (a run that FINISHED is not reopened by a later execution)."""
    from mlflow.tracking import MlflowClient

    MlflowClient(tracking_uri=f"sqlite:///{project / 'mlflow.db'}").set_terminated(run_id, "KILLED")


@pytest.mark.slow
def test_sigterm_finishes_the_step_checkpoints_and_exits_nonzero(project: Path, tmp_path: Path) -> None:
    proc = start(project, stage_cmd(tmp_path / "c", 5000))
    wait_for_checkpoint(proc, tmp_path / "c", 2)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM
    lines = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "stopped by SIGTERM after step" in lines[0] and "Traceback" not in stderr
    stopped = int(lines[0].split("after step ")[1].split(":")[0])
    assert newest_step(tmp_path / "c") == stopped
    (key_dir,) = [d for d in (tmp_path / "c").iterdir() if d.is_dir()]
    found = ckpt.newest_valid(key_dir)
    assert found.step == stopped and run_status(project, found.run_id) == "KILLED"


def test_stage_marks_the_mlflow_run_failed_on_a_nonfinite_loss(project: Path, tmp_path: Path, monkeypatch) -> None:
    from stages.compose import compose_config
    from stages.train import body, prepared

    monkeypatch.chdir(project)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    cfg = compose_config(stage_cmd(tmp_path / "d", 6)[3:] + ["train.eval_every=3"])
    from pipeline.training.session import Forward

    original = Forward.forward
    calls = {"n": 0}

    def poisoned(self, idx, targets=None):
        out = original(self, idx, targets)
        if targets is not None:
            calls["n"] += 1
            if calls["n"] == 3:
                return out * float("nan")
        return out

    monkeypatch.setattr(Forward, "forward", poisoned)
    stage, plan = prepared(cfg)
    with pytest.raises(SystemExit) as exit_info:
        stage.run(lambda ctx: body(ctx, plan))
    assert exit_info.value.code == 2
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("smollm-pipeline").experiment_id])
    assert run.info.status == "FAILED" and run.data.tags["error"].startswith("train step 3:")
    assert [s for s, _ in ckpt.step_dirs(plan.root)] == [2]


def test_a_stop_in_a_dvc_temp_copy_does_not_promise_a_resume() -> None:
    """A queued or --temp experiment runs in .dvc/tmp/exps/<tmp>/, which DVC deletes with its checkpoints:
    "run again with train.resume=auto to continue" promised a resume that re-queuing cannot give."""
    here = str(interrupted(signal.SIGTERM, 6, "/p/checkpoints/k/step-00000006"))
    assert here.endswith("fix: run again with train.resume=auto to continue")
    copy = str(interrupted(signal.SIGTERM, 6, "/p/.dvc/tmp/exps/tmpab12/checkpoints/k/step-00000006"))
    assert "removes with its checkpoints" in copy and "resume=auto" not in copy and "\n" not in copy


def test_resuming_the_final_checkpoint_says_nothing_is_left_and_writes_the_same_outputs(
    project: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A re-run whose newest checkpoint is the last step logged "resuming at step 4" as if steps remained."""
    from safetensors.torch import load_file

    from stages.compose import compose_config
    from stages.train import body, prepared

    monkeypatch.chdir(project)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    cfg = compose_config(stage_cmd(tmp_path / "c", 4)[3:] + ["train.eval_every=2"])

    def once() -> tuple[dict[str, float], dict[str, torch.Tensor], str]:
        caplog.clear()
        with caplog.at_level("INFO"):
            stage, plan = prepared(cfg)
            metrics = stage.run(lambda ctx: body(ctx, plan))
        return metrics, load_file(str(project / "models" / "train" / "model.safetensors")), caplog.text

    runs = [once(), once()]
    (first, weights, log1), (again, weights2, log2) = runs
    assert "train: resuming at" not in log1 + log2
    assert "train: already at step 4 of 4 (" in log2 and "nothing to train" in log2
    assert_same_weights(weights, weights2)
    assert again["steps"] == 4 and again["resumed_from"] == 4
    assert again["kept_val_loss"] == first["kept_val_loss"] and again["final_val_loss"] == first["final_val_loss"]


def test_the_resume_line_says_what_remains() -> None:
    from stages.train import resume_line

    def at(step: int, **state) -> ckpt.Checkpoint:
        return ckpt.Checkpoint(Path("c/k") / ckpt.step_name(step), {"step": step, **state})

    assert resume_line(at(2), 8).startswith("train: resuming at step 2 of 8 from c/k/step-00000002")
    assert "stopped early at step 6 of 8" in resume_line(at(6, stopped_early=True), 8)
    assert "nothing to train" in resume_line(at(6, stopped_early=True), 8) and "nothing" not in resume_line(at(2), 8)
