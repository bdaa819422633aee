"""Where the report was made: the machine, the code and the library versions. The stages of one
`dvc repro` run on the same machine, so this is the training's environment too (a queued
experiment's included); a stage run elsewhere says so in its own MLflow run."""

from __future__ import annotations

import os
import platform
from importlib import metadata
from pathlib import Path

import torch

from pipeline.models.devices import pick_device

PACKAGES = ("torch", "numpy", "gguf", "tokenizers", "mlflow", "dvc", "hydra-core", "matplotlib")


def cpu_model() -> str:
    """The CPU's marketing name (Linux: /proc/cpuinfo), else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def environment(device: str, threads: int, commit: str | None) -> dict[str, str]:
    """The facts a reader needs to trust or reproduce a timing: commit, device, threads, CPU, versions."""
    dev = pick_device(device)
    accel = torch.cuda.get_device_name(dev) if dev.type == "cuda" else ""
    used = threads if threads > 0 else torch.get_num_threads()
    env = {
        "git commit": commit or "(not a git checkout)",
        "device": f"{dev} ({accel})" if accel else str(dev),
        "torch threads": f"{used}" + ("" if threads > 0 else " (train.threads=0: torch's default)"),
        "CPU": cpu_model(),
        "CPU cores": str(os.cpu_count()),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    env.update({p: version(p) for p in PACKAGES})
    return env
