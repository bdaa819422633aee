"""Lineage: a stage's config against what its inputs record they were made with.

DVC keeps `params.yaml` and the stage outputs in step. A stage run by hand composes `conf/` plus
its overrides instead, and its inputs (`data/packed`, `models/init`) may come from another
configuration: say `dvc exp run -S recipe=from-scratch` left a scratch init, and
`python -m stages.train` composes the default warm-start recipe. Training would then log a recipe
it did not use. So the stages that read another stage's output compare first and stop with one
line naming the key, both values and the fix. What matched becomes MLflow tags (`lineage.*`):
the realized facts, not the requested config.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from pipeline.config import PipelineConfig
from pipeline.data.packed import META_FILE, data_files, load_meta
from pipeline.data.teacher_cache import META_FILE as TEACH_META
from pipeline.data.teacher_cache import read_meta as read_teach_meta
from pipeline.errors import ConfigError, problem
from pipeline.io.files import sha256_file
from pipeline.modeldir import REALIZE_FILE, read_realize
from stages._input_records import read_record

# A hand run composes conf/ afresh; the workspace's params.yaml is what `dvc repro` / `dvc exp run` made the
# inputs with, so running on it is the one-step fix (setting the one key may only reveal the next).
FIX = (
    "rebuild the inputs with `dvc repro` (or `dvc exp run -S {key}={value}`), run this stage on the workspace's"
    " config (`--config-dir . --config-name params`), or set {key}={recorded} to use them"
)


def mismatch(key: str, recorded: Any, configured: Any, record: Path) -> ConfigError:
    return ConfigError(
        problem(
            f"config key {key}",
            f"{recorded!r}, what {record} was made with",
            repr(configured),
            FIX.format(key=key, value=configured, recorded=recorded),
        )
    )


def compare(prefix: str, recorded: dict[str, Any], configured: dict[str, Any], record: Path) -> None:
    """Every key both sides have must agree (a record from an older version may lack some)."""
    for key in sorted(recorded.keys() & configured.keys()):
        if recorded[key] != configured[key]:
            raise mismatch(f"{prefix}.{key}", recorded[key], configured[key], record)


def check_packed(cfg: PipelineConfig, packed_dir: Path) -> dict[str, str]:
    """The data config against `data/packed/meta.json`; returns the lineage tags of the data."""
    meta = load_meta(packed_dir)
    if meta.data is not None:
        compare("data", meta.data, asdict(cfg.data), Path(packed_dir) / META_FILE)
    return {
        "lineage.data": f"{meta.source}:{meta.corpus_sha256[:12]}",
        "lineage.tokenizer": meta.tokenizer_fingerprint[:12],
    }


def check_init(cfg: PipelineConfig, init_dir: Path) -> dict[str, str]:
    """Recipe and model shape against `models/init/realize.json`; returns the init's lineage tags."""
    path = Path(init_dir) / REALIZE_FILE
    record = read_realize(init_dir)
    if record is None:
        return {}
    recorded = {"name": record.get("recipe"), "init": record.get("init"), "mode": record.get("mode")}
    configured = {"name": cfg.recipe.name, "init": cfg.recipe.init, "mode": cfg.recipe.mode}
    compare("recipe", {k: v for k, v in recorded.items() if v is not None}, configured, path)
    if not cfg.recipe.finetune and isinstance(record.get("model"), dict):
        compare("model", record["model"], asdict(cfg.model), path)
    return {"lineage.init": f"{record.get('recipe', '?')}:{record.get('init', '?')}"}


def check_teach(cfg: PipelineConfig, teach_dir: Path, packed_dir: Path, inputs_dir: Path) -> dict[str, str]:
    """With distillation on: `data/teach` must have been made, in this mode, from this packed train
    split (sha256 of its tokens) and this donor (the inputs stage's sha256 of it; online, train
    loads donor.path itself, so that must be the recorded one too), with at least
    train.distill.top_k tokens per position. Returns the teacher's lineage tag; {} when off."""
    d = cfg.train.distill
    if not d.enabled:
        return {}
    meta, record = read_teach_meta(teach_dir), Path(teach_dir) / TEACH_META
    if meta.mode == "off":  # made with weight 0: the key to name is the weight (mode has no value 'off')
        raise mismatch("train.distill.weight", 0.0, d.weight, record)
    if meta.mode != d.mode:
        raise mismatch("train.distill.mode", meta.mode, d.mode, record)
    if d.mode == "cached" and meta.source != d.source:
        raise mismatch("train.distill.source", meta.source, d.source, record)
    if meta.source == "donor" and meta.sequence != cfg.train.seq_len + 1:  # its windows are drawn whole
        raise mismatch("train.seq_len", meta.sequence - 1, cfg.train.seq_len, record)
    donor = read_record(inputs_dir)
    if d.mode == "online" and donor["path"] != cfg.donor.path:
        raise mismatch("donor.path", donor["path"], cfg.donor.path, Path(inputs_dir) / "donor.json")
    train_file = data_files(packed_dir)[1]
    made_from = (
        (str(train_file), meta.train_sha256, sha256_file(train_file)),
        (f"the donor ({Path(inputs_dir) / 'donor.json'})", meta.donor_sha256, donor["file"]["sha256"]),
    )
    for what, recorded, actual in made_from:
        if recorded != actual:
            fix = "rebuild it for this data and donor: `dvc repro teach` (or run teach with this run's overrides)"
            raise ConfigError(
                problem(str(record), f"a cache made from {what}, sha256 {actual[:12]}", recorded[:12], fix)
            )
    if d.mode == "cached" and d.top_k > meta.top_k:
        raise ConfigError(
            problem(
                "config key train.distill.top_k",
                f"at most {meta.top_k}, the k {record} was cached with",
                str(d.top_k),
                f"lower it, or rebuild the cache: dvc exp run -S train.distill.top_k={d.top_k}",
            )
        )
    return {"lineage.teacher": f"{meta.donor_name}:{meta.donor_sha256[:12]}:{meta.mode}:k{meta.top_k}"}
