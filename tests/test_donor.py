"""Donor reading and PCA: correct on real and tiny GGUFs, loud and clean on every bad input."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pipeline.donor.load import read_donor_embeddings
from pipeline.donor.pca import PCAResult, pca, run_donor
from pipeline.errors import GGUFError
from tests.conftest import write_tiny_gguf


def run(tmp_path: Path, gguf_path: Path, vocab: int = 64, d_model: int = 8, init: str = "pca") -> Path:
    out = tmp_path / "donor_out"
    run_donor(gguf_path, vocab, tmp_path / "meta.json", d_model, init, out)
    return out


def assert_fails_cleanly(tmp_path: Path, gguf_path: Path, *needles: str, **kw) -> None:
    """The named error carries the needles on one line, and no output directory is left behind."""
    with pytest.raises(GGUFError) as err:
        run(tmp_path, gguf_path, **kw)
    msg = str(err.value)
    assert "\n" not in msg
    for needle in needles:
        assert needle in msg, msg
    assert not (tmp_path / "donor_out").exists()
    assert not list(tmp_path.glob(".donor_out*")), "temp output left behind"


def test_pca_matches_numpy_svd() -> None:
    rng = np.random.default_rng(0)
    table = rng.standard_normal((200, 12)).astype(np.float32) * np.linspace(3, 0.1, 12, dtype=np.float32)
    res = pca(table, 5)
    assert res.components.shape == (5, 12) and res.projected.shape == (200, 5)
    np.testing.assert_allclose(res.components @ res.components.T, np.eye(5), atol=1e-5)
    np.testing.assert_allclose(res.projected, (table - table.mean(0)) @ res.components.T, atol=1e-4)
    centered = table - table.mean(0)
    s = np.linalg.svd(centered.astype(np.float64), compute_uv=False)
    np.testing.assert_allclose(res.explained_variance_ratio, (s**2 / (s**2).sum())[:5], rtol=1e-5)
    assert res.explained_variance_ratio[0] > res.explained_variance_ratio[-1]


def test_q8_0_table_is_dequantized(tmp_path: Path) -> None:
    f32 = read_donor_embeddings(write_tiny_gguf(tmp_path / "a.gguf", width=32)).table
    q8 = read_donor_embeddings(write_tiny_gguf(tmp_path / "b.gguf", width=32, embd_type="q8_0"))
    assert q8.tensor_type == "Q8_0" and q8.table.dtype == np.float32
    assert np.abs(q8.table - f32).max() < 0.05 * np.abs(f32).max()


def test_outputs_round_trip(tmp_path: Path) -> None:
    """What the donor stage saves is what it computed, bit for bit, and meta.json describes the donor."""
    gguf = write_tiny_gguf(tmp_path / "d.gguf")
    computed, metrics = run_donor(gguf, 64, tmp_path / "meta.json", 8, "pca", tmp_path / "donor_out")
    saved = PCAResult.load(tmp_path / "donor_out" / "pca.safetensors")
    for field in ("components", "mean", "projected", "explained_variance_ratio"):
        np.testing.assert_array_equal(getattr(saved, field), getattr(computed, field), err_msg=field)
    assert saved.projected.shape == (64, 8)
    np.testing.assert_array_equal(saved.projected, pca(read_donor_embeddings(gguf).table, 8).projected)
    meta = json.loads((tmp_path / "donor_out" / "meta.json").read_text())
    assert meta == {"path": str(gguf), "architecture": "llama", "width": 16, "vocab": 64, "tensor_type": "F32",
                    "components": 8}  # fmt: skip
    assert metrics["explained_variance_total"] == pytest.approx(float(saved.explained_variance_ratio.sum()))


def test_real_donor_pca(tmp_path: Path, smollm2_path: Path) -> None:
    out = tmp_path / "real"
    res, metrics = run_donor(smollm2_path, 49152, tmp_path / "meta.json", 64, "pca", out)
    assert res.components.shape == (64, 576) and res.projected.shape == (49152, 64)
    assert metrics["donor_width"] == 576
    assert 0 < metrics["explained_variance_total"] < 1


def test_missing_file(tmp_path: Path) -> None:
    assert_fails_cleanly(tmp_path, tmp_path / "nope.gguf", "nope.gguf", "no such file")


def test_not_a_gguf(tmp_path: Path) -> None:
    p = tmp_path / "x.gguf"
    p.write_bytes(b"PK\x03\x04 this is a zip, not a gguf" * 10)
    assert_fails_cleanly(tmp_path, p, "x.gguf", "magic")


def test_an_empty_file_names_its_size_and_the_fix(tmp_path: Path) -> None:
    p = tmp_path / "empty.gguf"
    p.write_bytes(b"")
    assert_fails_cleanly(tmp_path, p, "empty.gguf", "found 0 bytes; fix: point at a .gguf file")


def test_truncated_file(tmp_path: Path) -> None:
    good = write_tiny_gguf(tmp_path / "good.gguf", vocab=256, width=64)
    data = good.read_bytes()
    for cut in (20, len(data) // 3, len(data) - 100):
        p = tmp_path / f"cut{cut}.gguf"
        p.write_bytes(data[:cut])
        assert_fails_cleanly(tmp_path, p, f"cut{cut}.gguf", "truncated")


def test_no_embedding_tensor(tmp_path: Path) -> None:
    assert_fails_cleanly(tmp_path, write_tiny_gguf(tmp_path / "e.gguf", with_embd=False), "token_embd.weight")


def test_width_mismatch(tmp_path: Path) -> None:
    p = write_tiny_gguf(tmp_path / "w.gguf", width=16, declared_width=24)
    assert_fails_cleanly(tmp_path, p, "embedding_length=24", "(64, 16)")


def test_vocab_mismatch(tmp_path: Path) -> None:
    p = write_tiny_gguf(tmp_path / "v.gguf", vocab=64)
    assert_fails_cleanly(tmp_path, p, "100 rows", "64 rows", vocab=100)


def test_d_model_larger_than_donor_width_in_pca_mode(tmp_path: Path) -> None:
    p = write_tiny_gguf(tmp_path / "n.gguf", width=16)
    assert_fails_cleanly(tmp_path, p, "model.d_model", "16", d_model=32, init="pca")
    out = run(tmp_path, p, d_model=32, init="lens")  # lens mode may be wider: extra dims start at zero
    assert PCAResult.load(out / "pca.safetensors").components.shape == (16, 16)


def test_failed_rerun_keeps_previous_output(tmp_path: Path) -> None:
    good = write_tiny_gguf(tmp_path / "g.gguf")
    out = run(tmp_path, good)
    before = (out / "pca.safetensors").read_bytes()
    with pytest.raises(GGUFError):
        run(tmp_path, write_tiny_gguf(tmp_path / "bad.gguf", with_embd=False))
    assert (out / "pca.safetensors").read_bytes() == before
