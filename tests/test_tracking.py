"""The MLflow wrapper under concurrency, and where a stage's store is: parallel sweep jobs on a fresh
SQLite store all succeed and share one parent; a queued DVC experiment (run in a temp copy) logs
into the project's store; artifacts are placed by us only for local stores."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline.config import PipelineConfig
from pipeline.io.files import atomic_dir
from pipeline.tracking import Tracker, default_tracking_uri, is_local_store, project_root
from stages._run.lifecycle import run_stage
from stages._run.mlflow_runs import open_run, summarize_parent
from stages.compose import compose_config

WORKERS = 4


def _job(uri: str, index: int, queue) -> None:
    try:
        tracker = Tracker(uri, "concurrent", Path(uri.removeprefix("sqlite:///")).parent / "artifacts")
        parent = tracker.parent("sweep_id", "abc", "sweep-abc", {"stage": "train"})
        run = tracker.start(f"job{index}", {"sweep_id": "abc"}, parent_run_id=parent.run_id)
        for step in range(1, 21):
            run.log_metrics({"train_loss": 1.0 / step}, step)
        run.end()
        queue.put(("ok", run.run_id))
    except Exception as e:  # noqa: BLE001 - reported to the test
        queue.put(("error", repr(e)))


def test_parallel_processes_on_a_fresh_store_share_one_parent(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'fresh.db'}"
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_job, args=(uri, i, queue)) for i in range(WORKERS)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert all(kind == "ok" for kind, _ in results), results
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("concurrent").experiment_id])
    parents = [r for r in runs if r.data.tags.get("parent") == "true"]
    assert len(parents) == 1 and len(runs) == WORKERS + 1
    for _, run_id in results:
        history = client.get_metric_history(run_id, "train_loss")
        assert [m.step for m in history] == list(range(1, 21))


def test_a_reopened_run_keeps_one_value_per_step(tmp_path: Path) -> None:
    """What a resume after a kill does: the killed process had sent steps 1-5, its last checkpoint
    was step 3, so the resumed one logs steps 4-8 again; the store keeps one value per step."""
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    tracker = Tracker(uri, "resume", tmp_path / "artifacts")
    run = tracker.start("train", {})
    for step in range(1, 6):
        run.log_metrics({"loss/train": 1.0 / step, "lr": 0.1}, step)
    run.log_metrics({"loss/val": 0.5}, 2)
    run.flush()  # then SIGKILL: the run stays RUNNING
    again = tracker.resume(run.run_id)
    for step in range(4, 9):
        again.log_metrics({"loss/train": 1.0 / step, "lr": 0.1}, step)
        if step % 2 == 0:
            again.log_metrics({"loss/val": 0.25}, step)
    again.end()
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    assert [m.step for m in client.get_metric_history(run.run_id, "loss/train")] == list(range(1, 9))
    assert [m.step for m in client.get_metric_history(run.run_id, "lr")] == list(range(1, 9))
    val = client.get_metric_history(run.run_id, "loss/val")
    assert [(m.step, m.value) for m in val] == [(2, 0.5), (4, 0.25), (6, 0.25), (8, 0.25)]
    assert client.get_run(run.run_id).info.status == "FINISHED"


def test_the_store_of_a_queued_experiment_is_the_projects(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    project, temp_copy = tmp_path / "project", tmp_path / "project" / ".dvc" / "tmp" / "exps" / "tmpabc"
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("DVC_ROOT", raising=False)
    assert project_root(temp_copy) == temp_copy.resolve()
    monkeypatch.setenv("DVC_ROOT", str(project))  # what DVC sets for workspace and temp runs alike
    assert project_root(temp_copy) == project.resolve()
    assert default_tracking_uri(project_root(temp_copy)) == f"sqlite:///{project.resolve() / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.example:5000")
    assert default_tracking_uri(project) == "http://mlflow.example:5000"


@pytest.mark.parametrize(
    "uri, local",
    [
        ("sqlite:////tmp/x.db", True),
        ("file:///tmp/mlruns", True),
        ("/tmp/mlruns", True),
        ("mlruns", True),
        ("http://host:5000", False),
        ("https://host", False),
        ("databricks", False),
        ("databricks://profile", False),
    ],
)
def test_artifacts_are_placed_by_us_only_for_local_stores(uri: str, local: bool) -> None:
    assert is_local_store(uri) is local


@pytest.mark.parametrize("port", ["taken", "abc", "70000"])
def test_mlflow_ui_refuses_a_taken_or_bad_port_in_one_line(tmp_path: Path, port: str) -> None:
    """`make mlflow-ui` on a port another server holds printed `open http://127.0.0.1:<port>/...` (that other
    server's page) and `mlflow ui` then logged "Address already in use" and exited 0; a port that is no
    number ended in mlflow's usage text or a traceback. Now: one `error:` line, exit 2, no URL."""
    import os
    import socket
    import subprocess
    import sys

    from tests.conftest import ROOT

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        arg = str(busy.getsockname()[1]) if port == "taken" else port
        env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
        env["PYTHONPATH"] = str(ROOT)
        proc = subprocess.run(
            [sys.executable, "-m", "stages.mlflow_ui", arg], cwd=tmp_path, env=env, capture_output=True, text=True
        )
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: port {arg if port == 'taken' else repr(arg)}")
    assert ("it is taken" in lines[0]) == (port == "taken") and "fix: " in lines[0]
    assert not (tmp_path / "mlflow.db").exists()


@pytest.fixture
def terminal_sigint() -> Iterator[None]:
    """Ctrl-C as a terminal delivers it: a job started in the background (CI under `nohup ... &`) begins with
    SIGINT ignored, and Python then installs no KeyboardInterrupt handler."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stage_stopped_by_a_signal_is_one_line_a_killed_run_and_no_output(
    tmp_path: Path, monkeypatch, capsys, signum: int, terminal_sigint: None
) -> None:
    """SIGTERM (kill, scancel) killed pack or teach on the spot: the MLflow run stayed RUNNING and the temp
    output was left; Ctrl-C printed a traceback. Both are now one line, exit 128+N, the run KILLED."""
    from mlflow.tracking import MlflowClient

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    cfg = compose_config(["preset=tiny"])

    def body(ctx) -> dict[str, float]:
        with atomic_dir(tmp_path / "data" / "packed") as tmp:
            (tmp / "train.bin").write_bytes(b"\0" * 10)
            os.kill(os.getpid(), signum)
            time.sleep(30)  # the signal arrives long before
        return {}

    with pytest.raises(SystemExit) as exit_info:
        run_stage("pack", cfg, body)
    assert exit_info.value.code == 128 + signum
    lines = [line for line in capsys.readouterr().err.splitlines() if "mlflow.store" not in line]  # store setup
    name = signal.Signals(signum).name
    assert len(lines) == 1 and lines[0].startswith(f"error: pack stopped by {name}: ")
    assert lines[0].endswith("fix: run it again")
    assert list((tmp_path / "data").iterdir()) == []  # no temp dir left, nothing half-written
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("smollm-pipeline").experiment_id])
    assert run.info.status == "KILLED"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # restored


def test_a_pipelines_parent_run_carries_its_evaluate_headline() -> None:
    """The run list shows each `dvc exp run` as a collapsed parent: without evaluate's numbers on it,
    two experiments could not be compared without expanding each (the parent had params, no metrics)."""
    logged: list[dict[str, float]] = []

    class Parent:
        def log_metrics(self, metrics: dict[str, float], step: int = 0) -> None:
            logged.append(metrics)

    headline = {"val_loss": 2.5, "val_bpb": 0.9, "kept_step": 40.0, "gap_to_donor": -0.4}
    summarize_parent(Parent(), "train", {"final_val_loss": 2.5})  # type: ignore[arg-type]
    summarize_parent(Parent(), "evaluate", headline)  # type: ignore[arg-type]
    summarize_parent(None, "evaluate", headline)
    assert logged == [{"summary/val_loss": 2.5, "summary/val_bpb": 0.9, "summary/gap_to_donor": -0.4}]


def test_a_checkpoint_of_a_finished_run_starts_a_run_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sweep job (or a DVC experiment) whose config matches a finished training resumes its final
    checkpoint; it used to reopen that finished run, so the other experiment's run was logged into
    and this one's parent had no train run. A killed run is still reopened (resume after a crash)."""

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'store.db'}")
    monkeypatch.delenv("DVC_STAGE", raising=False)
    cfg = PipelineConfig()
    cfg.tracking.experiment = "reopen"
    tracker = Tracker(default_tracking_uri(tmp_path), "reopen", tmp_path / "artifacts")
    finished, killed = tracker.start("done/train", {}), tracker.start("killed/train", {})
    finished.end("FINISHED")
    killed.end("KILLED")
    run, _ = open_run("train", cfg, {}, tmp_path, "hash", resume_id=finished.run_id)
    assert run is not None and run.run_id != finished.run_id
    run.end()
    again, _ = open_run("train", cfg, {}, tmp_path, "hash", resume_id=killed.run_id)
    assert again is not None and again.run_id == killed.run_id
    again.end()
