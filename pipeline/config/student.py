"""The default recipe's cut of its donor, sized to the corpus. A deeper cut keeps more of what the donor
knows but takes slower steps and needs a lower rate; in the default run's time it won on every corpus
the steps read under once (24 of SmolLM2's 30 layers against 12: 0.17-0.45 nats) and lost on pydoc,
which the steps read 4.3 times (docs/donor.md, "The cut sized to the corpus"). `model.n_layer`,
`optim.lr`, `train.steps` and `train.eval_every` at 0 take the chosen cut's values once the corpus is
packed: the stages apply `pipeline.config.pipeline_schema.with_student_cut` before they read them."""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.config.checks import integer, positive


@dataclass
class StudentCut:
    """One cut: its depth, and the rate, steps and validation cadence it trains at in the default's time."""

    n_layer: int = 24
    lr: float = 0.00025
    steps: int = 440
    eval_every: int = 220


@dataclass
class StudentDefaults:
    """`deep` where its steps read the train split at most `max_passes` times, else `shallow`."""

    deep: StudentCut = field(default_factory=StudentCut)
    shallow: StudentCut = field(default_factory=lambda: StudentCut(12, 0.001, 720, 360))
    max_passes: float = 2.0

    def __post_init__(self) -> None:
        for name in ("deep", "shallow"):
            cut = getattr(self, name)
            for key in ("n_layer", "steps", "eval_every"):
                integer(getattr(cut, key), f"donor.student.{name}.{key}", 1, f"set donor.student.{name}.{key}>=1")
            positive(cut.lr, f"donor.student.{name}.lr")
        positive(self.max_passes, "donor.student.max_passes")

    def pick(self, train_tokens: int, batch_tokens: int) -> tuple[str, StudentCut]:
        """The cut for a train split of `train_tokens`, read `batch_tokens` per step."""
        passes = self.deep.steps * batch_tokens / max(train_tokens, 1)
        return ("deep", self.deep) if passes <= self.max_passes else ("shallow", self.shallow)
