"""One source per number, down to the data: each benchmark names its figures with its own `figures()`
function from the rows it measured, and the results files it wrote hold exactly those figures. So a
figure in a results file (and so in the docs, which tests/test_docs.py holds to the file) is the
script's reading of the file's own data, not a number typed beside it. (Files a script did not write
carry figures of their own: tests/test_docs.py checks those against the docs.)"""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Iterator
from types import ModuleType

import pytest

from tests.conftest import ROOT

RESULTS = ROOT / "benchmarks" / "results"


@pytest.fixture(scope="module")
def bench() -> Iterator[ModuleType]:
    """The benchmarks folder on sys.path, as when its scripts run (they import `harness` and each other)."""
    folder = str(ROOT / "benchmarks")
    sys.path.insert(0, folder)
    try:
        yield importlib.import_module
    finally:
        sys.path.remove(folder)


def data(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


CASES = {
    "quant_quality.json": ("quant_quality", lambda m, d: m.figures(d)),
    "auto_types.json": ("auto_types_vs_fixed", lambda m, d: m.figures(d["f32_val_loss"], d["rows"])),
    "qat_imatrix.json": ("qat_imatrix", lambda m, d: m.figures(d["f32_val_loss"], d["rows"])),
    "qat_imatrix_lora.json": ("qat_imatrix", lambda m, d: m.figures(d["f32_val_loss"], d["rows"])),
    "qat_imatrix_full_finetune.json": ("qat_imatrix", lambda m, d: m.figures(d["f32_val_loss"], d["rows"])),
    "donor_transfer.json": ("donor_transfer", lambda m, d: m.figures(d["results"])),
    "donor_gap.json": ("donor_gap", lambda m, d: m.figures(d["results"])),
    **{
        f"donor_gap_2026-12-02_{run}.json": ("donor_gap", lambda m, d: m.figures(d["results"]))
        for run in ("manuals", "manuals_circuit", "pydoc", "fortunes_floor03", "retime")
    },
    **{
        f"donor_gap_2026-12-07_{run}.json": ("donor_gap", lambda m, d: m.figures(d["results"]))
        for run in (
            "pkgreadmes_circuit_avx2",
            "pkgreadmes_bf16",
            "pkgreadmes_headfit16k_bf16",
            "pkgreadmes_circuit_headfit16k_bf16",
            "pkgreadmes_steps1440_bf16",
            "pydoc_bf16",
        )
    },
    **{
        f"donor_gap_2026-12-08_deep_{run}.json": ("donor_gap", lambda m, d: m.figures(d["results"]))
        for run in ("pydoc", "manpages", "foldoc", "djangodoc")
    },
    "lmeval_speed.json": (
        "lmeval_speed",
        lambda m, d: m.figures(d, {"easy_mc": 0, "arith_mc": 0}, {"smollm-gguf": 0, "hf (transformers)": 0}),
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_results_files_figures_are_its_scripts_reading_of_its_data(bench, name: str) -> None:
    module, compute = CASES[name]
    record = data(name)
    computed = compute(bench(module), record.get("data", record))  # harness files keep the rows under "data"
    wrong = {k: (v, record["figures"].get(k)) for k, v in computed.items() if record["figures"].get(k) != v}
    assert computed and not wrong, f"{name}: figure, computed from the data, in the file: {wrong}"


def test_a_cold_benchmark_refuses_a_workspace_holding_checkpoints_before_it_runs(bench, tmp_path, monkeypatch) -> None:
    harness = bench("harness")
    monkeypatch.setattr(harness, "ROOT", tmp_path)
    harness.refuse_warm_checkpoints()  # no checkpoints/ at all: nothing to resume
    (tmp_path / "checkpoints" / "2f2ca88de0476c24").mkdir(parents=True)
    with pytest.raises(SystemExit, match=r"checkpoints: expected no runs for a cold one, found 1 .*remove it"):
        harness.refuse_warm_checkpoints()
