"""The report's sections, from the pipeline's outputs, the MLflow runs and the environment."""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.evaluate.metric_names import QUANT_PREFIX, quant_types_of
from pipeline.report.content import Block, Figure, Report, Section, Table, fmt, key_value_table
from pipeline.report.figures import (
    OTHER_RECIPE,
    SAME_RECIPE,
    THIS_RUN,
    comparison_chart,
    epochs_chart,
    loss_chart,
    series_chart,
    variance_chart,
)
from pipeline.report.outputs import STAGES, Outputs
from pipeline.report.runs import COMPARED_METRICS, Compared, producing_run, seconds, started
from pipeline.tracking import RunRecord

VAL_SPLIT = {True: "same", False: "other", None: "?"}  # a compared run's val split against this run's

HEADLINE = (
    "val_accuracy",
    "val_loss",
    "val_ppl",
    "val_bpb",
    "donor_val_loss",
    "donor_val_bpb",
    "gap_to_donor",
    "base_val_loss",
)


@dataclass
class ReportInputs:
    """Everything the report shows, gathered by the stage."""

    outputs: Outputs
    recipe: str
    environment: dict[str, str]
    compared: list[Compared] = field(default_factory=list)
    stage_runs: dict[str, list[RunRecord]] = field(default_factory=dict)  # newest first, per stage
    tracking: bool = True


def build_report(inp: ReportInputs) -> Report:
    sections = [summary(inp), training(inp.outputs), donor(inp.outputs), quantized(inp.outputs)]
    sections += [draft(inp.outputs), comparison(inp), stages(inp)]
    sections += [samples(inp.outputs), Section("Environment", tables=[key_value_table(inp.environment)])]
    return Report(f"Pipeline report: recipe {inp.recipe}", [s for s in sections if s is not None])


def summary(inp: ReportInputs) -> Section:
    """The numbers a reader compares first: the exported model's val loss, perplexity and bits per byte."""
    m = inp.outputs.metrics
    ev = m.get("evaluate", {})
    headline = {k: ev[k] for k in HEADLINE if k in ev}
    text = []
    if "val_bpb" in ev:
        text.append(
            "Bits per byte (`val_bpb`) is the val loss per UTF-8 byte of the val text: unlike loss and "
            "perplexity it compares models with different tokenizers."
        )
    train, realize = m.get("train", {}), m.get("realize", {})
    facts: dict[str, object] = {"recipe": inp.recipe}
    named = (("parameters", realize, "parameters"), ("train steps", train, "steps"), ("kept step", train, "kept_step"))
    named += (("train seconds", train, "seconds"), ("tokens seen", train, "tokens_seen"))
    facts.update({label: src[key] for label, src, key in named if key in src})
    return Section("Summary", text, [key_value_table(headline, ("metric", "value")), key_value_table(facts)])


def training(out: Outputs) -> Section | None:
    """Loss curves, learning rate and gradient norm per step; perplexity per epoch for fine-tunes."""
    train, val, optim = out.plot("train/train_loss"), out.plot("train/val_loss"), out.plot("train/optim")
    if not (train or val):
        return None
    figs: list[Figure] = [loss_chart(train, val)]
    if any("lr" in r for r in optim):
        figs.append(series_chart(optim, "lr", "learning rate", "lr"))
    if any("grad_norm" in r for r in optim):
        figs.append(series_chart(optim, "grad_norm", "gradient norm (before clipping)", "grad norm", log=True))
    epochs = out.plot("train/epochs")
    tables = []
    if epochs:
        figs.append(epochs_chart(epochs))
        rows = [
            [str(i), fmt(r.get("step")), fmt(r.get("epoch_train_ppl")), fmt(r.get("epoch_val_ppl"))]
            for i, r in enumerate(epochs, 1)
        ]
        tables.append(Table(["epoch", "step", "train ppl", "val ppl"], rows))
    if val:
        cols = [c for c in ("val_loss", "val_ppl", "val_bpb", "val_accuracy") if any(c in r for r in val)]
        tables.append(Table(["step", *cols], [[fmt(r.get("step")), *(fmt(r.get(c)) for c in cols)] for r in val]))
    return Section("Training", [], tables, figs)


def donor(out: Outputs) -> Section | None:
    """What the donor stage measured. The PCA recipes keep every row of the plot (the embedding table's
    components); subclone plots its residual stream's basis over the donor's whole width and keeps
    `model.d_model` directions, so the kept count and share come from metrics/donor.json, not the plot."""
    rows = out.plot("donor/explained_variance")
    if not rows:
        return None
    metrics = out.metrics.get("donor", {})
    what = "residual stream" if "calibration_tokens" in metrics else "embedding table"
    kept = int(metrics.get("components", len(rows)))
    total = metrics.get("explained_variance_total", rows[-1].get("cumulative"))
    width = f" (of {len(rows)}, the donor's width)" if kept != len(rows) else ""
    text = [f"The {kept} kept principal directions of the donor's {what}{width} hold {total:.1%} of its variance."]
    return Section("Donor", text, figures=[variance_chart(rows, what, kept)])


def quantized(out: Outputs) -> Section | None:
    """The export at each of evaluate.quant_types: size on disk against loss, by us and by llama.cpp."""
    ev = out.metrics.get("evaluate", {})
    types = quant_types_of(ev)
    if not types:
        return None
    size = out.metrics.get("export", {}).get("file_bytes")
    rows = [["export", fmt(size / 1e6 if size else None), fmt(ev.get("val_loss")), "0", "0", "", ""]]
    for t in types:
        k = f"{QUANT_PREFIX}{t}_"
        figures = ("mb", "val_loss", "val_loss_rise", "kl", "ours_window_loss", "llamacpp_window_loss")
        rows.append([t, *(fmt(ev.get(k + f)) for f in figures)])
    text = [
        "The export quantized to each of `evaluate.quant_types` and scored on the same val windows: the loss "
        "rise over the export and the mean KL(export || quantized) per token; the last two columns score the "
        "same file over the llama.cpp parity windows by our reader and by llama.cpp."
    ]
    head = ["type", "MB", "val loss", "rise", "KL", "ours (windows)", "llama.cpp (windows)"]
    return Section("Quantized", text, [Table(head, rows)])


def draft(out: Outputs) -> Section | None:
    """The student as its donor's draft model (speculative decoding), from evaluate's agreement with
    the donor's greedy choices over the val windows."""
    ev = out.metrics.get("evaluate", {})
    ks = [k for k in range(1, 9) if f"draft_accepted_k{k}" in ev]
    if "draft_top1_agreement" not in ev or not ks:
        return None
    text = [
        f"Over the val windows this model's greedy choice equals the donor's at {ev['draft_top1_agreement']:.1%} "
        "of positions. With draft length k, each donor forward would keep the accepted drafts plus its own "
        "token (the upper bound of the speedup, before the draft's own cost):"
    ]
    rows = [[str(k), fmt(ev[f"draft_accepted_k{k}"]), fmt(ev[f"draft_accepted_k{k}"] + 1)] for k in ks]
    return Section("As a draft model", text, [Table(["k", "accepted drafts", "tokens per donor forward"], rows)])


def comparison(inp: ReportInputs) -> Section:
    """This run beside the newest evaluate runs in the MLflow experiment (other DVC experiments included)."""
    if not inp.tracking:
        return Section("Comparison", ["Tracking is off (tracking.enabled=false): no MLflow runs to compare with."])
    if not inp.compared:
        return Section("Comparison", ["No finished evaluate runs in the MLflow experiment yet."])
    cols = [c for c in COMPARED_METRICS if any(c in r.metrics for r in inp.compared)]
    rows = [
        [
            r.name + (" (this run)" if r.this else ""),
            r.recipe,
            r.commit,
            r.started,
            *(fmt(r.metrics.get(c)) for c in cols),
            VAL_SPLIT[r.same_val],
            r.differs,
        ]
        for r in inp.compared
    ]
    this = [i for i, r in enumerate(inp.compared) if r.this]
    table = Table(["run", "recipe", "commit", "started", *cols, "val split", "differs from this run in"], rows, this)
    text = [f"The newest {len(inp.compared)} finished evaluate runs of the MLflow experiment, newest first."]
    if not any(r.this for r in inp.compared):
        text.append("This run's evaluate is not in the store (tracking was off for it, or another store).")
    charted = [r for r in inp.compared if r.same_val is not False]  # losses on other windows do not compare
    if len(charted) < len(inp.compared):
        text.append(
            f"{len(inp.compared) - len(charted)} of them were measured on another val split (other data, tokenizer "
            "or split settings): listed, not charted, as their losses are not comparable with this run's."
        )
    unit = "val_bpb" if all("val_bpb" in r.metrics for r in charted) else "val_loss"
    shown = [r for r in charted if unit in r.metrics]
    colors = [THIS_RUN if r.this else SAME_RECIPE if r.recipe == inp.recipe else OTHER_RECIPE for r in shown]
    fig = comparison_chart([r.name for r in shown], [r.metrics[unit] for r in shown], colors, unit)
    return Section("Comparison", text, [table], [fig] if shown else [])


def stages(inp: ReportInputs) -> Section:
    """Every stage's metrics, and how long its run took (from the MLflow run that logged them)."""
    m = inp.outputs.metrics
    timing_rows, tables = [], []
    for stage in (s for s in STAGES if s in m):
        run = producing_run(m[stage], inp.stage_runs.get(stage, []))
        took = None if run is None else seconds(run)
        timing_rows.append(
            [stage, fmt(took) if took is not None else "", run.name if run else "", started(run) if run else ""]
        )
    tables.append(Table(["stage", "seconds", "MLflow run", "started"], timing_rows))
    for stage in (s for s in STAGES if s in m):
        tables.append(key_value_table(m[stage], (f"{stage}", "value")))
    text = ["Seconds are the wall time of the MLflow run that logged the stage's current metrics (blank: none found)."]
    return Section("Stages", text, tables)


def samples(out: Outputs) -> Section | None:
    if not out.samples:
        return None
    blocks = []
    for s in out.samples:
        for key, value in s.items():
            if key != "prompt":
                blocks.append(Block(f"{s.get('prompt', '')!r} ({key})", str(value)))
    return Section(
        "Samples", ["The evaluate stage's samples of the exported GGUF (models/evaluate/samples.json)."], blocks=blocks
    )
