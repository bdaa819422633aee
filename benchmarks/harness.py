"""What every benchmark shares: this checkout's library ahead of any installed copy, child processes
that report one JSON line, peak RSS, the project's DVC experiment runs and their metrics, and the
results file that records what was measured with the conditions it was measured under.

A benchmark runs as a script (`python benchmarks/<name>.py`), so this folder is on `sys.path` and
`import harness` (before any `pipeline` import) puts the project root first: the figures are this
checkout's, not those of whichever copy pip installed in editable mode.

A results file (`benchmarks/results/<name>.json`, written by `write_results`) holds:

- `conditions`: the command, the commit (with `+dirty` when the tree had changes), the date, the
  machine (CPU model, cores, GPU), the load (1-minute load average before and after), the CPU
  allocator (glibc malloc, or tcmalloc/jemalloc preloaded) and the torch version;
- `figures`: the named figures the docs quote, each as the text they quote
  (`[1.33x](../benchmarks/results/<name>.json#<figure>)`; `tests/test_docs.py` compares them);
- the benchmark's own rows, as it measured them.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import resource
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
if str(ROOT) not in sys.path[:1]:
    sys.path.insert(0, str(ROOT))  # this checkout's library, not pip's editable one


def peak_rss_mib(children: bool = False) -> float:
    """This process's peak resident set (or its children's largest), in MiB (ru_maxrss is KiB on Linux)."""
    who = resource.RUSAGE_CHILDREN if children else resource.RUSAGE_SELF
    return resource.getrusage(who).ru_maxrss / 1024


def rss_mib() -> float:
    """The resident set now (VmRSS), in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def child_json(cmd: list[str], env: dict[str, str] | None = None, fatal: bool = True) -> dict[str, Any]:
    """Run a child process that prints its figures as one JSON line last; that line as a dict. A failed
    child ends this process naming the command and its stderr's tail, or (`fatal=False`) comes back as
    `{"error": <its last stderr line>}` for the table to show."""
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or [f"exit status {out.returncode}"])[-1]
        if fatal:
            sys.exit(f"{shlex.join(cmd)} failed: {last}")
        return {"error": last}
    return json.loads(out.stdout.strip().splitlines()[-1])


def exp_run(args: list[str], overrides: list[str]) -> float:
    """`dvc exp run <args> -S o ...` in the project with this venv first on PATH; its wall seconds
    (the process exits naming the command and its output's tail if it fails)."""
    args = ["dvc", "exp", "run", *args]
    for override in overrides:
        args += ["-S", override]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    start = time.perf_counter()
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(args)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return time.perf_counter() - start


# What a stage prints when it does not run cold, and how to make the next run cold.
NOT_COLD = (
    ("is cached - skipping run", "remove .dvc/cache/runs (DVC's run cache) in this workspace, or use a fresh clone"),
    ("train: already at step", "remove train.checkpoint_dir (checkpoints/) in this workspace, or use a fresh clone"),
    ("train: resuming at step", "remove train.checkpoint_dir (checkpoints/) in this workspace, or use a fresh clone"),
)


def refuse_warm_checkpoints() -> None:
    """Fail before the first cold run, not minutes into it at the train stage, where this workspace's
    `checkpoints/` (train.checkpoint_dir) already holds a run that train would resume."""
    held = sorted(p.name for p in (ROOT / "checkpoints").glob("*") if p.is_dir())
    if held:
        sys.exit(
            f"{ROOT / 'checkpoints'}: expected no runs for a cold one, found {len(held)} ({held[0]}...): "
            "remove it (train.checkpoint_dir) in this workspace, or use a fresh clone"
        )


def timed_exp_run(args: list[str], overrides: list[str]) -> tuple[float, dict[str, float]]:
    """`exp_run`, its output read as it comes: the wall seconds and each stage's, from the moment DVC
    says "Running stage" to the next (a stage it skips takes no time)."""
    args = ["dvc", "exp", "run", *args]
    for override in overrides:
        args += ["-S", override]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    start = last = time.perf_counter()
    stages: dict[str, float] = {}
    current, tail = None, []
    with subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as p:
        for line in p.stdout:
            tail = (tail + [line])[-40:]
            not_cold = [fix for marker, fix in NOT_COLD if marker in line]
            if not_cold:
                p.kill()
                sys.exit(
                    f"{' '.join(args)}: {line.strip()}; a cold run needs every stage to run from scratch: {not_cold[0]}"
                )
            if line.startswith(("Running stage '", "Stage '")) or line.startswith("Ran experiment"):
                now = time.perf_counter()
                if current:
                    stages[current] = now - last
                current = line.split("'")[1] if line.startswith("Running stage '") else None
                last = now
    if p.returncode != 0:
        sys.exit(f"{' '.join(args)} failed:\n{''.join(tail)}")
    end = time.perf_counter()
    if current:
        stages[current] = end - last
    return end - start, stages


def read_metrics(stage: str) -> dict[str, float]:
    """`metrics/<stage>.json` of the workspace as the last run left it ({} where the stage wrote none)."""
    file = ROOT / "metrics" / f"{stage}.json"
    return json.loads(file.read_text()) if file.is_file() else {}


def cpu_model() -> str:
    """The CPU's model name, with AMX or AVX512-BF16 named where the CPU has them (bf16 speed hangs on it)."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    name = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), "")
    flags = next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), [])
    extras = [label for flag, label in (("amx_bf16", "AMX"), ("avx512_bf16", "AVX512-BF16")) if flag in flags]
    return f"{name or platform.processor() or 'unknown CPU'}" + (f" ({', '.join(extras)})" if extras else "")


def gpu_name() -> str:
    """The first CUDA device's name, or "none" (no torch import unless CUDA can be there)."""
    if not Path("/proc/driver/nvidia").exists():
        return "none"
    import torch  # noqa: PLC0415 (only on a machine with the NVIDIA driver)

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"


def allocator(env: dict[str, str] | None = None) -> str:
    """The CPU allocator a process with `env` (default: this one's) runs under."""
    preload = (os.environ if env is None else env).get("LD_PRELOAD", "")
    for name in ("tcmalloc", "jemalloc"):
        if name in preload:
            return f"{name} (LD_PRELOAD)"
    return "glibc malloc"


def commit(tree: Path = ROOT) -> str:
    """HEAD's short hash, `+dirty` when tracked files differ from it (the figures are then of the work tree)."""
    head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=tree, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "-uno"], cwd=tree, capture_output=True, text=True)
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def conditions(load_before: float, child_env: dict[str, str] | None = None) -> dict[str, Any]:
    """What a results file records beside its figures; `load_before`: `os.getloadavg()[0]` at the start."""
    import torch  # noqa: PLC0415 (every benchmark has it loaded by now)

    return {
        "command": shlex.join(["python", *sys.argv]),
        "commit": commit(),
        "date": dt.date.today().isoformat(),
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "gpu": gpu_name()},
        "load": {"before": round(load_before, 2), "after": round(os.getloadavg()[0], 2)},
        "allocator": allocator(child_env),
        "torch": torch.__version__,
    }


def write_results(
    path: str | os.PathLike[str], figures: dict[str, str], data: Any, load_before: float, **extra: Any
) -> Path:
    """The results file at `path`: conditions, the named figures the docs quote, and the rows."""
    record = {"conditions": conditions(load_before, extra.pop("child_env", None)), "figures": figures, **extra}
    record["data"] = data
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {path}")
    return path
