"""Which config keys each stage reads, and a refusal of sweeps over keys a stage would ignore.

A stage only uses its own keys; its inputs come from the stages before it. A multirun of one stage
over a key another stage reads (`python -m stages.train -m model.d_model=192,256`) would train the
same `models/init` in every job while MLflow logs different values. So such a sweep is refused
before its first job, naming the key and the stages that read it. (A single run may carry the
whole chain's overrides, as running the stages one by one does; `stages._lineage` then checks
them against what its inputs were made with.) `STAGE_PARAMS` is also what `dvc.yaml` declares as
each stage's `params` (a test keeps the two equal).
"""

from __future__ import annotations

import difflib
import sys
from pathlib import Path
from typing import Any

from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict

from pipeline.errors import ConfigError
from pipeline.io.files import flatten, write_text

SWEEP_DIR = "multirun/${now:%Y-%m-%d}/${now:%H-%M-%S}-${run_token:}"  # as conf/config.yaml's hydra.sweep.dir
HYDRA_FILES = ("config.yaml", "hydra.yaml", "overrides.yaml")  # what Hydra writes in a job's .hydra/

STAGE_PARAMS: dict[str, tuple[str, ...]] = {
    "inputs": ("data", "donor.path"),
    "pack": ("data", "donor.path"),
    "donor": (
        "donor.path",
        "model.d_model",
        "recipe.init",
        "recipe.subclone.calib_tokens",
        "recipe.subclone.calib_seq_len",
        "recipe.subclone.outlier_factor",
    ),
    "teach": (
        "train.distill.weight",
        "train.distill.mode",
        "train.distill.top_k",
        "train.distill.context",
        "train.distill.cache_tokens",
        "train.distill.span",
        "train.distill.source",
        "train.distill.prompt_tokens",
        "train.seq_len",
        "train.vocab",
        "donor.path",
    ),
    "realize": ("seed", "model", "recipe", "donor.path", "donor.student", "train.seq_len", "train.vocab"),
    "train": ("seed", "train", "optim", "donor.path", "donor.student"),
    "export": ("export", "donor.path", "recipe.lora.dropout", "train.seq_len"),
    "evaluate": ("evaluate", "train.seq_len", "train.batch_size", "train.qat", "recipe.init", "donor.path", "data"),
    "report": ("report", "recipe.name"),
}
EVERY_STAGE = ("tracking", "output")  # how a stage reports, never what it computes


def reads(stage: str, key: str) -> bool:
    """Whether `stage` reads the dotted leaf `key` (a declared param is the key or a prefix of it)."""
    declared = STAGE_PARAMS.get(stage, ()) + EVERY_STAGE
    return any(key == p or key.startswith(p + ".") for p in declared)


def readers(key: str) -> list[str]:
    return [s for s in STAGE_PARAMS if s != "inputs" and reads(s, key)]


def changed_keys(cfg: dict[str, Any], base: dict[str, Any]) -> list[str]:
    """Leaf keys whose value differs between two composed configs (or exist in only one)."""
    a, b = flatten(cfg), flatten(base)
    return sorted(k for k in a.keys() | b.keys() if a.get(k, object()) != b.get(k, object()))


def check_overrides(stage: str, cfg: DictConfig) -> None:
    """In a multirun, refuse overrides that change keys `stage` does not read (no-op otherwise)."""
    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return
    hc = HydraConfig.get()
    task = list(hc.overrides.task)
    if not task or stage not in STAGE_PARAMS:
        return
    check_sweep(stage, sys.argv[1:])
    base = GlobalHydra.instance().hydra.compose_config(
        config_name=hc.job.config_name, overrides=[], run_mode=RunMode.RUN
    )
    with open_dict(base):
        base.pop("hydra", None)  # its sweep keys only resolve inside a job
    with_base = OmegaConf.to_container(base, resolve=True)
    ignored = [k for k in changed_keys(OmegaConf.to_container(cfg, resolve=True), with_base) if not reads(stage, k)]
    if ignored:
        raise ConfigError(unread_message(stage, ignored, task))


def check_sweep(stage: str, argv: list[str]) -> None:
    """A sweep over a key `stage` does not read is refused as a whole, before its first job runs,
    even when that job's value happens to equal the composed one."""
    args = [a for a in argv if "=" in a and not a.startswith("-") and not a.startswith("hydra")]
    try:
        overrides = OverridesParser.create().parse_overrides(args)
    except HydraException:
        return  # Hydra itself reports a malformed override
    for o in overrides:
        key = o.key_or_group
        declared = STAGE_PARAMS[stage] + EVERY_STAGE
        if o.is_sweep_override() and not reads(stage, key) and not any(p.startswith(key + ".") for p in declared):
            raise ConfigError(unread_message(stage, [key], [o.input_line or key]))


def forget_refused_sweep() -> None:
    """A multirun refused at its first job ran nothing, yet Hydra had made its sweep dir: take out
    Hydra's own files there (multirun.yaml, the job's .hydra/, its log when empty) and each directory
    left empty, up to multirun/. Only in a sweep dir of this run's own (the tokened default that
    `sweep_dir_args` adds); whatever else is in it stays, and so does a sweep dir the user named."""
    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return
    hc = HydraConfig.get()
    if hc.job.num != 0 or f"hydra.sweep.dir={SWEEP_DIR}" not in sys.argv:  # hc.overrides holds it resolved
        return
    sweep, job = Path(hc.runtime.cwd) / hc.sweep.dir, Path(hc.runtime.output_dir)
    meta = job / (hc.output_subdir or ".hydra")
    log = job / f"{hc.job.name}.log"
    for f in [sweep / "multirun.yaml", *(meta / n for n in HYDRA_FILES), *([log] if _empty_file(log) else [])]:
        f.unlink(missing_ok=True)
    for d in (meta, job, sweep, *list(sweep.parents)[: len(Path(SWEEP_DIR).parts) - 1]):  # date dir, multirun/
        try:
            d.rmdir()  # only when empty
        except OSError:
            return


def _empty_file(path: Path) -> bool:
    return path.is_file() and path.stat().st_size == 0


def unread_message(stage: str, ignored: list[str], task: list[str]) -> str:
    key = ignored[0]
    causes = [o for o in task if _override_key(o) and (key + ".").startswith(_override_key(o) + ".")]
    # else a group choice (preset=tiny, model=llama-tiny) changed it: never blame the stage's own keys
    causes = causes or [o for o in task if "." not in _override_key(o) and not reads(stage, _override_key(o))] or task
    by = readers(key) or ["no stage"]
    more = f" (and {len(ignored) - 1} more key(s))" if len(ignored) > 1 else ""
    return (
        f"config key {key}: stage {stage} does not read it, {', '.join(by)} does; found the override "
        f"{' '.join(causes)} changing it{more}; fix: drop it here and run the pipeline with "
        f"`dvc exp run -S '{causes[0]}'`, which re-runs every stage it affects"
    )


def _override_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~") if "=" in override else ""


def unknown_key_message(schema: DictConfig, key: str, where: str) -> str:
    """A key the schema lacks (`-S +optim.lrr=1`) in the shape of every other refusal, naming the nearest
    key of its section: OmegaConf's own words ("Key 'lrr' not in 'OptimConfig'") said neither."""
    section, _, name = key.rpartition(".")
    node = OmegaConf.select(schema, section, default=None) if section else schema
    near = difflib.get_close_matches(name, list(node.keys()), n=1) if isinstance(node, DictConfig) else []
    meant = f" (did you mean {section + '.' if section else ''}{near[0]}?)" if near else ""
    listing = " (`python -m stages.compose` prints every key)" if "params.yaml" in where else ""  # the pipeline's
    return (
        f"config key {key}: expected a key of the config, found none of that name{meant}; "
        f"fix: correct {key} in {where}{listing}"
    )


def forget_unknown_key(key: str) -> str:
    """Take a key the schema refused out of params.yaml when the stage read it from there.

    `dvc exp run -S +optim.lrr=1` (the `+` Hydra suggests) writes the misspelt key into params.yaml
    before any stage runs, and a failed experiment would leave it there for every later run.
    Returns what was done, for the error line ("" when the key did not come from params.yaml).
    """
    path = params_file()
    if path is None:
        return ""
    data = OmegaConf.load(path)
    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(data, parent) if parent else data
    if not isinstance(node, DictConfig) or leaf not in node:
        return ""
    del node[leaf]
    write_text(path, OmegaConf.to_yaml(data))
    return f" (removed {key} from {path}, so the failed run does not leave it behind)"


def params_file() -> Path | None:
    """The params.yaml this stage composed from (`--config-dir <dir> --config-name params`), if any."""
    if not HydraConfig.initialized() or HydraConfig.get().job.config_name != "params":
        return None
    for source in HydraConfig.get().runtime.config_sources:
        if source.provider == "command-line" and source.schema == "file":
            path = Path(source.path) / "params.yaml"
            return path if path.is_file() else None
    return None
