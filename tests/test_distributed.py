"""Scale-out: the train stage under `torchrun` on CPU (gloo), DDP and FSDP, against one process with
the same total batch; resume under DDP; only rank 0 tracks and writes; named errors."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pipeline.config import OptimConfig, TrainConfig
from pipeline.data.packed import load_split
from pipeline.errors import ConfigError
from pipeline.modeldir import load_model_dir
from pipeline.training import checkpoint as ckpt
from pipeline.training import distributed as dist
from pipeline.training.loop import TrainJob, train
from tests.test_resume import assert_same_weights, make_project, mark_killed, run_lib, stage_cmd, stage_env

STEPS = 6


def test_world_size_must_divide_the_batch(monkeypatch, tmp_path: Path, smollm2) -> None:
    project = make_project(tmp_path, smollm2, n_docs=4)
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    packed = project / "data/packed"
    tcfg = TrainConfig(steps=1, batch_size=4, seq_len=16)
    with pytest.raises(ConfigError) as err:
        model = load_model_dir(project / "models/init")
        splits = load_split(packed, "train"), load_split(packed, "val")
        train(model, *splits, TrainJob(tcfg, OptimConfig(), 0, progress=False))
    assert "train.batch_size" in str(err.value) and "world size 3" in str(err.value)


def test_ranks_take_disjoint_slices_of_the_global_batch() -> None:
    batch = torch.arange(8).view(8, 1)
    parts = [dist.shard_rows(batch, dist.DistInfo(rank=r, world_size=4)) for r in range(4)]
    assert torch.equal(torch.cat(parts), batch) and all(p.shape[0] == 2 for p in parts)


def torchrun(project: Path, ckpt_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = stage_cmd(ckpt_dir, STEPS, "train.eval_every=3", *extra)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *cmd[1:]]
    proc = subprocess.run(cmd, cwd=project, env=stage_env(project), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def final_state(project: Path) -> dict:
    return json.loads((project / "models" / "train" / "train_state.json").read_text())


def losses(state_or_history) -> list[float]:
    history = state_or_history["history"] if isinstance(state_or_history, dict) else state_or_history
    return [h["train_loss"] for h in history]


@pytest.fixture(scope="module")
def project(tmp_path_factory, smollm2) -> Path:
    return make_project(tmp_path_factory.mktemp("dist"), smollm2)


@pytest.fixture(scope="module")
def single(project: Path, tmp_path_factory) -> list[float]:
    """The one-process losses: the same total batch through the library in this process."""
    tcfg = TrainConfig(steps=STEPS, batch_size=4, seq_len=32, eval_every=3, log_every=1, checkpoint_every=2)
    # optim=adamw (lr 3e-3) is what the torchrun stage runs; OptimConfig()'s lr is optim=subclone's
    _, result, _ = run_lib(project, tcfg, tmp_path_factory.mktemp("single"), OptimConfig(lr=3e-3, warmup_steps=4), 1337)
    return losses(result.history)


@pytest.fixture(scope="module")
def ddp(project: Path, tmp_path_factory) -> tuple[dict, dict[str, torch.Tensor], Path]:
    ckpt_dir = tmp_path_factory.mktemp("ddp")
    torchrun(project, ckpt_dir)
    weights = load_file(str(project / "models" / "train" / "model.safetensors"))
    return final_state(project), weights, ckpt_dir


@pytest.mark.slow
def test_ddp_two_processes_match_one_process(project: Path, single: list[float], ddp) -> None:
    state, _, _ = ddp
    assert state["world_size"] == 2
    assert losses(state) == pytest.approx(single, abs=1e-4)
    # only rank 0 tracked: one MLflow run for the whole job, with every step
    from tests.test_resume import metric_history

    assert sorted(metric_history(project, state["mlflow_run_id"])) == list(range(1, STEPS + 1))


@pytest.mark.slow
def test_ddp_resume_is_bit_identical(project: Path, ddp) -> None:
    state, weights, ckpt_dir = ddp
    (key_dir,) = [d for d in ckpt_dir.iterdir() if d.is_dir()]
    for step in (6, 4):
        shutil.rmtree(key_dir / ckpt.step_name(step))
    mark_killed(project, state["mlflow_run_id"])  # as if the job had been killed after step 2
    out = torchrun(project, ckpt_dir)
    assert "resuming at step 2" in out.stdout
    assert_same_weights(weights, load_file(str(project / "models" / "train" / "model.safetensors")))
    assert losses(final_state(project)) == losses(state)
    assert final_state(project)["mlflow_run_id"] == state["mlflow_run_id"]


@pytest.mark.slow
def test_fsdp_resumes_a_ddp_checkpoint_and_matches_one_process(
    project: Path, single: list[float], ddp, tmp_path: Path
) -> None:
    _, weights, ddp_dir = ddp
    (key_dir,) = [d for d in ddp_dir.iterdir() if d.is_dir()]
    step2 = ckpt.newest_valid(key_dir)
    while step2.step > 2:  # the DDP test may have run first and left steps 2..6
        shutil.rmtree(step2.path)
        step2 = ckpt.newest_valid(key_dir)
    shutil.copytree(key_dir, tmp_path / key_dir.name)
    out = torchrun(project, tmp_path, "train.parallel=fsdp")
    assert "resuming at step 2" in out.stdout
    state = final_state(project)
    assert losses(state) == pytest.approx(single, abs=1e-4)
    fsdp_weights = load_file(str(project / "models" / "train" / "model.safetensors"))
    assert fsdp_weights.keys() == weights.keys()
    for k in weights:
        torch.testing.assert_close(fsdp_weights[k], weights[k], rtol=0, atol=1e-5)
    final = ckpt.newest_valid(tmp_path / key_dir.name)
    assert final.step == STEPS and set(torch.load(final.path / "optimizer.pt")["state"]) == set(weights)


def test_fsdp_with_lbfgs_is_refused(monkeypatch, tmp_path: Path, smollm2) -> None:
    project = make_project(tmp_path, smollm2, n_docs=4)
    monkeypatch.setenv("WORLD_SIZE", "2")
    packed = project / "data/packed"
    tcfg = replace(TrainConfig(steps=1, batch_size=4, seq_len=16), parallel="fsdp")
    with pytest.raises(ConfigError, match="optim.name"):
        model = load_model_dir(project / "models/init")
        splits = load_split(packed, "train"), load_split(packed, "val")
        train(model, *splits, TrainJob(tcfg, OptimConfig(name="lbfgs"), 0, progress=False))
