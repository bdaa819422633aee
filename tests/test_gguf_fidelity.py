"""Fidelity with the GGUF ecosystem: what we read is what transformers and llama.cpp read, what we
write reads back exactly, and every malformed file fails with one named line.

The SmolLM2 parity tests compare against transformers live and against the llama.cpp reference
outputs in tests/fixtures/smollm2_reference.json (made with llama-cpp-python on the same GGUF).
"""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from pipeline.config import EXPORT_TYPES, ExportConfig
from pipeline.errors import ConfigError, GGUFError
from pipeline.gguf.header import count_tensors
from pipeline.gguf.quantize import K_QUANTS, llamacpp_installed
from pipeline.gguf.reader import GGUFFile
from pipeline.gguf.writer import TENSOR_TYPES
from pipeline.models.llama import Llama
from pipeline.models.llama_gguf import config_from_gguf, export_llama, gguf_tensors, load_llama
from pipeline.models.registry import SUPPORTED, load_gguf
from pipeline.models.transformer import TransformerConfig, init_weights
from pipeline.tokenizer.pretokenizers import donor_tokenizer_metadata

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "smollm2_reference.json"


# ---------------------------------------------------------------- tiny GGUFs


def tiny_cfg(**kw) -> TransformerConfig:
    base = dict(vocab_size=64, d_model=256, n_layer=1, n_head=4, n_kv_head=2, d_ff=512, context_length=64)
    base["norm_eps"] = float(np.float32(1e-5))  # what a GGUF float32 key holds
    return TransformerConfig(**{**base, **kw})


def tiny_tensors(cfg: TransformerConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """GGUF-named fp32 tensors of a random model whose norms are not all ones."""
    model = Llama(cfg)
    init_weights(model, 0.1, seed)
    tensors = gguf_tensors(model)
    rng = np.random.default_rng(seed)
    for name, arr in tensors.items():
        if arr.ndim == 1:
            tensors[name] = (1 + 0.1 * rng.standard_normal(arr.shape)).astype(np.float32)
    return tensors


def write_llama(
    path: Path,
    cfg: TransformerConfig,
    tensors: dict[str, np.ndarray],
    qtype: Q = Q.F32,
    meta: dict | None = None,
    drop: tuple[str, ...] = (),
    arch: str = "llama",
) -> Path:
    """A llama GGUF written straight with GGUFWriter, every matrix stored as `qtype` (norms F32)."""
    from pipeline.models.llama_gguf import llama_metadata

    w = gguf.GGUFWriter(path, arch)
    keys = {k.replace("llama.", f"{arch}.", 1): v for k, v in llama_metadata(cfg, "f32").items()}
    keys.update(meta or {})
    for key, value in keys.items():
        if key in drop:
            continue
        if isinstance(value, list):
            w.add_array(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint32(key, value)
    for name, arr in tensors.items():
        t = qtype if arr.ndim == 2 else Q.F32
        w.add_tensor(name, gguf.quants.quantize(arr, t), raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


QUANTIZABLE = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q5_1, Q.Q5_0, Q.Q4_1, Q.Q4_0, Q.MXFP4, Q.TQ2_0, Q.TQ1_0]
# relative RMS error of the stored matrices vs the fp32 originals, per type
REL_ERROR = {Q.F32: 0, Q.F16: 1e-3, Q.BF16: 5e-3, Q.Q8_0: 1e-2, Q.Q5_1: 0.05, Q.Q5_0: 0.05, Q.Q4_1: 0.1}
REL_ERROR |= {Q.Q4_0: 0.12, Q.MXFP4: 0.2, Q.TQ2_0: 1e-2, Q.TQ1_0: 1e-2}
TERNARY = (Q.TQ1_0, Q.TQ2_0)  # ternary formats: only meaningful for weights in {-s, 0, s}


def ternary(arr: np.ndarray) -> np.ndarray:
    """Weights in {-0.1, 0, 0.1} (BitNet-style), which TQ1_0/TQ2_0 store exactly up to an f16 scale."""
    return (0.1 * np.sign(arr) * (np.abs(arr) > 0.05)).astype(np.float32)


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda q: q.name)
def test_every_quantizable_type_loads(tmp_path: Path, qtype: Q) -> None:
    cfg = tiny_cfg(tie_embeddings=False)
    tensors = tiny_tensors(cfg)
    if qtype in TERNARY:
        tensors = {k: ternary(v) if v.ndim == 2 else v for k, v in tensors.items()}
    model, _ = load_llama(write_llama(tmp_path / "m.gguf", cfg, tensors, qtype))
    assert model.cfg == cfg
    loaded = gguf_tensors(model)
    for name, orig in tensors.items():
        got, t = loaded[name], qtype if orig.ndim == 2 else Q.F32
        exact = gguf.quants.dequantize(gguf.quants.quantize(orig, t), t)
        np.testing.assert_array_equal(got, exact.reshape(orig.shape), err_msg=name)
        rel = np.sqrt(np.mean((got - orig) ** 2) / np.mean(orig**2))
        assert rel <= REL_ERROR[t], (name, rel)


def test_k_quant_block_matches_the_ggml_formula(tmp_path: Path) -> None:
    """Q4_K (dequantize-only in gguf-py): y = d*sc*q - dmin*m, hand-packed blocks."""
    rng = np.random.default_rng(1)
    q = rng.integers(0, 16, size=(2, 256))
    blocks = []
    for row in q:
        head = np.array([0.5, 0.25], dtype=np.float16).tobytes()
        # 6-bit scales/mins: sub-blocks 0-3 from bytes 0-7, 4-7 from the nibbles of bytes 8-11
        scales = bytes([1, 1, 1, 1, 2, 2, 2, 2, 0x21, 0x21, 0x21, 0x21])
        qs = bytearray(128)
        for c in range(4):
            lo, hi = row[c * 64 : c * 64 + 32], row[c * 64 + 32 : c * 64 + 64]
            qs[c * 32 : c * 32 + 32] = bytes((lo | (hi << 4)).astype(np.uint8))
        blocks.append(head + scales + bytes(qs))
    raw = np.frombuffer(b"".join(blocks), dtype=np.uint8).reshape(2, -1)
    w = gguf.GGUFWriter(tmp_path / "k.gguf", "llama")
    w.add_tensor("t", raw, raw_dtype=Q.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    g = GGUFFile(tmp_path / "k.gguf")
    assert g.tensor_info("t").ggml_type == "Q4_K"
    np.testing.assert_array_equal(g.tensor("t"), 0.5 * q - 0.25 * 2)


def test_untied_output_is_the_head(tmp_path: Path) -> None:
    cfg = tiny_cfg(tie_embeddings=False)
    tensors = tiny_tensors(cfg)
    model, _ = load_llama(write_llama(tmp_path / "m.gguf", cfg, tensors))
    assert model.head is not None
    np.testing.assert_array_equal(model.head.weight.detach().numpy(), tensors["output.weight"])
    tied, _ = load_llama(write_llama(tmp_path / "t.gguf", tiny_cfg(), tiny_tensors(tiny_cfg())))
    assert tied.head is None and tied.cfg.tie_embeddings


def test_rope_freqs_of_ones_is_plain_rope_and_scaled_ones_apply(tmp_path: Path) -> None:
    cfg = tiny_cfg()
    tensors = tiny_tensors(cfg)
    plain, _ = load_llama(write_llama(tmp_path / "p.gguf", cfg, tensors))
    ones = {**tensors, "rope_freqs.weight": np.ones(cfg.head_dim // 2, dtype=np.float32)}
    same, _ = load_llama(write_llama(tmp_path / "o.gguf", cfg, ones))
    ids = torch.arange(16)[None]
    with torch.no_grad():
        assert torch.equal(plain(ids), same(ids))
    factors = np.linspace(1, 8, cfg.head_dim // 2, dtype=np.float32)
    scaled_model, _ = load_llama(write_llama(tmp_path / "s.gguf", cfg, {**ones, "rope_freqs.weight": factors}))
    assert scaled_model.cfg.rope_freq_factors == tuple(float(f) for f in factors)
    with torch.no_grad():
        out = scaled_model(ids)
        assert not torch.allclose(out, plain(ids))
        # re-export keeps the factors and the function
        back, g = load_llama(export_llama(scaled_model, tmp_path / "r.gguf", {}, {}, "f32"))
        assert torch.equal(back(ids), out)
    np.testing.assert_array_equal(g.tensor("rope_freqs.weight"), factors)
    # first pair's angle at position p is p * inv_freq_0 / factor_0: check against rope_tables directly
    from pipeline.models.ops.elementwise import rope_tables

    cos_plain, _ = rope_tables(plain.cfg, 4, torch.device("cpu"))
    cos_scaled, _ = rope_tables(scaled_model.cfg, 4, torch.device("cpu"))
    last = cfg.head_dim // 2 - 1
    theta = 1.0 / cfg.rope_theta ** (2 * last / cfg.head_dim)
    assert float(cos_scaled[3, last]) == pytest.approx(np.cos(3 * theta / factors[last]), abs=1e-6)
    assert float(cos_plain[3, last]) == pytest.approx(np.cos(3 * theta), abs=1e-6)
    bad = {**ones, "rope_freqs.weight": np.zeros(cfg.head_dim // 2, dtype=np.float32)}
    with pytest.raises(GGUFError, match="positive RoPE frequency factors"):
        load_llama(write_llama(tmp_path / "z.gguf", cfg, bad))


def test_tensors_we_would_ignore_are_refused(tmp_path: Path) -> None:
    cfg = tiny_cfg()
    tensors = {**tiny_tensors(cfg), "blk.0.attn_q.bias": np.zeros(256, dtype=np.float32)}
    with pytest.raises(GGUFError, match=r"blk\.0\.attn_q\.bias") as e:
        load_llama(write_llama(tmp_path / "b.gguf", cfg, tensors))
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------- writing


def test_export_types_are_the_writer_types() -> None:
    """K-quants are accepted where llama.cpp's quantizer is installed (refused without: test_ship)."""
    assert EXPORT_TYPES == (*TENSOR_TYPES, *K_QUANTS)
    for dtype in EXPORT_TYPES if llamacpp_installed() else TENSOR_TYPES:
        assert ExportConfig(dtype=dtype).dtype == dtype
    with pytest.raises(ConfigError, match="export.dtype"):
        ExportConfig(dtype="q4_k")


@pytest.mark.parametrize(
    "dtype,ggml,file_type,cast",
    [
        ("f32", "F32", 0, lambda a: a),
        ("f16", "F16", 1, lambda a: a.astype(np.float16).astype(np.float32)),
        ("bf16", "BF16", 32, lambda a: torch.from_numpy(a).bfloat16().float().numpy()),
    ],
)
def test_float_exports_store_rounded_matrices(tmp_path: Path, dtype: str, ggml: str, file_type: int, cast) -> None:
    cfg = tiny_cfg(d_model=64, d_ff=96, tie_embeddings=False)
    model = Llama(cfg)
    init_weights(model, 0.1, 3)
    path = export_llama(model, tmp_path / "m.gguf", {}, {"general.name": "t"}, dtype)
    g = GGUFFile(path)
    assert g.metadata["general.file_type"] == file_type
    assert count_tensors(path) == len(g.tensor_names()) == len(gguf_tensors(model))
    for name, orig in gguf_tensors(model).items():
        assert g.tensor_info(name).ggml_type == (ggml if orig.ndim == 2 else "F32"), name
        np.testing.assert_array_equal(g.tensor(name), cast(orig) if orig.ndim == 2 else orig, err_msg=name)


def test_q8_0_export_falls_back_to_f16_for_short_rows(tmp_path: Path) -> None:
    cfg = tiny_cfg(d_model=64, d_ff=80)  # ffn_down rows are 80 long: not whole Q8_0 blocks of 32
    model = Llama(cfg)
    init_weights(model, 0.1, 4)
    g = GGUFFile(export_llama(model, tmp_path / "m.gguf", {}, {}, "q8_0"))
    assert g.metadata["general.file_type"] == 7
    for name, orig in gguf_tensors(model).items():
        want = "F32" if orig.ndim == 1 else "F16" if orig.shape[1] % 32 else "Q8_0"
        assert g.tensor_info(name).ggml_type == want, name
        np.testing.assert_allclose(g.tensor(name), orig, atol=np.abs(orig).max() / 100, err_msg=name)
    assert g.tensor_info("blk.0.ffn_down.weight").ggml_type == "F16"
    back, _ = load_llama(g)
    ids = torch.arange(20)[None]
    with torch.no_grad():
        want = model(ids)
        assert float((back(ids) - want).norm() / want.norm()) < 0.05  # Q8_0 is ~0.5% per weight


# ---------------------------------------------------------------- bad input


def patch(data: bytes, pos: int, fmt: str, value: int) -> bytes:
    raw = bytearray(data)
    struct.pack_into(fmt, raw, pos, value)
    return bytes(raw)


def tensor_info_pos(data: bytes, name: str) -> tuple[int, int]:
    """(position of the first dim, n_dims) of tensor `name`'s info record in the header."""
    key = struct.pack("<Q", len(name)) + name.encode()
    at = data.index(key) + len(key)
    return at + 4, struct.unpack_from("<I", data, at)[0]


@pytest.fixture()
def good(tmp_path: Path) -> bytes:
    cfg = tiny_cfg(d_model=64, d_ff=128)
    return write_llama(tmp_path / "good.gguf", cfg, tiny_tensors(cfg)).read_bytes()


def fails(tmp_path: Path, data: bytes, *fragments: str, loader=load_llama) -> str:
    p = tmp_path / "bad.gguf"
    p.write_bytes(data)
    with pytest.raises(GGUFError) as e:
        loader(p)
    msg = str(e.value)
    assert "\n" not in msg and "bad.gguf" in msg, msg
    for f in fragments:
        assert f in msg, (f, msg)
    return msg


def test_truncated(tmp_path: Path, good: bytes) -> None:
    header_end = good.index(b"output_norm.weight") + 100
    for cut in (6, 30, header_end // 2, header_end + 40, len(good) // 2, len(good) - 1):
        fails(tmp_path, good[:cut], "truncated")


def test_bad_magic(tmp_path: Path, good: bytes) -> None:
    fails(tmp_path, b"GGML" + good[4:], "magic")
    fails(tmp_path, b"", "magic")


def test_tensor_bytes_do_not_match_shape_and_type(tmp_path: Path, good: bytes) -> None:
    first = "token_embd.weight"
    dims_at, n_dims = tensor_info_pos(good, first)
    type_at = dims_at + 8 * n_dims
    assert struct.unpack_from("<I", good, type_at)[0] == Q.F32
    fails(tmp_path, patch(good, type_at, "<I", Q.F16), first, "does not match", "F16")
    fails(tmp_path, patch(good, dims_at + 8, "<Q", 65), first, "does not match")  # one row more than stored
    fails(tmp_path, patch(good, type_at, "<I", 999), first, "type id 999")
    fails(tmp_path, patch(good, type_at, "<I", Q.Q8_0), first, "does not match", "Q8_0")
    fails(tmp_path, patch(good, type_at, "<I", Q.Q4_K), first, "block size 256")  # rows of 64 are not whole blocks


def test_declared_sizes_beyond_the_file_fail_fast_without_allocating(tmp_path: Path, good: bytes) -> None:
    name = "output_norm.weight"
    dims_at, _ = tensor_info_pos(good, name)
    forged = patch(good, dims_at, "<Q", 2**40)  # a 4 TiB F32 vector in a file of a few hundred kB
    start = time.perf_counter()
    msg = fails(tmp_path, forged, name)
    assert time.perf_counter() - start < 2.0
    assert "declares more data than the file holds" in msg or "does not match" in msg
    # every tensor huge, the last one included
    for t in ("token_embd.weight", "blk.0.attn_q.weight"):
        forged = patch(forged, tensor_info_pos(forged, t)[0] + 8, "<Q", 2**40)
    fails(tmp_path, forged, "bad.gguf")


def test_unsupported_architecture_names_it_and_the_supported_ones(tmp_path: Path) -> None:
    cfg = tiny_cfg(d_model=64, d_ff=128)
    p = write_llama(tmp_path / "m.gguf", cfg, tiny_tensors(cfg), arch="mamba")
    for loader in (load_gguf, load_llama):
        with pytest.raises(GGUFError) as e:
            loader(p)
        msg = str(e.value)
        assert "'mamba'" in msg and all(a in msg for a in SUPPORTED), msg


def test_missing_required_key(tmp_path: Path) -> None:
    cfg = tiny_cfg(d_model=64, d_ff=128)
    data = write_llama(tmp_path / "m.gguf", cfg, tiny_tensors(cfg), drop=("llama.block_count",)).read_bytes()
    fails(tmp_path, data, "llama.block_count", "missing")


def test_vocab_size_disagrees_with_embedding_rows(tmp_path: Path) -> None:
    cfg = tiny_cfg(d_model=64, d_ff=128)
    tensors = tiny_tensors(cfg)
    data = write_llama(tmp_path / "a.gguf", cfg, tensors, meta={"llama.vocab_size": 100}).read_bytes()
    fails(tmp_path, data, "llama.vocab_size", "64 (the rows of token_embd.weight)", "found 100")
    tokens = {"tokenizer.ggml.tokens": [f"t{i}" for i in range(63)]}
    data = write_llama(tmp_path / "b.gguf", cfg, tensors, meta=tokens).read_bytes()
    fails(tmp_path, data, "len(tokenizer.ggml.tokens)", "found 63")


# ---------------------------------------------------------------- the real SmolLM2


@pytest.fixture(scope="module")
def reference() -> dict:
    return json.loads(FIXTURE.read_text())["texts"]


@pytest.fixture(scope="module")
def ours(smollm2: GGUFFile) -> Llama:
    return load_llama(smollm2)[0].eval()


@torch.no_grad()
def logprobs(model, ids: list[int]) -> torch.Tensor:
    """(T, vocab) log-softmax over the full vocab, fp32."""
    out = model(torch.tensor([ids]))
    logits = out if isinstance(out, torch.Tensor) else out.logits
    return logits[0].float().log_softmax(-1)


def nll(lp: torch.Tensor, ids: list[int]) -> float:
    """Mean NLL of ids[1:] given the prefix."""
    return float(-lp[:-1].gather(1, torch.tensor(ids[1:])[:, None]).mean())


@pytest.fixture(scope="module")
def our_logprobs(ours: Llama, reference: dict) -> dict[str, torch.Tensor]:
    return {name: logprobs(ours, t["tokens"]) for name, t in reference.items()}


def hf_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's convert_hf_to_gguf Q/K row permutation (halves -> adjacent pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_logits_equal_transformers_on_the_same_gguf(
    smollm2_path: Path, ours: Llama, our_logprobs: dict, reference: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Our fp32 module equals transformers' fp32 model on the SmolLM2 GGUF: which proves our Q/K layout
    (no permutation, RoPE on adjacent pairs) is the GGUF's, since transformers un-permutes Q/K."""
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_path.parent, gguf_file=smollm2_path.name, dtype=torch.float32
    ).eval()
    worst = {name: float((logprobs(hf, t["tokens"]) - our_logprobs[name]).abs().max()) for name, t in reference.items()}
    print("max |d log-prob| vs transformers:", {k: f"{v:.1e}" for k, v in worst.items()})
    assert max(worst.values()) <= 1e-3, worst
    # control: permuting layer 0's Q/K as if our layout were Hugging Face's breaks the agreement
    attn, ids = ours.blocks[0].attn, reference["plain"]["tokens"]
    wq, wk = attn.wq.weight.data, attn.wk.weight.data
    try:
        attn.wq.weight.data = hf_permute(wq, ours.cfg.n_head)
        attn.wk.weight.data = hf_permute(wk, ours.cfg.n_kv_head)
        assert float((logprobs(ours, ids) - our_logprobs["plain"]).abs().max()) > 0.1
    finally:
        attn.wq.weight.data, attn.wk.weight.data = wq, wk


def test_agrees_with_llamacpp_reference(our_logprobs: dict, reference: dict) -> None:
    hits = total = 0
    for name, t in reference.items():
        lp, ref = our_logprobs[name], t["llamacpp"]
        delta = nll(lp, t["tokens"]) - ref["next_token_nll_mean"]
        top1 = lp.argmax(-1).tolist()
        agree = sum(a == r[0] for a, r in zip(top1, ref["top10_ids"]))
        hits, total = hits + agree, total + len(top1)
        print(f"{name}: NLL delta {delta:+.4f}, top-1 {agree}/{len(top1)}")
        assert abs(delta) <= 0.1, (name, delta)
    assert hits / total >= 0.85, hits / total


def test_q8_0_export_stays_close(
    ours: Llama, smollm2: GGUFFile, reference: dict, our_logprobs, tmp_path_factory
) -> None:
    path = export_llama(ours, tmp_path_factory.mktemp("q8") / "m.gguf", donor_tokenizer_metadata(smollm2), {}, "q8_0")
    q8, g = load_llama(path)
    assert {g.tensor_info(n).ggml_type for n in g.tensor_names()} == {"Q8_0", "F32"}
    assert path.stat().st_size < 0.3 * 4 * sum(p.numel() for p in ours.parameters())
    for name, t in reference.items():
        delta = nll(logprobs(q8.eval(), t["tokens"]), t["tokens"]) - nll(our_logprobs[name], t["tokens"])
        print(f"q8_0 {name}: NLL delta {delta:+.4f}")
        assert abs(delta) <= 0.05, (name, delta)


def test_f32_round_trip_is_bit_exact(ours: Llama, smollm2: GGUFFile, tmp_path_factory) -> None:
    tok = donor_tokenizer_metadata(smollm2)
    path = export_llama(ours, tmp_path_factory.mktemp("f32") / "m.gguf", tok, {"general.name": "rt"}, "f32")
    back = GGUFFile(path)
    assert config_from_gguf(back) == config_from_gguf(smollm2)
    assert sorted(back.tensor_names()) == sorted(smollm2.tensor_names())
    for name in smollm2.tensor_names():
        assert back.tensor_info(name).ggml_type == "F32"
        np.testing.assert_array_equal(back.tensor(name), smollm2.tensor(name), err_msg=name)
    keys = sorted(k for k in smollm2.metadata if k.startswith("tokenizer."))
    assert keys and keys == sorted(k for k in back.metadata if k.startswith("tokenizer."))
    for key in keys:
        assert back.typed_field(key) == smollm2.typed_field(key), key
