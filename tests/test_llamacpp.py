"""llama.cpp (through llama-cpp-python) as the reference client: it runs our exports, tokenizes and
continues text as we do, and its own quantizer and dequantizer agree with our reader bit for bit."""

from __future__ import annotations

import ctypes
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from pipeline.gguf.reader import GGUFFile
from pipeline.inference.sampling import generate_ids
from pipeline.models.llama import Llama
from pipeline.models.llama_gguf import export_llama, gguf_tensors, llama_metadata, load_llama
from pipeline.models.transformer import TransformerConfig, init_weights
from pipeline.tokenizer.gguf_tokenizer import tokenizer_from_gguf
from pipeline.tokenizer.pretokenizers import donor_tokenizer_metadata

llama_cpp = pytest.importorskip("llama_cpp")

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "smollm2_reference.json"
PROMPTS = [
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nWrite a Python function that adds two numbers.<|im_end|>\n<|im_start|>assistant\n",
]


def open_llama(path: Path, n_ctx: int = 256):
    """One thread: on a busy 2-core machine ggml's spinning worker threads make decode ~20x slower."""
    return llama_cpp.Llama(
        model_path=str(path), logits_all=False, verbose=False, n_ctx=n_ctx, n_threads=1, n_threads_batch=1
    )


def last_logprobs(llm, ids: list[int]) -> torch.Tensor:
    """llama.cpp's log-softmax at the last position of `ids` (logits_all=False keeps only that row)."""
    llm.reset()
    llm.eval(ids)
    logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))
    return torch.from_numpy(logits.copy()).log_softmax(-1)


@pytest.fixture(scope="module")
def smollm2_export(smollm2: GGUFFile, tmp_path_factory) -> tuple[Llama, Path]:
    """SmolLM2 read by us and written back as an f32 GGUF (f32 so both sides use the same weights)."""
    model = load_llama(smollm2)[0].eval()
    out = tmp_path_factory.mktemp("llamacpp") / "smollm2-f32.gguf"
    return model, export_llama(model, out, donor_tokenizer_metadata(smollm2), {"general.name": "re-export"}, "f32")


@pytest.fixture(scope="module")
def llm(smollm2_export):
    return open_llama(smollm2_export[1])


def test_llamacpp_tokenizes_our_export_like_us(llm, smollm2: GGUFFile) -> None:
    texts = [t["text"] for t in json.loads(FIXTURE.read_text())["texts"].values()]
    texts += PROMPTS + ["Hello world", "x = [1, 2, 3]  # 日本語\n\n\tdone", "<|im_end|><|endoftext|>"]
    ours = tokenizer_from_gguf(smollm2)
    for text in texts:
        assert llm.tokenize(text.encode(), add_bos=False, special=True) == ours.encode(text), text


def test_llamacpp_continues_our_export_like_us(llm, smollm2_export, smollm2: GGUFFile) -> None:
    model, _ = smollm2_export
    tok = tokenizer_from_gguf(smollm2)
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        theirs = []
        for t in llm.generate(ids, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
            theirs.append(t)
            if len(theirs) == 16:
                break
        ours = generate_ids(model, ids, 16, temperature=0.0)
        print(f"greedy {tok.decode(ours)!r}: {sum(a == b for a, b in zip(ours, theirs))}/16 tokens agree")
        assert ours == theirs, (tok.decode(ours), tok.decode(theirs))
        with torch.no_grad():
            lp = model(torch.tensor([ids]))[0, -1].log_softmax(-1)
        delta = float((lp - last_logprobs(llm, ids)).abs().max())
        print(f"max |d log-prob| at the prompt end vs llama.cpp: {delta:.1e}")
        assert delta < 0.05  # llama.cpp keeps K/V in f16


def test_llamacpp_k_quantized_file_reads_like_llamacpp(smollm2: GGUFFile, tmp_path: Path) -> None:
    """A model quantized by llama.cpp's own tool (Q4_K_M: Q4_K + Q6_K) loads into our module and
    predicts what llama.cpp predicts from that file, far closer than either is to the f32 original."""
    cfg = TransformerConfig(
        vocab_size=49152, d_model=256, n_layer=2, n_head=4, n_kv_head=2, d_ff=512, context_length=128
    )
    model = Llama(cfg)
    init_weights(model, 0.1, 0)
    f32 = export_llama(model, tmp_path / "f32.gguf", donor_tokenizer_metadata(smollm2), {}, "f32")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M, 1
    q4k = tmp_path / "q4_k_m.gguf"
    assert llama_cpp.llama_model_quantize(str(f32).encode(), str(q4k).encode(), ctypes.byref(params)) == 0
    ours, g = load_llama(q4k)
    assert {"Q4_K", "Q6_K"} <= {g.tensor_info(n).ggml_type for n in g.tensor_names()}
    ids = list(range(1000, 1024))
    with torch.no_grad():
        lp_ours = ours(torch.tensor([ids]))[0, -1].log_softmax(-1)
        lp_f32 = model(torch.tensor([ids]))[0, -1].log_softmax(-1)
    lp_cpp = last_logprobs(open_llama(q4k, 64), ids)

    def rms(a, b):
        return float((a - b).pow(2).mean().sqrt())

    print(
        f"Q4_K_M log-prob RMS: ours vs llama.cpp {rms(lp_ours, lp_cpp):.3f}, llama.cpp vs f32 {rms(lp_cpp, lp_f32):.3f}"
    )
    assert rms(lp_ours, lp_cpp) < 0.25 * rms(lp_cpp, lp_f32)


# ---------------------------------------------------------------- ggml's own (de)quantizers


class _Traits(ctypes.Structure):
    """struct ggml_type_traits (ggml.h)."""

    _fields_ = [
        ("type_name", ctypes.c_char_p),
        ("blck_size", ctypes.c_int64),
        ("blck_size_interleave", ctypes.c_int64),
        ("type_size", ctypes.c_size_t),
        ("is_quantized", ctypes.c_bool),
        ("to_float", ctypes.c_void_p),
        ("from_float_ref", ctypes.c_void_p),
    ]


_TO_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)


@pytest.fixture(scope="module")
def ggml():
    """libggml-base from the llama-cpp-python wheel, with the prototypes this file uses."""
    lib = pytest.importorskip("llama_cpp._ggml").libggml
    lib.ggml_get_type_traits.restype = ctypes.POINTER(_Traits)
    lib.ggml_get_type_traits.argtypes = [ctypes.c_int]
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 3 + [ctypes.c_void_p]
    lib.ggml_quantize_requires_imatrix.restype = ctypes.c_bool
    lib.ggml_quantize_requires_imatrix.argtypes = [ctypes.c_int]
    return lib


def ggml_quantize(lib, arr: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """`arr` (rows, n) quantized by llama.cpp's ggml_quantize_chunk, as (rows, bytes per row) uint8."""
    traits = lib.ggml_get_type_traits(int(qtype)).contents
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    assert (traits.blck_size, traits.type_size) == (block, type_size), "ggml and gguf-py disagree on the block"
    rows, n = arr.shape
    src = np.ascontiguousarray(arr, dtype=np.float32)
    dst = np.zeros((rows, n // block * type_size), dtype=np.uint8)
    imatrix = np.ones(n, dtype=np.float32) if lib.ggml_quantize_requires_imatrix(int(qtype)) else None
    written = lib.ggml_quantize_chunk(
        int(qtype), src.ctypes.data, dst.ctypes.data, 0, rows, n, None if imatrix is None else imatrix.ctypes.data
    )
    assert written == dst.nbytes
    return dst


def ggml_dequantize(lib, raw: np.ndarray, qtype: gguf.GGMLQuantizationType, shape: tuple[int, int]) -> np.ndarray:
    out = np.zeros(shape, dtype=np.float32)
    raw = np.ascontiguousarray(raw)
    _TO_FLOAT(lib.ggml_get_type_traits(int(qtype)).contents.to_float)(raw.ctypes.data, out.ctypes.data, out.size)
    return out


GGML_TYPES = "F16 BF16 Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q3_K Q4_K Q5_K Q6_K IQ1_S IQ1_M IQ2_XXS IQ2_XS IQ2_S"
GGML_TYPES += " IQ3_XXS IQ3_S IQ4_NL IQ4_XS TQ1_0 TQ2_0 MXFP4"
# ggml's quantizer for these builds search grids first (~20 s for IQ1_S on a busy 2-core machine):
# they get random blocks instead (every bit pattern is a valid block once the leading f16 scale `d` is finite)
RANDOM_BLOCKS = ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S")


def random_blocks(rows: int, n: int, qtype: gguf.GGMLQuantizationType, seed: int = 0) -> np.ndarray:
    """(rows, bytes per row) of random blocks whose f16 scale `d` is a small finite number."""
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows * n // block, type_size), dtype=np.uint8)
    d = rng.uniform(1e-3, 1e-2, size=len(raw)).astype(np.float16)
    if qtype.name == "IQ1_M":  # d is the top nibbles of the four u16 scale words that end the block
        words = raw[:, -8:].copy().view(np.uint16)
        for k in range(4):
            words[:, k] = (words[:, k] & 0x0FFF) | (((d.view(np.uint16) >> (4 * k)) & 0xF) << 12)
        raw[:, -8:] = words.view(np.uint8)
    else:  # d is the block's first field
        raw[:, :2] = d.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("name", GGML_TYPES.split())
def test_every_type_dequantizes_as_ggml_does(ggml, tmp_path: Path, name: str) -> None:
    """A whole model stored in each type llama.cpp can write: every tensor we load is bit-equal to
    ggml's own dequantization (K-quants and i-quants included, which gguf-py cannot quantize).
    Types that are slow to quantize get random blocks in one matrix and Q8_0 elsewhere: a mixed
    file, as llama.cpp's quantizer writes them."""
    qtype = gguf.GGMLQuantizationType[name]
    probe = "blk.0.attn_k.weight"
    cfg = TransformerConfig(
        vocab_size=64, d_model=256, n_layer=1, n_head=4, n_kv_head=2, d_ff=512, context_length=64, tie_embeddings=False
    )
    model = Llama(cfg)
    init_weights(model, 0.1, 1)
    w = gguf.GGUFWriter(tmp_path / "m.gguf", "llama")
    for key, value in llama_metadata(cfg, "f32").items():
        w.add_float32(key, value) if isinstance(value, float) else w.add_uint32(key, value)
    expected = {}
    for tname, arr in gguf_tensors(model).items():
        if arr.ndim == 1:
            w.add_tensor(tname, arr)
            expected[tname] = arr
            continue
        t = qtype if name not in RANDOM_BLOCKS or tname == probe else gguf.GGMLQuantizationType.Q8_0
        raw = random_blocks(*arr.shape, t) if t.name in RANDOM_BLOCKS else ggml_quantize(ggml, arr, t)
        w.add_tensor(tname, raw, raw_dtype=t)
        expected[tname] = ggml_dequantize(ggml, raw, t, arr.shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    loaded, g = load_llama(tmp_path / "m.gguf")
    assert g.tensor_info(probe).ggml_type == name
    assert np.isfinite(expected[probe]).all() and expected[probe].std() > 0
    for tname, arr in gguf_tensors(loaded).items():
        np.testing.assert_array_equal(arr, expected[tname], err_msg=tname)


def test_llamacpp_applies_our_rope_freq_factors(smollm2: GGUFFile, tmp_path: Path) -> None:
    """A model with llama3-style rope_freqs: llama.cpp's log-probs equal ours, and differ from plain RoPE."""
    from pipeline.models.llama_gguf import export_llama
    from pipeline.models.transformer import TransformerConfig, init_weights
    from pipeline.tokenizer.pretokenizers import donor_tokenizer_metadata

    base = dict(vocab_size=49152, d_model=64, n_layer=2, n_head=4, n_kv_head=2, d_ff=128, context_length=256)
    factors = tuple(float(f) for f in np.geomspace(1.0, 32.0, 8))
    ids = list(range(1000, 1040))
    results = {}
    for name, cfg in (
        ("plain", TransformerConfig(**base)),
        ("scaled", TransformerConfig(**base, rope_freq_factors=factors)),
    ):
        model = Llama(cfg)
        init_weights(model, 0.2, seed=3)
        path = export_llama(model, tmp_path / f"{name}.gguf", donor_tokenizer_metadata(smollm2), {}, "f32")
        with torch.no_grad():
            ours = torch.log_softmax(model(torch.tensor([ids]))[0, -1].double(), -1)
        theirs = last_logprobs(open_llama(path), ids).double()
        results[name] = (ours, theirs)
        assert (ours - theirs).abs().max().item() < 2e-2, name
    assert (results["plain"][0] - results["scaled"][0]).abs().max().item() > 0.1


def test_an_export_of_a_donor_spelling_gpt2_without_the_dash_loads_in_llamacpp(tmp_path: Path) -> None:
    """We read `tokenizer.ggml.pre = gpt2` as llama.cpp's `gpt-2`; copied verbatim into the export, it made
    llama.cpp refuse the file ("unknown pre-tokenizer type"), after training, at evaluate."""
    from tests.conftest import write_tiny_gguf

    donor = GGUFFile(write_tiny_gguf(tmp_path / "donor.gguf", vocab=64, width=32, model=True))
    assert donor.metadata["tokenizer.ggml.pre"] == "gpt2"
    model = load_llama(donor)[0].eval()
    path = export_llama(model, tmp_path / "export.gguf", donor_tokenizer_metadata(donor), {}, "f32")
    assert GGUFFile(path).metadata["tokenizer.ggml.pre"] == "gpt-2"
    text = " the rain in spain, on the plain!"
    ours = tokenizer_from_gguf(GGUFFile(path)).encode(text)
    assert open_llama(path, 32).tokenize(text.encode(), add_bos=False, special=True) == ours
