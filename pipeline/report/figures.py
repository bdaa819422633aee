"""The report's charts, drawn with matplotlib's object API (no pyplot: no global state, no display)
and returned as PNG bytes that the HTML page embeds."""

from __future__ import annotations

import io
from collections.abc import Sequence

from matplotlib.figure import Figure as MplFigure
from matplotlib.ticker import LogFormatter, MaxNLocator

from pipeline.report.content import Figure

Rows = Sequence[dict[str, float]]
DPI = 100
THIS_RUN = "#d62728"
SAME_RECIPE = "#1f77b4"
OTHER_RECIPE = "#aec7e8"
COUNTED = ("step", "component", "epoch")  # x axes of whole numbers: ticks only at integers


class PlainLogFormatter(LogFormatter):
    """Log-axis labels as plain numbers ("0.3", "6", "40"), not "3e-01" or "4 x 10^1"; matplotlib
    still picks which ticks get a label."""

    def __call__(self, x: float, pos: int | None = None) -> str:
        return f"{x:g}" if super().__call__(x, pos) else ""


def to_png(fig: MplFigure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, metadata={"Software": None})  # no version stamp: stable bytes
    return buf.getvalue()


def _axes(title: str, xlabel: str, ylabel: str, size: tuple[float, float] = (7, 3.6)):
    fig = MplFigure(figsize=size, dpi=DPI)
    ax = fig.add_subplot()
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    if xlabel in COUNTED:  # a short run's axis would otherwise read "step 2.5"
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    return fig, ax


def _xy(rows: Rows, x: str, y: str) -> tuple[list[float], list[float]]:
    pts = [(r[x], r[y]) for r in rows if x in r and y in r]
    return [p[0] for p in pts], [p[1] for p in pts]


def loss_chart(train: Rows, val: Rows) -> Figure:
    """Train loss per logged step and val loss per evaluation: the over-fitting check at a glance."""
    fig, ax = _axes("train and val loss", "step", "loss (nats/token)")
    ax.plot(*_xy(train, "step", "train_loss"), label="train", linewidth=1)
    ax.plot(*_xy(val, "step", "val_loss"), "o-", label="val")
    ax.legend()
    fig.tight_layout()
    return Figure("loss", "Train and val loss", to_png(fig))


def series_chart(rows: Rows, column: str, title: str, ylabel: str, log: bool = False) -> Figure:
    """One per-step column (lr, grad norm) as a line."""
    fig, ax = _axes(title, "step", ylabel)
    xs, ys = _xy(rows, "step", column)
    ax.plot(xs, ys, linewidth=1)
    if log and ys and min(ys) > 0:
        ax.set_yscale("log")
        for axis_format in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
            axis_format(PlainLogFormatter(labelOnlyBase=False))
    fig.tight_layout()
    return Figure(column, title[:1].upper() + title[1:], to_png(fig))


def variance_chart(rows: Rows, what: str = "embedding table", kept: int = 0) -> Figure:
    """The donor's PCA (`what`: its embedding table, or subclone's residual stream): how much the
    components hold, with a line at the `kept` ones where fewer are kept than plotted."""
    fig, ax = _axes(f"donor {what} PCA", "component", "explained variance")
    xs, ratio = _xy(rows, "component", "explained_variance_ratio")
    _, cumulative = _xy(rows, "component", "cumulative")
    ax.plot(xs, cumulative, label="cumulative", linewidth=1.5)
    ax.plot(xs, ratio, label="per component", linewidth=1)
    if 0 < kept < len(xs):
        ax.axvline(kept, color="grey", linestyle="--", linewidth=1, label=f"kept: {kept}")
    ax.set_ylim(0, 1.02)
    ax.legend()
    fig.tight_layout()
    return Figure("explained_variance", "Donor PCA: explained variance", to_png(fig))


def epochs_chart(rows: Rows) -> Figure:
    """Fine-tunes: perplexity per epoch (the epoch's mean train loss, the val loss at its end)."""
    fig, ax = _axes("perplexity per epoch", "epoch", "perplexity")
    numbers = list(range(1, len(rows) + 1))
    ax.plot(numbers, [r.get("epoch_train_ppl", float("nan")) for r in rows], "o-", label="train")
    ax.plot(numbers, [r.get("epoch_val_ppl", float("nan")) for r in rows], "o-", label="val")
    ax.set_xticks(numbers)
    ax.legend()
    fig.tight_layout()
    return Figure("epochs", "Perplexity per epoch", to_png(fig))


def comparison_chart(labels: list[str], values: list[float], colors: list[str], unit: str) -> Figure:
    """One bar per compared run, this run in red, runs of the same recipe in blue, others pale."""
    height = max(2.2, 0.38 * len(labels) + 1.2)
    fig, ax = _axes(f"evaluate runs: {unit} (lower is better)", unit, "", size=(7, height))
    ax.barh(range(len(labels)), values, color=colors)
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.invert_yaxis()
    for i, v in enumerate(values):
        ax.text(v, i, f" {v:.4f}", va="center", fontsize=8)
    ax.set_xlim(0, max(values) * 1.18 if values else 1)
    fig.tight_layout()
    return Figure("comparison", "This run beside the newest evaluate runs", to_png(fig))
