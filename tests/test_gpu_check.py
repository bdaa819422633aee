"""`benchmarks/gpu_check.sh` (issue 39's one-call GPU check) with DRY_RUN=1: the same commands on the CPU at
the toy `smoke` shape, so a broken argument, import or code path shows here, not in a GPU call's minutes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_gpu_check_runs_its_commands_on_a_cpu(tmp_path: Path) -> None:
    env = {**os.environ, "DRY_RUN": "1", "PYTHON": sys.executable, "OUT": str(tmp_path)}
    done = subprocess.run(
        ["bash", "benchmarks/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    summary = done.stdout.split("=== summary (cpu)", 1)[1]
    assert summary.count("ours-default     skipped: a CUDA-only path") == 3  # one process per shape
    assert summary.count("ratio ours/hf:") == 3 and "ratio ours/hf-static" in summary
    assert "tests collected" in summary and "error" not in summary.lower() and "failed" not in summary
    assert "random 135M-shaped GGUF" in summary and "step: " in summary  # LoRA without the donor; the profile
    want = {"train_135m.txt", "train_tiny.txt", "train_tiny_default.txt", "decode.txt", "lora.txt", "profile.txt"}
    assert {p.name for p in tmp_path.iterdir()} >= want
