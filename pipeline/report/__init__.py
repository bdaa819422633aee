"""The report stage's library: the pipeline's outputs and its MLflow runs into `reports/report.md`
(text, diffable in git) and a self-contained `reports/report.html` (charts embedded)."""

from __future__ import annotations

from pathlib import Path

from pipeline.io.files import write_text
from pipeline.report.build import ReportInputs, build_report
from pipeline.report.content import Report
from pipeline.report.outputs import Outputs, check_ready, read_outputs
from pipeline.report.render import markdown, page

MARKDOWN = "report.md"
HTML = "report.html"

__all__ = ["HTML", "MARKDOWN", "Outputs", "Report", "ReportInputs", "build_report", "check_ready", "read_outputs"]


def write_report(report: Report, out_dir: Path) -> tuple[Path, Path]:
    """Both files, each replaced whole (temp + rename) once both are rendered: a failed render leaves
    the previous report as it was, and the folder's other files (the tracked `.gitignore`) stay."""
    text, html = markdown(report), page(report)
    return write_text(Path(out_dir) / MARKDOWN, text), write_text(Path(out_dir) / HTML, html)
