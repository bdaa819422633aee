"""`benchmarks/gpu_check.sh` (issue 39's one-call GPU check). With DRY_RUN=1 it runs the same commands on the
CPU at the toy `smoke` shape, so a broken argument, import or code path shows here, not in a GPU call's
minutes; the figures it reports must be real measurements (a step's loss is a language model's at
initialisation, every rate positive), and a part that fails, overruns or is unknown must fail the check."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# a training contender's line: "  ours   55.5 ms/step   2307 tok/s  MFU 0.4%  406 MiB  build ... loss 6.243"
TRAIN_ROW = re.compile(r"^  (\S+) +([\d.]+) ms/step +(\d+) tok/s .* loss ([\d.]+)$", re.M)
SMOKE_VOCAB = 512  # gpu_common.named_shapes()["smoke"]


def gpu_check(tmp_path: Path, timeout: int = 600, **env: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "DRY_RUN": "1", "PYTHON": sys.executable, "OUT": str(tmp_path), **env}
    return subprocess.run(
        ["bash", "benchmarks/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_the_gpu_check_runs_its_commands_on_a_cpu(tmp_path: Path) -> None:
    done = gpu_check(tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    summary = done.stdout.split("=== summary (cpu)", 1)[1]
    assert summary.count("ours-default     skipped: a CUDA-only path") == 3  # one process per shape
    assert "tests collected" in summary and "error" not in summary.lower() and "failed" not in summary
    want = {"train_135m.txt", "train_tiny.txt", "train_tiny_default.txt", "decode.txt", "lora.txt", "profile.txt"}
    assert {p.name for p in tmp_path.iterdir()} >= want
    for part in ("train_135m", "train_tiny", "train_tiny_default"):  # ours and transformers, each measured
        rows = {name: (float(rate), float(loss)) for name, _, rate, loss in TRAIN_ROW.findall(read(tmp_path, part))}
        assert set(rows) == {"ours", "hf"}, part
        for name, (rate, loss) in rows.items():  # a random model's loss is ln(vocab): a real LM step ran
            assert rate > 0 and abs(loss - math.log(SMOKE_VOCAB)) < 0.5, (part, name, rate, loss)
    decode = re.findall(r"^  (ours|hf-static) +([\d.]+) ", read(tmp_path, "decode"), re.M)
    assert {name for name, _ in decode} == {"ours", "hf-static"} and all(float(r) > 0 for _, r in decode)
    lora = re.search(r"^ +ours +(\d+) +\d+ +[\d.]+ +([\d.]+)\b", read(tmp_path, "lora"), re.M)
    assert "random 135M-shaped GGUF" in summary and lora is not None, read(tmp_path, "lora")
    assert int(lora.group(1)) > 0 and abs(float(lora.group(2)) - math.log(49152)) < 0.5  # random 135M: ln(V)
    step = re.search(r"^step: ([\d.]+) ms median", summary, re.M)
    assert step is not None and float(step.group(1)) > 0


def read(out: Path, part: str) -> str:
    return (out / f"{part}.txt").read_text()


def test_a_failing_or_overrunning_part_fails_the_check(tmp_path: Path) -> None:
    """The check's exit status is what a GPU call is judged by: a part that fails, one the budget leaves no
    time for, and an unknown part each make it non-zero, naming the part."""
    failed = gpu_check(tmp_path, 60, PYTHON="false", PARTS="pytest")  # its command exits 1
    assert failed.returncode == 1 and "=== pytest_cuda: exit 1" in failed.stdout, failed.stdout
    starved = gpu_check(tmp_path, 60, PARTS="pytest", BUDGET="0")
    assert starved.returncode == 1 and "skipped: pytest_cuda (0s of the 0s budget left)" in starved.stdout
    unknown = gpu_check(tmp_path, 60, PARTS="bogus")
    assert unknown.returncode == 2 and "unknown part bogus" in unknown.stdout
