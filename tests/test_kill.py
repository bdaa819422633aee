"""Kill safety under fire: train SIGKILLed ten times (at random moments, some in the middle of a
checkpoint write) and resumed each time ends bit-identical to an uninterrupted run, in the same
MLflow run with exactly one value per step; a SIGKILL mid-export leaves the last export whole; temp
files of killed processes are removed by the next write of the same path, those of live ones kept."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pipeline.io.files import sha256_file
from tests.test_resume import assert_same_weights, make_project, newest_step, stage_cmd, stage_env, start

STEPS = 48  # ten kills advance at most ~40 steps (see `kill_once`): the last run still trains
KILLS = 10


@pytest.fixture(scope="module")
def project(tmp_path_factory, smollm2) -> Path:
    return make_project(tmp_path_factory.mktemp("kill"), smollm2)


def run_to_end(project: Path, cmd: list[str]) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=project, env=stage_env(project), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def wait_until(proc: subprocess.Popen, done, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert proc.poll() is None, f"the run ended before it was killed: {proc.communicate()[1][-2000:]}"
        assert time.monotonic() < deadline, "timed out waiting for the run"
        time.sleep(0.001)


def kill_once(project: Path, ckpt_dir: Path, rng: random.Random, mid_write: bool) -> int:
    """Start (or resume) the run and SIGKILL it once it has written a new checkpoint: either as soon
    as its next checkpoint's temp directory appears (mid-write, +2 steps), or after a random 0-50 ms
    at any point of the loop (MLflow flush, step, rename, pruning: +2 to about +6 steps)."""
    before = newest_step(ckpt_dir)
    proc = start(project, stage_cmd(ckpt_dir, STEPS))
    wait_until(proc, lambda: newest_step(ckpt_dir) > before)
    if mid_write:
        wait_until(proc, lambda: any(ckpt_dir.glob(f"*/.step-*.tmp-{proc.pid}")))
    else:
        time.sleep(rng.uniform(0, 0.05))
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    return newest_step(ckpt_dir)


def metric_steps(project: Path, run_id: str) -> dict[str, dict[int, list[float]]]:
    """Every metric key of the run: step -> the values the store holds for it."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{project / 'mlflow.db'}")
    out: dict[str, dict[int, list[float]]] = {}
    for key in client.get_run(run_id).data.metrics:
        for m in client.get_metric_history(run_id, key):
            out.setdefault(key, {}).setdefault(m.step, []).append(m.value)
    return out


def assert_same_optimizer(a: dict, b: dict) -> None:
    assert a["param_groups"] == b["param_groups"] and a["state"].keys() == b["state"].keys()
    for name, state in a["state"].items():
        assert state.keys() == b["state"][name].keys(), name
        for k, v in state.items():
            assert torch.equal(v, b["state"][name][k]) if torch.is_tensor(v) else v == b["state"][name][k], (name, k)


@pytest.mark.slow
def test_ten_sigkills_then_resume_is_bit_identical_with_one_metric_value_per_step(
    project: Path, tmp_path: Path
) -> None:
    out = project / "models" / "train"
    run_to_end(project, stage_cmd(tmp_path / "ref", STEPS, "train.resume=never"))
    ref_weights = load_file(str(out / "model.safetensors"))
    ref_optim = torch.load(out / "optimizer.pt", weights_only=True)
    ref_state = json.loads((out / "train_state.json").read_text())
    ref_metrics = metric_steps(project, ref_state["mlflow_run_id"])
    subprocess.run(["rm", "-rf", str(out)], check=True)

    rng = random.Random(16)
    ckpt_dir = tmp_path / "killed"
    reached = [kill_once(project, ckpt_dir, rng, mid_write=i % 2 == 0) for i in range(KILLS)]
    assert not out.exists() and reached == sorted(reached) and reached[-1] < STEPS, reached
    resumed = run_to_end(project, stage_cmd(ckpt_dir, STEPS))
    assert f"resuming at step {reached[-1]}" in resumed.stdout

    assert_same_weights(ref_weights, load_file(str(out / "model.safetensors")))
    assert_same_optimizer(ref_optim, torch.load(out / "optimizer.pt", weights_only=True))
    state = json.loads((out / "train_state.json").read_text())
    assert state["final_val_loss"] == ref_state["final_val_loss"] and state["resumed_from"] == reached[-1]
    # one MLflow run across the eleven processes, holding exactly one value per step of every curve
    metrics = metric_steps(project, state["mlflow_run_id"])
    assert {k: sorted(v) for k, v in metrics.items() if not k.startswith("summary/")} == {
        k: sorted(v) for k, v in ref_metrics.items() if not k.startswith("summary/")
    }
    assert sorted(metrics["loss/train"]) == list(range(1, STEPS + 1))
    assert all(len(values) == 1 for curve in metrics.values() for values in curve.values()), metrics["loss/train"]
    assert metrics["loss/train"] == ref_metrics["loss/train"] and metrics["loss/val"] == ref_metrics["loss/val"]
    # the temp directories of the killed writers are gone
    assert not list(ckpt_dir.glob("*/.step-*")) and not list(out.parent.glob(".train.*"))


def dead_pid() -> int:
    """The pid of a process that has ended (reaped: no process has it, barring a quick reuse)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_write_removes_the_temps_of_dead_writers_only(tmp_path: Path) -> None:
    from pipeline.io.files import atomic_dir, atomic_file, write_json

    dead, live = dead_pid(), os.getppid()
    stale = [tmp_path / f".meta.json.tmp-{dead}", tmp_path / f".ids.tmp-{dead}.npz"]
    stale_dirs = [tmp_path / f".train.tmp-{dead}", tmp_path / f".train.old-{dead}"]
    kept = [tmp_path / f".meta.json.tmp-{live}", tmp_path / f".other.json.tmp-{dead}", tmp_path / ".meta.json.tmp-x"]
    for p in stale + kept:
        p.write_bytes(b"half")
    for d in stale_dirs:
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"half")
    write_json(tmp_path / "meta.json", {"ok": 1})
    assert not stale[0].exists() and all(p.exists() for p in kept), "only meta.json's dead temps go"
    with atomic_dir(tmp_path / "train") as d:
        (d / "model.safetensors").write_bytes(b"whole")
    assert not any(d.exists() for d in stale_dirs)
    assert (tmp_path / "train" / "model.safetensors").read_bytes() == b"whole"
    with atomic_file(tmp_path / "ids", suffix=".npz") as t:
        t.write_bytes(b"whole")
    assert not stale[1].exists() and all(p.exists() for p in kept)


@pytest.mark.slow
def test_sigkill_mid_export_leaves_the_last_export_and_the_next_run_clears_its_temp(
    project: Path, tmp_path: Path
) -> None:
    root = tmp_path / "export"
    shutil.copytree(project / "models" / "init", root / "models" / "train")  # export reads any model dir
    cmd = [sys.executable, "-m", "stages.export", "tracking.enabled=false"]
    out = root / "models" / "export" / "model.gguf"
    run_to_end(root, cmd)
    first = sha256_file(out)
    proc = start(root, cmd)
    wait_until(proc, lambda: any((root / "models").glob(f".export.tmp-{proc.pid}/.model.gguf.tmp-{proc.pid}")))
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    left = root / "models" / f".export.tmp-{proc.pid}"
    assert left.is_dir() and sha256_file(out) == first, "the killed write must not touch models/export"
    shipped = sorted(p.name for p in out.parent.iterdir())  # model.gguf, its conventional name, the card
    assert "model.gguf" in shipped and "README.md" in shipped and not [n for n in shipped if ".tmp-" in n]
    run_to_end(root, cmd)
    assert sorted(p.name for p in out.parent.iterdir()) == shipped
    assert not left.exists() and sha256_file(out) == first
    assert sorted(p.name for p in (root / "models").iterdir()) == ["export", "train"]
