"""The house: dvc.yaml's per-stage code deps follow the imports, so editing a module re-runs every
stage that uses it (and only those). On failure the message gives the list to paste."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import yaml

from tests.conftest import ROOT

PACKAGES = ("pipeline", "stages")


def _module_file(name: str) -> Path | None:
    base = ROOT.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imports(path: Path) -> set[str]:
    """Our modules `path` imports anywhere in it, parents packages included (Python runs their __init__)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    out = set()
    for name in names:
        parts = name.split(".")
        if parts[0] in PACKAGES:
            out.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return out


def closure(module: str) -> set[Path]:
    """Every file of ours that importing `module` executes."""
    seen: set[Path] = set()
    todo = [module, *(".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1))]
    while todo:
        path = _module_file(todo.pop())
        if path is None or path in seen:
            continue
        seen.add(path)
        todo.extend(_imports(path))
    return seen


def expected_deps(files: set[Path]) -> list[str]:
    """The files as dvc.yaml lists them: a package folder whose every module is used stands for them."""
    out: list[str] = []
    folders = sorted({f.parent for f in files if f.parent != ROOT / "pipeline" and f.parent != ROOT / "stages"})
    whole = {d for d in folders if set(d.glob("*.py")) <= files}
    for f in sorted(files):
        if f.parent in whole:
            continue
        out.append(str(f.relative_to(ROOT)))
    return sorted(out + [str(d.relative_to(ROOT)) for d in whole])


def test_stage_deps_are_exactly_the_code_each_stage_runs() -> None:
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    wrong = {}
    for name, stage in stages.items():
        module = stage["cmd"].split("-m ", 1)[1].split()[0]
        want = expected_deps(closure(module))
        listed = sorted(d for d in stage["deps"] if d.split("/")[0] in PACKAGES)
        if listed != want:
            wrong[name] = want
    assert not wrong, "dvc.yaml code deps are stale; use:\n" + yaml.safe_dump(wrong)


def test_the_library_imports_no_orchestration_packages() -> None:
    """pipeline/ never imports hydra, omegaconf or dvc; only pipeline.tracking imports mlflow; and it
    imports without the optional lm-eval (pipeline.evaluate.lmeval imports it only when its model is asked for)."""
    modules = sorted(
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for p in (ROOT / "pipeline").rglob("*.py")
    )
    library = [m for m in modules if m != "pipeline.tracking"]
    code = (
        "import sys, importlib\nsys.modules['lm_eval'] = None  # as if the [eval] extra were not installed\n"
        f"for m in {library!r}: importlib.import_module(m)\n"
        "bad = [m for m in ('hydra', 'omegaconf', 'dvc', 'mlflow') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_each_stage_declares_to_dvc_exactly_the_keys_it_reads() -> None:
    """A single-stage run refuses overrides outside STAGE_PARAMS; DVC re-runs a stage on its params."""
    from stages._run.overrides import STAGE_PARAMS

    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    assert {name: tuple(stage["params"]) for name, stage in stages.items()} == STAGE_PARAMS


def test_dvc_lock_is_the_committed_state_of_the_code() -> None:
    """The policy: dvc.lock is committed fresh (run `dvc repro` before committing code changes), so a
    fresh clone's `dvc status` finds no stage whose code, command or params changed since."""
    dvc = Path(sys.executable).parent / "dvc"
    out = subprocess.run([str(dvc), "status", "--json"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    stale = {}
    for stage, changes in json.loads(out.stdout or "{}").items():
        for change in changes:
            if isinstance(change, str):  # "changed command"; "always changed" is the inputs stage's design
                bad = None if change == "always changed" else change
            else:
                deps = change.get("changed deps", {})
                bad = {p: v for p, v in deps.items() if p.split("/")[0] in PACKAGES or p == "params.yaml"}
            if bad:
                stale.setdefault(stage, []).append(bad)
    stale.pop("inputs", None)  # always_changed: DVC reports it every time by design
    assert not stale, f"dvc.lock is stale (run `dvc repro` and commit dvc.lock): {stale}"


def test_dvc_plots_render_offline(tmp_path: Path) -> None:
    """`dvc plots show` uses .dvc/plots/offline.html: the charting libraries are inlined, no CDN."""
    dvc = Path(sys.executable).parent / "dvc"
    out = subprocess.run(
        [str(dvc), "plots", "show", "-o", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    page = (tmp_path / "index.html").read_text()
    assert "<script src=" not in page and "cdn.jsdelivr" not in page
    assert "vegaEmbed('#" in page and "window.__dvcPlots" in page and len(page) > 500_000
