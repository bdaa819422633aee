"""The inputs stage's records: what makes DVC re-run pack when a user's file changes in place, and
nothing else. And the override rule a single stage applies to its command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.config import DataConfig
from pipeline.errors import PipelineError
from stages._input_records import run_inputs
from stages._run.overrides import changed_keys, readers, reads, unread_message


def records(data: DataConfig, donor: Path, out: Path) -> bytes:
    run_inputs(data, str(donor), donor, out)
    return b"".join((out / name).read_bytes() for name in ("corpus.json", "donor.json"))


def test_records_change_with_the_files_bytes_only(tmp_path: Path) -> None:
    corpus, donor = tmp_path / "corpus.txt", tmp_path / "donor.gguf"
    corpus.write_text("one\n---\ntwo\n")
    donor.write_bytes(b"GGUF" + bytes(64))
    data = DataConfig(source="text", path=str(corpus))
    first = records(data, donor, tmp_path / "a")
    assert records(data, donor, tmp_path / "b") == first  # same bytes: byte-identical records, nothing re-runs
    corpus.write_text("one\n---\ntwo, edited\n")
    assert records(data, donor, tmp_path / "c") != first
    corpus.write_text("one\n---\ntwo\n")
    donor.write_bytes(b"GGUF" + bytes(63) + b"\x01")
    assert records(data, donor, tmp_path / "d") != first
    record = json.loads((tmp_path / "a" / "corpus.json").read_text())
    assert record["files"][0]["name"] == "corpus.txt"  # a name, not an absolute path: temp copies agree


def test_a_directory_source_records_every_matching_file(tmp_path: Path) -> None:
    (tmp_path / "docs" / "sub").mkdir(parents=True)
    (tmp_path / "docs" / "a.txt").write_text("a")
    (tmp_path / "docs" / "sub" / "b.txt").write_text("b")
    (tmp_path / "docs" / "skip.md").write_text("c")
    donor = tmp_path / "donor.gguf"
    donor.write_bytes(b"GGUF")
    run_inputs(DataConfig(source="dir", path=str(tmp_path / "docs")), "d", donor, tmp_path / "out")
    record = json.loads((tmp_path / "out" / "corpus.json").read_text())
    assert [f["name"] for f in record["files"]] == ["a.txt", "sub/b.txt"]


def test_the_built_in_sources_record_their_stdlib_module(tmp_path: Path) -> None:
    donor = tmp_path / "donor.gguf"
    donor.write_bytes(b"GGUF")
    for source in ("pydoc", "instruct"):
        run_inputs(DataConfig(source=source), "d", donor, tmp_path / source)
        record = json.loads((tmp_path / source / "corpus.json").read_text())
        assert record["files"][0]["name"] == "topics.py" and record["files"][0]["bytes"] > 100_000


def test_a_missing_user_file_is_a_named_error(tmp_path: Path) -> None:
    with pytest.raises(PipelineError, match="data.path=.*nope.txt: expected an existing file"):
        run_inputs(DataConfig(source="text", path=str(tmp_path / "nope.txt")), "d", tmp_path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_which_stage_reads_which_key() -> None:
    assert reads("train", "optim.lr") and reads("train", "train.steps") and reads("train", "tracking.enabled")
    assert not reads("train", "model.d_model") and not reads("export", "optim.lr")
    assert readers("model.d_model") == ["donor", "realize"]
    assert readers("recipe.lora.dropout") == ["realize", "export"]
    base = {"optim": {"lr": 1e-3}, "model": {"d_model": 64}}
    assert changed_keys({"optim": {"lr": 3e-3}, "model": {"d_model": 64}}, base) == ["optim.lr"]
    message = unread_message("train", ["model.d_model"], ["optim.lr=1", "model.d_model=96"])
    assert message.startswith("config key model.d_model: stage train does not read it, donor, realize does")
    assert "model.d_model=96 changing it" in message and "dvc exp run -S 'model.d_model=96'" in message
    message = unread_message("train", ["model.d_model"], ["optim.lr=1", "seed=3", "preset=tiny", "output=quiet"])
    assert "found the override preset=tiny changing it" in message and "dvc exp run -S 'preset=tiny'" in message


def test_lineage_names_the_key_both_values_and_the_fix(tmp_path: Path) -> None:
    from dataclasses import asdict, replace

    from pipeline.config import PipelineConfig
    from pipeline.data.packed import PackMeta, write_meta
    from stages._lineage import check_init, check_packed

    cfg = PipelineConfig()
    counts = {"train": 1, "val": 1}
    meta = PackMeta(49152, "uint16", "t" * 64, "c" * 64, "pydoc", None, 2, counts, counts, 1, data=asdict(cfg.data))
    write_meta(tmp_path, meta)
    (tmp_path / "realize.json").write_text(
        json.dumps({"recipe": "from-scratch", "init": "scratch", "seed": 1, "model": asdict(cfg.model)})
    )
    scratch = replace(cfg, recipe=replace(cfg.recipe, name="from-scratch", init="scratch"))
    assert check_init(scratch, tmp_path) == {"lineage.init": "from-scratch:scratch"}
    assert check_packed(cfg, tmp_path)["lineage.data"] == "pydoc:cccccccccccc"
    with pytest.raises(PipelineError) as err:
        check_init(cfg, tmp_path)  # the default warm-start recipe against a scratch init
    message = str(err.value)
    assert message.startswith("config key recipe.init: expected 'scratch', what ") and "found 'pca'" in message
    assert "dvc repro" in message and "or set recipe.init=scratch to use them" in message and "\n" not in message
    assert "run this stage on the workspace's config (`--config-dir . --config-name params`)" in message
    wider = replace(scratch, model=replace(cfg.model, d_model=256, n_head=8, n_kv_head=2))
    with pytest.raises(PipelineError, match="config key model.d_model: expected 192"):
        check_init(wider, tmp_path)
    with pytest.raises(PipelineError, match="config key data.val_fraction: expected 0.1"):
        check_packed(replace(cfg, data=replace(cfg.data, val_fraction=0.2)), tmp_path)


def test_a_donor_that_is_a_directory_or_inside_a_stage_output_is_refused(tmp_path: Path) -> None:
    """A directory is named as such (not an IsADirectoryError traceback); an exported GGUF used as the
    donor where it was written would be deleted by DVC before export re-runs: refused, with the copy."""
    data = DataConfig(source="pydoc")
    with pytest.raises(PipelineError, match=r"^donor.path=d: expected a GGUF file, found a directory"):
        run_inputs(data, "d", tmp_path, tmp_path / "out")
    export = tmp_path / "models" / "export"
    export.mkdir(parents=True)
    (export / "model.gguf").write_bytes(b"GGUF")
    with pytest.raises(PipelineError) as err:
        run_inputs(data, "models/export/model.gguf", export / "model.gguf", tmp_path / "out", [export])
    assert "found a file in export/" in str(err.value) and "cp " in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "out").exists()
    run_inputs(data, "model.gguf", export / "model.gguf", tmp_path / "out", [tmp_path / "models" / "init"])
