"""Structured-config schemas reject bad values at start, naming the key; params.yaml is the composition."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from pipeline.config import OptimConfig, PipelineConfig, TrainConfig
from pipeline.config.pipeline_schema import with_student_cut
from pipeline.errors import ConfigError
from stages._run.typed import typed_config
from stages.compose import compose_config
from tests.conftest import ROOT


def test_default_composition_is_valid() -> None:
    cfg = typed_config(compose_config())
    assert isinstance(cfg, PipelineConfig)
    assert cfg.recipe.init == "subclone" and cfg.recipe.name == "subclone" and cfg.model.d_model == 384
    assert cfg.model.n_layer == 0 and cfg.train.distill.weight == 0.0 and cfg.optim.table_lr_scale == 0.0
    assert (cfg.optim.lr, cfg.train.steps, cfg.train.eval_every) == (0, 0, 0)  # the donor's cut, once packed


@pytest.mark.parametrize(
    ("overrides", "tokens", "want"),
    [
        ([], 105_757, ("shallow", 12, 0.001, 720, 360)),  # pydoc: 440 steps would read it 4.3 times
        ([], 629_295, ("deep", 24, 0.00025, 440, 220)),  # fortunes: 0.72 times
        (["donor=gemma3-270m"], 2_000_000, ("deep", 12, 0.001, 720, 360)),  # Gemma: 12 of its 18 layers
        (["model.n_layer=18", "train.steps=500"], 629_295, ("deep", 18, 0.00025, 500, 220)),  # set keys stay
        (["donor.student.max_passes=10"], 105_757, ("deep", 24, 0.00025, 440, 220)),
    ],
)
def test_the_donor_group_sizes_the_cut_to_the_corpus(overrides: list[str], tokens: int, want: tuple) -> None:
    cut, name = with_student_cut(typed_config(compose_config(overrides)), tokens)
    assert (name, cut.model.n_layer, cut.optim.lr, cut.train.steps, cut.train.eval_every) == want


def test_a_from_scratch_run_keeps_its_own_rate_and_steps_and_the_cuts_shape() -> None:
    scratch, _ = with_student_cut(typed_config(compose_config(["recipe=from-scratch", "optim=adamw"])), 629_295)
    assert (scratch.model.n_layer, scratch.optim.lr, scratch.train.steps) == (24, 0.003, 300)
    with pytest.raises(ConfigError, match="donor.student.deep.steps"):
        typed_config(compose_config(["donor.student.deep.steps=0"]))


def test_params_yaml_equals_fresh_composition() -> None:
    on_disk = yaml.safe_load((ROOT / "params.yaml").read_text())
    fresh = OmegaConf.to_container(compose_config(), resolve=True)
    assert on_disk == fresh, "params.yaml is stale: run `make params`"


def test_conf_spells_out_every_schema_key() -> None:
    """DVC composes conf/ without our schema, so conf/ must hold every key params.yaml needs."""
    composed = OmegaConf.to_container(compose_config(), resolve=True)
    with_schema = OmegaConf.to_container(OmegaConf.merge(OmegaConf.structured(PipelineConfig), composed))
    assert composed == with_schema


@pytest.mark.parametrize(("group", "schema"), [("optim", OptimConfig), ("train", TrainConfig)])
def test_the_schema_defaults_are_the_default_groups(group: str, schema: type) -> None:
    """One default per key: a dataclass default is what the default group of conf/config.yaml sets (a
    recipe or preset may then set its own value, e.g. recipe=subclone's train.steps=720)."""
    defaults = yaml.safe_load((ROOT / "conf" / "config.yaml").read_text())["defaults"]
    (choice,) = [d[group] for d in defaults if isinstance(d, dict) and group in d]
    spelled = yaml.safe_load((ROOT / "conf" / group / f"{choice}.yaml").read_text())
    per_donor = {k for k, v in spelled.items() if k == "lr" and v == 0}  # 0: the donor's cut's (donor.student)
    expected = {k: v for k, v in asdict(schema()).items() if k not in per_donor}
    assert expected == {k: v for k, v in spelled.items() if k not in per_donor}, f"conf/{group}/{choice}.yaml differs"


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["model.arch=llama", "model.n_head=7"], "model.n_head"),
        (["model.n_kv_head=4"], "model.n_kv_head"),
        (["optim.lr=-0.1"], "optim.lr"),
        (["optim.table_lr_scale=-1"], "optim.table_lr_scale"),
        (["train.precision=fp8"], "train.precision"),
        (["recipe.init=magic"], "recipe.init"),
        (["model.d_model=abc"], "model.d_model"),
        (["train.steps=1.5"], "train.steps"),
        (["train.grad_accum=0"], "train.grad_accum"),
        (["export.dtype=q3"], "export.dtype"),
        (["train.seq_len=1024"], "train.seq_len"),
        (["data=jsonl"], "data.path"),
        (["+model.unknown_key=1"], "model.unknown_key"),
    ],
)
def test_bad_values_are_rejected_naming_the_key(overrides: list[str], key: str) -> None:
    with pytest.raises(ConfigError) as err:
        typed_config(compose_config(overrides))
    message = str(err.value)
    assert message.startswith((key, f"config key {key}")) and "\n" not in message  # one line, the key first


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("train.steps=abc", "config key train.steps: expected an integer, found 'abc'; fix: set train.steps to"),
        ("optim.lr=fast", "config key optim.lr: expected a number, found 'fast'; fix: set optim.lr to a number, e.g."),
        ("train.compile=maybe", "config key train.compile: expected one of auto, true, false, found 'maybe'"),
        ("train.steps=null", "config key train.steps: expected an integer, found null"),
        ("recipe.lora.targets=q", "config key recipe.lora.targets: expected a list, found 'q'; fix: write it in"),
        ("train.distill=0.5", "config key train.distill: expected a group of keys (weight, temperature, top_k,"),
    ],
)
def test_wrong_types_name_key_expected_found_and_fix(override: str, expected: str) -> None:
    """`dvc exp run -S train.steps=abc` (or `train.distill=0.5`, a group given one value) is one line with the
    key, the type wanted, the value given and an example; a group given a value used to read `config key ?`."""
    with pytest.raises(ConfigError) as err:
        typed_config(compose_config([override]))
    assert str(err.value).startswith(expected) and "\n" not in str(err.value)
    assert "?" not in str(err.value) and "could not be converted" not in str(err.value)


@pytest.mark.parametrize(
    "overrides",
    [
        ["data.path=my.jsonl"],
        ["recipe=vit-tiny", "data.path=pets/"],
        ["data=mix", "data.sources=[{source: pydoc, path: my.jsonl, weight: 1}]"],
    ],
)
def test_a_path_for_a_source_that_reads_none_is_refused(overrides: list[str]) -> None:
    """`dvc exp run -S data.path=my.jsonl` without `-S data=jsonl` (or preset=lora) packed the built-in pydoc
    corpus while the inputs stage hashed my.jsonl: the run trained on other data than its record said."""
    with pytest.raises(ConfigError) as err:
        typed_config(compose_config(overrides))
    message = str(err.value)
    assert re.match(r"config key data\.(path|sources\[0\]\.path): expected no path for (data\.)?source", message)
    assert "my.jsonl" in message or "pets/" in message


def test_recipes_select_the_init() -> None:
    assert typed_config(compose_config(["recipe=from-scratch"])).recipe.init == "scratch"
    assert typed_config(compose_config(["recipe=pca-lens"])).recipe.init == "lens"


def test_stage_cli_reports_one_line_and_exits_nonzero(tmp_path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "stages.train", "optim.lr=-1", "tracking.enabled=false"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == [lines[0]] and lines[0].startswith("error: config key optim.lr")
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "override, start",
    [
        ("optim.lrr=1", "error: config key optim.lrr: expected a key of the config"),
        ("recipe=lorra", "error: config group recipe: expected one of distill, draft, from-scratch, full-finetune"),
        ("optim.lr=[1,2", "error: config override 'optim.lr=[1,2': expected a value in Hydra's override syntax"),
        ("dir/corpus.txt", "error: config override 'dir/corpus.txt': expected key=value, found no '='"),
        (  # OmegaConf said "Key 'lrr' not in 'OptimConfig'": no expected/found, no key to use
            "+optim.lrr=1",
            "error: config key optim.lrr: expected a key of the config, found none of that name "
            "(did you mean optim.lr?); fix: correct optim.lrr in conf/ or params.yaml",
        ),
    ],
)
def test_hydras_own_refusals_are_one_named_line_and_exit_2(override: str, start: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "stages.train", override, "tracking.enabled=false"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(start), proc.stderr
    assert "fix:" in lines[0]


def test_an_empty_donor_path_is_named_as_such() -> None:
    """`donor.path=''` said "expected a GGUF file, found a directory" and named the working folder."""
    with pytest.raises(ConfigError, match=r"^config key donor.path: expected a GGUF file, or smollm2 .*found ''"):
        typed_config(compose_config(["donor.path=''"]))


def test_a_path_with_non_ascii_letters_works_unquoted(tmp_path: Path) -> None:
    """Hydra's override grammar refuses `data.path=/data/ünïcödé/cörpus.txt` unquoted; the entry point
    quotes such a value for it, so a user with an accented folder name runs the pipeline as anyone else."""
    from stages._run.exits import quoted_non_ascii

    folder = tmp_path / "ünïcödé"
    folder.mkdir()
    (folder / "cörpus.txt").write_text("Bonjour à tous.\n---\nUn deuxième document.\n")
    assert quoted_non_ascii("data.path=/a/é") == "data.path='/a/é'" and quoted_non_ascii("a=1,é") == "a=1,é"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = [sys.executable, "-m", "stages.inputs", "data=text", f"data.path={folder / 'cörpus.txt'}", "output=quiet"]
    proc = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    record = json.loads((tmp_path / "data" / "inputs" / "corpus.json").read_text())
    assert record["path"] == str(folder / "cörpus.txt") and [f["name"] for f in record["files"]] == ["cörpus.txt"]


def test_multiruns_started_in_the_same_second_get_sweep_dirs_of_their_own() -> None:
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from stages.compose import CONF_DIR

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        first, second = (compose(config_name="config", return_hydra_config=True) for _ in range(2))
    a, b = first.hydra.sweep.dir, second.hydra.sweep.dir
    assert a.startswith("multirun/") and a.rsplit("-", 1)[0].count("/") == 2
    assert a.rsplit("-", 1)[1] != b.rsplit("-", 1)[1]  # another token, whatever the clock says
    # one multirun's jobs all see its directory: Hydra copies the resolver cache into each job's config
    job = OmegaConf.create(OmegaConf.to_container(first, resolve=False))
    OmegaConf.copy_cache(from_config=first, to_config=job)
    assert first.hydra.sweep.dir == a and job.hydra.sweep.dir == a


def test_a_multirun_on_the_composed_params_gets_a_tokened_sweep_dir_too(tmp_path: Path) -> None:
    """params.yaml has no `hydra` section: Hydra's default sweep dir (no token) applied to such sweeps."""
    from stages._run.exits import sweep_dir_args
    from stages._run.overrides import SWEEP_DIR

    assert yaml.safe_load((ROOT / "conf" / "config.yaml").read_text())["hydra"]["sweep"]["dir"] == SWEEP_DIR
    assert sweep_dir_args(["a=1"]) == ["a=1"] and sweep_dir_args(["-m", "hydra.sweep.dir=x"]) == [
        "-m",
        "hydra.sweep.dir=x",
    ]
    (tmp_path / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = [sys.executable, "-m", "stages.inputs", "--config-dir", ".", "--config-name", "params", "-m", "output=quiet"]
    proc = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    (day,) = (tmp_path / "multirun").iterdir()
    assert [re.fullmatch(r"\d\d-\d\d-\d\d-[0-9a-f]{6}", d.name) is not None for d in day.iterdir()] == [True]


def test_a_refused_multirun_leaves_no_sweep_dir_behind(tmp_path: Path) -> None:
    """A sweep refused at its first job left multirun/<date>/<time>/ with only Hydra's bookkeeping in it.
    Directories it did not make stay, and so does a sweep dir the user named."""
    (tmp_path / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    (tmp_path / "multirun" / "keep").mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = [sys.executable, "-m", "stages.train", "--config-dir", ".", "--config-name", "params", "-m", "output=quiet"]
    for extra in ([], ["hydra.sweep.dir=multirun/mine"]):
        proc = subprocess.run(
            [*args, "data.val_fraction=0.1,0.2", *extra], cwd=tmp_path, env=env, capture_output=True, text=True
        )
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert proc.returncode == 2 and len(errors) == 1 and "config key data.val_fraction" in errors[0], proc.stderr
        assert "Traceback" not in proc.stderr
        if not extra:
            assert [d.name for d in (tmp_path / "multirun").iterdir()] == ["keep"]
    assert sorted(d.name for d in (tmp_path / "multirun").iterdir()) == ["keep", "mine"]


def test_a_group_choice_on_the_composed_params_is_one_line_naming_the_group() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "stages.pack", "--config-dir", ".", "--config-name", "params", "data=dir"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: config group data: expected a config with a defaults list")
    assert "quote values" not in lines[0]
