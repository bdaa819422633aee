"""The default recipe's cut of its donor, sized to the corpus. A deeper cut keeps more of what the donor
knows but takes slower steps and needs a lower rate; in the default run's time it won on every corpus
the steps read under once (24 of SmolLM2's 30 layers against 12: 0.19-0.45 nats) and lost on pydoc,
which the steps read 4.3 times (docs/donor.md, "The cut sized to the corpus"). `model.n_layer`,
`optim.lr`, `train.steps` and `train.eval_every` at 0 take the chosen cut's values once the corpus is
packed: the stages apply `with_student_cut` before they read them."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from pipeline.config.checks import integer, positive

if TYPE_CHECKING:
    from pipeline.config.pipeline_schema import PipelineConfig

CUT_KEYS = ("model.n_layer", "optim.lr", "train.steps", "train.eval_every")


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


def needs_cut(cfg: PipelineConfig) -> list[str]:
    """The keys at 0 that wait for the corpus's cut."""
    values = (cfg.model.n_layer, cfg.optim.lr, cfg.train.steps, cfg.train.eval_every)
    return [key for key, value in zip(CUT_KEYS, values) if value == 0]


def with_student_cut(cfg: PipelineConfig, train_tokens: int) -> tuple[PipelineConfig, str]:
    """`cfg` with its keys at 0 set from the cut for `train_tokens`, and the cut's name ("" if none was)."""
    if not needs_cut(cfg):
        return cfg, ""
    t = cfg.train
    name, cut = cfg.donor.student.pick(train_tokens, t.batch_size * t.seq_len * t.grad_accum)
    model = replace(cfg.model, n_layer=cfg.model.n_layer or cut.n_layer)
    optim = replace(cfg.optim, lr=cfg.optim.lr or cut.lr)
    train = replace(t, steps=t.steps or cut.steps, eval_every=t.eval_every or cut.eval_every)
    return replace(cfg, model=model, optim=optim, train=train), name
