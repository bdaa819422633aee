"""What every stage entry point shares: typed config, output paths, one MLflow run, clean errors.

A stage module is a thin Hydra app: `@hydra.main` composes the config (from `conf/`, or from
`params.yaml` when DVC runs it with `--config-dir . --config-name params`), then calls
`run_stage(name, cfg, body)`. `body` does the stage's work through one `pipeline` call and
returns its metrics.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, TypeVar

from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from hydra.types import RunMode
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, MissingMandatoryValue, OmegaConfBaseException

from pipeline.config import PipelineConfig
from pipeline.errors import ConfigError, PipelineError
from pipeline.files import fingerprint, write_json, write_text
from pipeline.gguf.reader import resolve_gguf_path
from pipeline.tracking import Run, project_root
from stages import output
from stages.overrides import SWEEP_DIR, check_overrides, forget_refused_sweep, forget_unknown_key, unknown_key_message
from stages.runs import open_run, summarize_parent
from stages.signals import restore_sigterm, stop_on_sigterm, stopped

CONFIG_PATH = "../conf"
T = TypeVar("T")
CONFIG_NAME = "config"
# MLflow's run page draws one chart per key, in sections by prefix (alphabetical, unprefixed last):
# the loss curves share the first section, the single-value summaries (`summary/`) the next.
# With distillation the train loss's two parts are charted beside it (`loss/train_ce`, `loss/train_kd`).
MLFLOW_NAMES = {
    "train_loss": "loss/train",
    "val_loss": "loss/val",
    "train_ce": "loss/train_ce",
    "train_kd": "loss/train_kd",
}


@dataclass(frozen=True)
class Paths:
    """Where each stage's outputs live, relative to the project root (DVC's working directory)."""

    root: Path

    @classmethod
    def here(cls) -> Paths:
        return cls(Path.cwd().resolve())

    @property
    def inputs(self) -> Path:
        return self.root / "data" / "inputs"

    @property
    def packed(self) -> Path:
        return self.root / "data" / "packed"

    @property
    def donor(self) -> Path:
        return self.root / "data" / "donor"

    @property
    def teach(self) -> Path:
        return self.root / "data" / "teach"

    @property
    def init(self) -> Path:
        return self.root / "models" / "init"

    @property
    def train(self) -> Path:
        return self.root / "models" / "train"

    @property
    def export(self) -> Path:
        return self.root / "models" / "export"

    @property
    def evaluate(self) -> Path:
        return self.root / "models" / "evaluate"

    @property
    def report(self) -> Path:
        return self.root / "reports"

    def outputs(self) -> list[Path]:
        """Every stage's output folder: DVC deletes each before its stage re-runs."""
        names = ("inputs", "packed", "donor", "teach", "init", "train", "export", "evaluate", "report")
        return [getattr(self, name) for name in names]

    def stage_out(self, stage: str) -> Path:
        return {"pack": self.packed, "realize": self.init}.get(stage) or getattr(self, stage)

    def metrics(self, stage: str) -> Path:
        return self.root / "metrics" / f"{stage}.json"

    def plots(self, stage: str) -> Path:
        return self.root / "plots" / stage


@dataclass
class StageContext:
    """Everything a stage body needs: typed config, paths, its output locations, tracking."""

    stage: str
    cfg: PipelineConfig
    resolved: dict[str, Any]
    paths: Paths
    out_dir: Path  # this stage's output directory (the DVC path, or the job dir in a sweep)
    metrics_path: Path
    plots_dir: Path
    run: Run | None
    inputs: dict[str, str] = field(default_factory=dict)

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Per-step metrics to MLflow; the losses as `loss/train`, `loss/val` (see MLFLOW_NAMES)."""
        if self.run is not None:
            self.run.log_metrics({MLFLOW_NAMES.get(k, k): v for k, v in metrics.items()}, step)

    @cached_property
    def donor(self) -> Path:
        """The donor (or fine-tune base) GGUF, resolved once from `donor.path` (`smollm2`: the packaged one)."""
        return resolve_gguf_path(self.cfg.donor.path)

    def add_input(self, name: str, path: Path) -> None:
        """Record an input's fingerprint as an MLflow tag `input.<name>`."""
        self.inputs[name] = fingerprint([path])
        if self.run is not None:
            self.run.set_tags({f"input.{name}": self.inputs[name]})

    def artifact(self, path: Path, artifact_path: str | None = None) -> None:
        if self.run is not None and Path(path).exists():
            self.run.log_artifact(path, artifact_path)

    @property
    def run_id(self) -> str | None:
        return None if self.run is None else self.run.run_id


def fail(message: str, code: int = 2) -> None:
    """One line on stderr and a non-zero exit: never a traceback for a user mistake."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(code)


def refuse(message: str) -> None:
    """`fail` before the stage ran anything: a multirun refused at its first job leaves no sweep dir."""
    forget_refused_sweep()
    fail(message)


def config_failed(e: PipelineError) -> None:
    """`refuse` a config the schema refused; a refused unknown key is also taken out of params.yaml."""
    refuse(str(e) + (forget_unknown_key(e.key) if isinstance(e, UnknownKeyError) else ""))


def entry(main: Callable[[], Any]) -> None:
    """Run a `@hydra.main` function so that Hydra's own refusals (an unknown key, an unknown group
    option, override syntax) end like ours: one `error:` line and exit 2, not Hydra's multi-line
    report and exit 1. Bugs still raise with their traceback."""
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")  # Hydra re-raises instead of printing and exiting 1
    sys.argv[1:] = sweep_dir_args(sys.argv[1:])
    try:
        main()
    except HydraException as e:
        fail(hydra_message(e))


def sweep_dir_args(argv: list[str]) -> list[str]:
    """`argv`, plus conf/config.yaml's tokened `hydra.sweep.dir` for a multirun that sets none: a composed
    config (`--config-name params`) has no `hydra` section, and Hydra's own default has no token, so two
    multiruns started in the same second shared one directory."""
    if not {"-m", "--multirun"} & set(argv) or any(a.lstrip("+~").startswith("hydra.sweep.dir=") for a in argv):
        return argv
    return [*argv, f"hydra.sweep.dir={SWEEP_DIR}"]


def hydra_message(e: HydraException) -> str:
    """Hydra's message on one line: the key, what was expected (the choices of a group), the fix."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    found = lines[0] if lines else type(e).__name__
    cause = str(e.__cause__).splitlines()[0] if e.__cause__ is not None and str(e.__cause__) else ""
    key = re.search(r"override '([^']+)'|find '([^']+)'", found)
    name = next((g for g in key.groups() if g), "") if key else ""
    if isinstance(e, MissingConfigException) and e.options:
        group = name.split("/")[0]
        return f"config group {group}: expected one of {', '.join(e.options)}, found {name}; fix: pick one of them"
    if "not in struct" in cause:
        return (
            f"config key {name}: expected a key of the config, found none of that name; fix: check its spelling "
            "(`python -m stages.compose` prints every key)"
        )
    if "No match in the defaults list" in found:  # a group choice on a config without groups (params.yaml)
        return (
            f"config group {name}: expected a config with a defaults list (conf/config.yaml), found one without "
            f"(a composed file such as params.yaml); fix: drop --config-dir/--config-name to pick {name}=..., "
            f"or set its keys one by one ({name}.key=value)"
        )
    where = f"config override '{e.override}'" if isinstance(e, OverrideParseException) else "config override"
    detail = f"{found} ({cause})" if cause else found
    return f"{where}: {detail}; fix: quote values with spaces, commas or brackets"


class UnknownKeyError(ConfigError):
    """A key the schema does not have (a typo, or `-S +key=...`)."""

    def __init__(self, message: str, key: str):
        super().__init__(message)
        self.key = key


def typed_config(cfg: DictConfig) -> PipelineConfig:
    """Merge into the schema (types, unknown keys) and build the dataclasses (value checks)."""
    return structured_config(PipelineConfig, cfg)


def structured_config(schema: type[T], cfg: DictConfig, source: str = "params.yaml") -> T:
    """`cfg` merged into the dataclass `schema` and built (its __post_init__ checks values);
    `source` names the config file for the one-line error."""
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), cfg)
        return OmegaConf.to_object(merged)
    except MissingMandatoryValue as e:
        raise ConfigError(
            f"config key {e.full_key}: expected a value, found ??? (mandatory); fix: set {e.full_key}=... on the "
            f"command line or in {source}"
        ) from None
    except OmegaConfBaseException as e:
        msg = str(e.msg if hasattr(e, "msg") and e.msg else e).splitlines()[0]
        key = getattr(e, "full_key", None) or _section_given_a_value(OmegaConf.structured(schema), cfg) or "?"
        where = "conf/ or params.yaml" if source == "params.yaml" else source
        message = f"config key {key}: {msg}; fix: correct {key} in {where}"
        if isinstance(e, ConfigKeyError) and key != "?":
            raise UnknownKeyError(unknown_key_message(OmegaConf.structured(schema), key, where), key) from None
        raise ConfigError(mistyped(schema, cfg, key) or message) from None


_KINDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def mistyped(schema: type, cfg: DictConfig, key: str) -> str:
    """A value of the wrong type (`-S train.steps=abc`, `train.distill=0.5` for a group of keys) as the
    project's one line, with the schema's default as the valid example; "" when `key` has no typed default
    (OmegaConf's own wording is kept then)."""
    default = OmegaConf.select(OmegaConf.structured(schema), key, default=None) if key != "?" else None
    found = OmegaConf.select(cfg, key, default=None, throw_on_resolution_failure=False) if key != "?" else None
    if isinstance(default, DictConfig):
        first = next(iter(default), "key")
        expected = f"a group of keys ({', '.join(default)})"
        fix = f"set the keys inside it, e.g. {key}.{first}={_as_override(default[first])}"
    elif isinstance(default, ListConfig):
        expected, fix = "a list", f"write it in brackets, e.g. '{key}={_as_override(default)}'"
    elif type(default) in _KINDS:
        expected = _KINDS[type(default)]
        fix = f"set {key} to {expected}, e.g. {key}={_as_override(default)}"
    else:
        return ""
    shown = repr(found) if isinstance(found, str) else _as_override(found)
    return f"config key {key}: expected {expected}, found {shown}; fix: {fix}"


def _as_override(value: Any, quote: bool = False) -> str:
    """A value as it is typed after `key=` (true, [q,v], '' for the empty string, null); `quote`: a
    string with anything but letters, digits and _-. in double quotes (a list's item)."""
    if isinstance(value, (DictConfig, ListConfig)):
        value = OmegaConf.to_container(value)
    if isinstance(value, list):
        return "[" + ",".join(_as_override(v, quote=True) for v in value) + "]"
    if quote and isinstance(value, str) and not re.fullmatch(r"[\w.-]+", value):
        return json.dumps(value)
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    return repr(value) if isinstance(value, str) and (not value or value != value.strip()) else str(value)


def _section_given_a_value(schema: DictConfig, cfg: Any, prefix: str = "") -> str:
    """The dotted key of a group of keys that `cfg` sets to a single value (OmegaConf names none)."""
    if not isinstance(cfg, DictConfig):
        return ""
    for name, node in schema.items_ex(resolve=False):
        if isinstance(node, DictConfig) and name in cfg:
            value = cfg._get_node(name)
            if not isinstance(value, DictConfig):
                return f"{prefix}{name}"
            if inner := _section_given_a_value(node, value, f"{prefix}{name}."):
                return inner
    return ""


def config_hash(resolved: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(resolved, sort_keys=True).encode()).hexdigest()[:16]


def _outputs(stage: str, paths: Paths) -> tuple[Path, Path, Path]:
    """(output dir, metrics file, plots dir): the DVC paths, or a sweep job's own Hydra job dir."""
    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        job_dir = Path(HydraConfig.get().runtime.output_dir)
        return job_dir / stage, job_dir / "metrics.json", job_dir / "plots"
    return paths.stage_out(stage), paths.metrics(stage), paths.plots(stage)


def run_stage(
    stage: str,
    cfg: DictConfig,
    body: Callable[[StageContext], dict[str, float]],
    resume_run: Callable[[PipelineConfig, Paths], str | None] | None = None,
    lineage: Callable[[PipelineConfig, Paths], dict[str, str]] | None = None,
) -> dict[str, float]:
    """Validate config, open the MLflow run, run `body`, write metrics; exit 2 on user errors.

    `lineage` checks the config against what the stage's inputs were made with, before any run
    opens, and returns tags for the run. `resume_run` may name an existing MLflow run to reopen
    instead of starting one (a training run resumed from a checkpoint keeps logging to its run).
    Under torchrun only rank 0 tracks and writes metrics.
    """
    primary = int(os.environ.get("RANK", "0")) == 0
    try:
        typed = typed_config(cfg)
        output.configure(typed.output)
        check_overrides(stage, cfg)
    except PipelineError as e:
        config_failed(e)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    paths = Paths.here()
    out_dir, metrics_path, plots_dir = _outputs(stage, paths)
    try:
        tags = lineage(typed, paths) if lineage is not None else {}
        resume_id = resume_run(typed, paths) if resume_run is not None else None
    except PipelineError as e:
        refuse(str(e))
    run, parent = (None, None)
    if primary:
        run, parent = open_run(stage, typed, resolved, project_root(paths.root), config_hash(resolved), resume_id)
    if run is not None:
        run.set_tags(tags)
    ctx = StageContext(stage, typed, resolved, paths, out_dir, metrics_path, plots_dir, run)
    status = "FAILED"
    previous = stop_on_sigterm()
    try:
        metrics = body(ctx)
        _write_results(ctx, cfg, metrics, primary)
        summarize_parent(parent, stage, metrics)
        status = "FINISHED"
    except PipelineError as e:
        status = getattr(e, "mlflow_status", "FAILED")
        if run is not None:
            run.set_tags({"error": str(e)})
            run.end(status)
        fail(str(e), getattr(e, "exit_code", 2))
    except BaseException as e:
        status = "KILLED" if not isinstance(e, Exception) else "FAILED"
        if run is not None:
            run.end(status)
        if isinstance(e, KeyboardInterrupt):
            fail(*stopped(stage, e))
        raise
    finally:
        restore_sigterm(previous)
        if parent is not None:
            parent.end(status)
    return metrics


def _write_results(ctx: StageContext, cfg: DictConfig, metrics: dict[str, float], primary: bool) -> None:
    """The metrics file and `output=json` line (rank 0), then the MLflow run's summary (FINISHED)."""
    if primary:
        write_json(ctx.metrics_path, metrics)
        output.emit_json(ctx.cfg.output, ctx.stage, metrics, ctx.run_id)
    if ctx.run is not None:
        _finish(ctx.run, ctx.stage, cfg, metrics, ctx.metrics_path, ctx.out_dir)


def _finish(run: Run, stage: str, cfg: DictConfig, metrics: dict, metrics_path: Path, out_dir: Path) -> None:
    """The stage's summary metrics (under `summary/`, so the UI shows the curves first and keeps the
    single values in a section of their own), resolved config, metrics file and log file; then FINISHED."""
    run.log_metrics({f"summary/{k}": v for k, v in metrics.items() if isinstance(v, (int, float))}, step=0)
    config_file = write_text(out_dir.parent / f".{stage}-config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    run.log_artifact(config_file)
    config_file.unlink(missing_ok=True)
    run.log_artifact(metrics_path)
    logfile = output.log_file()
    if logfile and Path(logfile).is_file():
        for handler in logging.getLogger().handlers:
            handler.flush()
        run.log_artifact(Path(logfile), "logs")
    run.end("FINISHED")
