"""Where each stage's outputs live, relative to the project root (DVC's working directory)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# Each stage's output folder, in the chain's order: the one table `dvc.yaml`'s outs follow.
STAGE_DIRS = {
    "inputs": "data/inputs",
    "pack": "data/packed",
    "donor": "data/donor",
    "teach": "data/teach",
    "realize": "models/init",
    "train": "models/train",
    "export": "models/export",
    "evaluate": "models/evaluate",
    "report": "reports",
}


@dataclass(frozen=True)
class Paths:
    """The project's folders: each stage's output (`out(stage)`), named by what the next stages read."""

    root: Path

    @classmethod
    def here(cls) -> Paths:
        return cls(Path.cwd().resolve())

    def out(self, stage: str) -> Path:
        return self.root / STAGE_DIRS[stage]

    @property
    def inputs(self) -> Path:
        return self.out("inputs")

    @property
    def packed(self) -> Path:
        return self.out("pack")

    @property
    def donor_dir(self) -> Path:
        """What the donor stage measured (calibration, PCA); the donor GGUF itself is `StageContext.donor_gguf`."""
        return self.out("donor")

    @property
    def teach(self) -> Path:
        return self.out("teach")

    @property
    def init(self) -> Path:
        return self.out("realize")

    @property
    def train(self) -> Path:
        return self.out("train")

    @property
    def export(self) -> Path:
        return self.out("export")

    @property
    def evaluate(self) -> Path:
        return self.out("evaluate")

    @property
    def report(self) -> Path:
        return self.out("report")

    def outputs(self) -> list[Path]:
        """Every stage's output folder: DVC deletes each before its stage re-runs."""
        return [self.out(stage) for stage in STAGE_DIRS]

    def metrics(self, stage: str) -> Path:
        return self.root / "metrics" / f"{stage}.json"

    def plots(self, stage: str) -> Path:
        return self.root / "plots" / stage
