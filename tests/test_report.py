"""The report stage: every section and number of a run's outputs in reports/report.md, the charts
embedded in a self-contained reports/report.html, this run beside the other evaluate runs of a
real MLflow store (with the stage timings of the runs that logged the current metrics), the report
logged to the stage's run and its pipeline's parent, and a report asked for before the pipeline
ran refused in one line."""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

import pipeline.report.build
import pipeline.report.figures
from pipeline.report import ReportInputs, build_report, read_outputs, write_report
from pipeline.report.environment import environment
from pipeline.report.outputs import Outputs
from pipeline.report.render import markdown, page
from pipeline.report.runs import compare
from pipeline.tracking import VAL_DATA_TAG, RunRecord, Tracker, stage_runs
from tests.conftest import ROOT

EVALUATE = {"val_loss": 2.794254, "val_ppl": 16.3504, "val_bpb": 0.940714, "donor_val_loss": 3.171893}
DRAFT = {"draft_top1_agreement": 0.5625, **{f"draft_accepted_k{k}": 0.5 + k / 10 for k in range(1, 9)}}
QUANT = {
    "quant_q4_0_val_loss": 2.9,
    "quant_q4_0_val_loss_rise": 0.105746,
    "quant_q4_0_kl": 0.0831,
    "quant_q4_0_mb": 28.5,
}
TRAIN = {"final_val_loss": 2.794254, "kept_val_loss": 2.794254, "kept_val_bpb": 0.940714, "steps": 4.0, "seconds": 9.5}
METRICS = {
    "pack": {"documents": 79.0, "tokens": 112956.0},
    "donor": {"components": 2.0, "explained_variance_total": 0.625},
    "realize": {"parameters": 28316544.0},
    "train": TRAIN,
    "export": {"file_bytes": 115039008.0, "tensors": 56.0},
    "evaluate": {**EVALUATE, **DRAFT, **QUANT},
}
PLOTS = {
    "train/train_loss": "step\ttrain_loss\n1\t7.5\n2\t6.1\n3\t5.2\n4\t4.4\n",
    "train/val_loss": "step\tval_loss\tval_ppl\tval_bpb\n2\t3.4\t29.96\t1.14\n4\t2.794254\t16.35\t0.940714\n",
    "train/optim": "step\tlr\tgrad_norm\ttokens_per_second\n1\t1e-3\t2.5\t900\n2\t0.002\t1.5\t950\n4\t5e-4\t0.9\t99\n",
    "train/epochs": "step\tepoch_train_ppl\tepoch_val_ppl\n2\t40.1\t35.2\n4\t20.5\t16.35\n",
    "donor/explained_variance": "component\texplained_variance_ratio\tcumulative\n1\t0.4\t0.4\n2\t0.225\t0.625\n",
}
SAMPLES = [{"prompt": "The for statement", "greedy": "is used <b>to</b> iterate", "sampled": "loops over items"}]


def write_outputs(root: Path) -> Path:
    """What a finished pipeline leaves: metrics, DVC plot tables and samples, in the stages' formats."""
    for stage, values in METRICS.items():
        (root / "metrics").mkdir(parents=True, exist_ok=True)
        (root / "metrics" / f"{stage}.json").write_text(json.dumps(values))
    for name, text in PLOTS.items():
        (root / "plots" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "plots" / f"{name}.tsv").write_text(text)
    (root / "models" / "evaluate").mkdir(parents=True)
    (root / "models" / "evaluate" / "samples.json").write_text(json.dumps(SAMPLES))
    return root


def images(html: str) -> list[bytes]:
    return [base64.b64decode(m) for m in re.findall(r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)"', html)]


def record(
    name: str, metrics: dict, params: dict, start_s: float, seconds: float, recipe: str, val: str | None = None
) -> RunRecord:
    tags = {"recipe": recipe, "git_commit": "0123456789abcdef", "stage": "evaluate"}
    if val is not None:
        tags[VAL_DATA_TAG] = val
    summary = {f"summary/{k}": v for k, v in metrics.items()}
    start, end = int(start_s * 1000), int((start_s + seconds) * 1000)
    return RunRecord(name, name, "FINISHED", start, end, tags, params, summary)


def test_report_has_every_section_number_and_chart_and_no_external_url(tmp_path: Path) -> None:
    outputs = read_outputs(write_outputs(tmp_path))
    params = {"optim.lr": "0.003", "model.d_model": "384", "output": "text"}
    runs = [
        record("exp-b/evaluate", {**EVALUATE, "val_bpb": 1.2}, {**params, "optim.lr": "0.01"}, 2e9, 5, "warm-start"),
        record("exp-a/evaluate", EVALUATE, params, 1e9, 5, "subclone"),
    ]
    compared = compare(EVALUATE, {}, runs, 10)
    report = build_report(ReportInputs(outputs, "subclone", environment("cpu", 1, "c0ffee"), compared))
    md, html = markdown(report), page(report)
    for section in ("Summary", "Training", "Donor", "Quantized", "As a draft model", "Comparison", "Stages"):
        assert f"## {section}\n" in md and f"<h2>{section}</h2>" in html
    assert "| val_bpb | 0.9407 |" in md and "| val_loss | 2.7943 |" in md and "| parameters | 28,316,544 |" in md
    assert "| **exp-a (this run)** | **subclone** |" in md  # this run stands out among the compared
    assert "| exp-b | warm-start | 0123456 |" in md and "optim.lr=0.01" in md and "output=" not in md
    assert "| 2 | 4 | 20.5000 | 16.3500 |" in md  # per-epoch perplexity: epoch, step, train, val
    assert "62.5% of its variance" in md and "| git commit | c0ffee |" in md and "| torch threads | 1 |" in md
    assert "| export | 115.0390 | 2.7943 | 0 | 0 |" in md and "| q4_0 | 28.5000 | 2.9000 | 0.1057 | 0.0831 |" in md
    assert "equals the donor's at 56.2% of positions" in md and "| 4 | 0.9000 | 1.9000 |" in md  # k, accepted, +1
    assert "is used <b>to</b> iterate" in md and "is used &lt;b&gt;to&lt;/b&gt; iterate" in html
    pngs = images(html)  # loss, lr, grad norm, epochs, explained variance, comparison
    assert len(pngs) == 6 and all(p.startswith(b"\x89PNG\r\n\x1a\n") and len(p) > 5000 for p in pngs)
    assert not re.search(r"(?:src|href)=\"(?!data:|#)", html) and "http://" not in html and "https://" not in html
    assert "<script" not in html and "data:image" not in md


def test_the_donor_section_says_how_many_residual_directions_subclone_kept() -> None:
    """subclone plots its residual stream's basis over the donor's whole width (cumulative 100%) and
    keeps model.d_model directions: the report said '576 kept principal components of the donor's
    embedding table hold 100.0%' where metrics/donor.json had 384 kept at 96.0%."""
    rows = [{"component": i, "explained_variance_ratio": 0.25, "cumulative": 0.25 * i} for i in range(1, 5)]
    calibrated = {"calibration_tokens": 16384.0, "components": 3.0, "explained_variance_total": 0.75}
    section = pipeline.report.build.donor(
        Outputs(metrics={"donor": calibrated}, plots={"donor/explained_variance": rows})
    )
    assert section is not None and len(section.figures) == 1
    kept = "The 3 kept principal directions of the donor's residual stream (of 4, the donor's width) hold 75.0%"
    assert section.text == [f"{kept} of its variance."]
    pca = pipeline.report.build.donor(
        Outputs(
            metrics={"donor": {"components": 4.0, "explained_variance_total": 1.0}},
            plots={"donor/explained_variance": rows},
        )
    )
    assert pca is not None and pca.text[0].startswith(
        "The 4 kept principal directions of the donor's embedding table hold"
    )


def test_a_short_runs_step_axis_has_whole_steps_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """20 steps logged every 10: matplotlib's own ticks were 2.5, 7.5, ... (no such step)."""
    drawn = []
    monkeypatch.setattr(pipeline.report.figures, "to_png", lambda fig: drawn.append(fig) or b"")
    train = [{"step": s, "train_loss": 9.0 - s / 10} for s in (1, 10, 20)]
    pipeline.report.figures.loss_chart(train, [{"step": 20, "val_loss": 6.8}])
    pipeline.report.figures.series_chart(train, "train_loss", "loss", "loss")
    for fig in drawn:
        fig.canvas.draw()
        ticks = [t for t in fig.axes[0].get_xticks() if 1 <= t <= 20]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks


def test_the_grad_norm_log_axis_reads_as_plain_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    """matplotlib's default log labels read "4 x 10^1", "6 x 10^0", "3e-01" on a grad-norm chart."""
    drawn = []
    monkeypatch.setattr(pipeline.report.figures, "to_png", lambda fig: drawn.append(fig) or b"")
    rows = [{"step": s, "grad_norm": g} for s, g in ((0, 38.0), (10, 6.1), (20, 0.4), (30, 0.25))]
    pipeline.report.figures.series_chart(rows, "grad_norm", "gradient norm", "grad norm", log=True)
    drawn[0].canvas.draw()
    axis = drawn[0].axes[0].yaxis
    labels = [t.get_text() for t in axis.get_majorticklabels() + axis.get_minorticklabels() if t.get_text()]
    assert {"1", "10"} <= set(labels) and any("." in label for label in labels), labels
    assert all(float(label) > 0 and "e" not in label and "times" not in label for label in labels), labels


def test_runs_measured_on_another_val_split_are_listed_but_not_charted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A LoRA run's response-only loss on instruction rows charted beside text runs' losses, lower read as
    better: only runs on this run's val split (tag val_data) are charted; untagged ones are "?"."""
    outputs = read_outputs(write_outputs(tmp_path))
    runs = [
        record("lora/evaluate", {**EVALUATE, "val_loss": 1.1}, {}, 4e9, 5, "lora", val="rows"),
        record("old/evaluate", {**EVALUATE, "val_loss": 2.9}, {}, 3e9, 5, "subclone"),
        record("exp-b/evaluate", {**EVALUATE, "val_loss": 2.8}, {}, 2e9, 5, "subclone", val="text"),
        record("exp-a/evaluate", EVALUATE, {}, 1e9, 5, "subclone", val="text"),
    ]
    compared = compare(EVALUATE, {}, runs, 10)
    assert [r.same_val for r in compared] == [False, None, True, True]
    charted = []
    chart = pipeline.report.build.comparison_chart
    monkeypatch.setattr("pipeline.report.build.comparison_chart", lambda *a: charted.append(a[:2]) or chart(*a))
    report = build_report(ReportInputs(outputs, "subclone", {}, compared))
    section = next(s for s in report.sections if s.title == "Comparison")
    assert [row[-2] for row in section.tables[0].rows] == ["other", "?", "same", "same"]
    assert any(t.startswith("1 of them were measured on another val split") for t in section.text)
    assert "| lora | lora |" in markdown(report) and len(section.figures) == 1
    assert charted == [(["old", "exp-b", "exp-a"], [EVALUATE["val_bpb"]] * 3)]  # bits per byte: all have it
    alone = compare(EVALUATE, {}, [runs[0], runs[3]], 10)  # nothing else on this split: this run's bar alone
    assert [r.same_val for r in alone] == [False, True]


def test_write_report_replaces_each_file_whole_and_keeps_the_folders_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tracked reports/.gitignore survives (the whole folder was replaced, deleting it); a failed
    render leaves the previous report as it was."""
    outputs = read_outputs(write_outputs(tmp_path))
    report = build_report(ReportInputs(outputs, "subclone", {"git commit": "x"}, tracking=False))
    (tmp_path / "reports").mkdir()
    (tmp_path / "reports" / ".gitignore").write_text("/report.html\n")
    md, html = write_report(report, tmp_path / "reports")
    assert sorted(p.name for p in (tmp_path / "reports").iterdir()) == [".gitignore", "report.html", "report.md"]
    assert (tmp_path / "reports" / ".gitignore").read_text() == "/report.html\n"
    assert "Tracking is off" in md.read_text() and len(images(html.read_text())) == 5
    before = md.read_text(), html.read_text()

    def broken(_: object) -> str:
        raise RuntimeError("render failed")

    monkeypatch.setattr("pipeline.report.page", broken)
    with pytest.raises(RuntimeError):
        write_report(report, tmp_path / "reports")
    assert (md.read_text(), html.read_text()) == before
    assert sorted(p.name for p in (tmp_path / "reports").iterdir()) == [".gitignore", "report.html", "report.md"]


def stage(cwd: Path, *overrides: str, store: Path | None = None) -> subprocess.CompletedProcess:
    """`python -m stages.report` in `cwd` (a project's root, as DVC runs it)."""
    env = {"PATH": str(Path(sys.executable).parent), "PYTHONPATH": str(ROOT), "HOME": str(cwd)}
    if store is not None:
        env["MLFLOW_TRACKING_URI"] = f"sqlite:///{store}"
    args = [sys.executable, "-m", "stages.report", "hydra.run.dir=logs", "hydra.output_subdir=null", *overrides]
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_a_report_before_the_pipeline_ran_is_one_named_line(tmp_path: Path) -> None:
    proc = stage(tmp_path, "tracking.enabled=false")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: metrics/evaluate.json: expected the evaluate stage's")
    assert lines[0].endswith("fix: run: dvc repro evaluate") and not (tmp_path / "reports").exists()


@pytest.mark.slow
def test_the_stage_compares_mlflow_runs_times_stages_and_logs_the_report(tmp_path: Path) -> None:
    """A real SQLite store: an older experiment's evaluate run and this pipeline's train and evaluate
    runs (logged as the stages log them, under a parent); the stage finds each and logs its report."""
    store = tmp_path / "mlflow.db"
    tracker = Tracker(f"sqlite:///{store}", "smollm-pipeline", tmp_path / "mlartifacts")
    for name, metrics, lr in (
        ("old-exp", {**EVALUATE, "val_bpb": 1.31}, "0.01"),
        ("new-exp", {**EVALUATE, **DRAFT, **QUANT}, "0.003"),
    ):
        parent = tracker.start(name, {"parent": "true"})
        for stage_name, values in (("train", TRAIN), ("evaluate", metrics)):
            run = tracker.start(f"{name}/{stage_name}", {"stage": stage_name, "recipe": "subclone"}, parent.run_id)
            run.log_params({"optim": {"lr": lr}, "recipe": {"name": "subclone"}})
            run.log_metrics({f"summary/{k}": v for k, v in values.items()})
            run.end()
        parent.end()
    write_outputs(tmp_path)
    proc = stage(tmp_path, "train.device=cpu", store=store)
    assert proc.returncode == 0, proc.stderr[-3000:]
    md = (tmp_path / "reports" / "report.md").read_text()
    assert "| **new-exp (this run)** |" in md and "| old-exp | subclone |" in md and "| optim.lr=0.01 |" in md
    assert re.search(r"\| train \| [0-9.]+ \| new-exp/train \|", md)  # the run that logged metrics/train.json
    assert json.loads((tmp_path / "metrics" / "report.json").read_text())["compared_runs"] == 2
    assert len(images((tmp_path / "reports" / "report.html").read_text())) == 6
    (report_run,) = stage_runs(f"sqlite:///{store}", "smollm-pipeline", "report")
    client = MlflowClient(tracking_uri=f"sqlite:///{store}")
    assert {a.path for a in client.list_artifacts(report_run.run_id, "report")} == {
        "report/report.html",
        "report/report.md",
    }
