"""The one table of tensor names: our module paths, GGUF names, Hugging Face / PEFT names, LoRA targets.

GGUF loading and export, QLoRA's quantized blocks, LoRA target names and both adapter formats all
derive their names from here, so a layer is renamed in one place. Pure data: no torch, so the
config schemas can validate LoRA targets against it.
"""

from __future__ import annotations

from dataclasses import dataclass

LLAMA_FAMILY = ("llama", "qwen2", "qwen3", "gemma3")  # one module (`models.llama`); `FAMILIES` tells them apart
ARCHITECTURES = (*LLAMA_FAMILY, "gpt2", "vit")  # vit: image classification (pipeline.models.vit)


@dataclass(frozen=True)
class Family:
    """What an architecture of the llama family changes in llama's block, as llama.cpp's graph for it
    computes (src/models/<arch>.cpp): every other rule is llama's."""

    rope_halves: bool = False  # RoPE rotates (x_i, x_{i+d/2}) (NEOX); llama's GGUF rows rotate adjacent pairs
    qkv_bias: bool = False  # q, k and v projections with a bias (Qwen2)
    qk_norm: bool = False  # an RMSNorm over each query and key head before RoPE (Qwen3, Gemma 3)
    post_norms: bool = False  # an RMSNorm on the attention's and the FFN's output before the residual add
    gelu: bool = False  # the FFN gate is GELU (tanh approximation), not SiLU
    embed_scale: bool = False  # token vectors times sqrt(d_model) before the first block
    sliding: bool = False  # some layers attend within a window, with a RoPE base of their own


FAMILIES: dict[str, Family] = {
    "llama": Family(),
    "qwen2": Family(rope_halves=True, qkv_bias=True),
    "qwen3": Family(rope_halves=True, qk_norm=True),
    "gemma3": Family(rope_halves=True, qk_norm=True, post_norms=True, gelu=True, embed_scale=True, sliding=True),
}


@dataclass(frozen=True)
class Layer:
    """One weight of a transformer block, under every name it goes by."""

    ours: str  # module path inside `blocks.{i}` (the parameter is `<ours>.weight`)
    gguf: str  # tensor stem inside `blk.{i}` (the tensor is `<gguf>.weight`)
    hf: str = ""  # transformers module path inside `model.layers.{i}` (llama)
    lora: str = ""  # short LoRA target name; empty for weights adapters never target (norms)

    @property
    def is_norm(self) -> bool:
        return self.ours.endswith("norm")


LLAMA_LAYERS: tuple[Layer, ...] = (
    Layer("attn_norm", "attn_norm", "input_layernorm"),
    Layer("attn.wq", "attn_q", "self_attn.q_proj", "q"),
    Layer("attn.wk", "attn_k", "self_attn.k_proj", "k"),
    Layer("attn.wv", "attn_v", "self_attn.v_proj", "v"),
    Layer("attn.wo", "attn_output", "self_attn.o_proj", "o"),
    Layer("ffn_norm", "ffn_norm", "post_attention_layernorm"),
    Layer("ffn.gate", "ffn_gate", "mlp.gate_proj", "gate"),
    Layer("ffn.up", "ffn_up", "mlp.up_proj", "up"),
    Layer("ffn.down", "ffn_down", "mlp.down_proj", "down"),
)

# our parameter name inside `blocks.{i}` -> GGUF tensor name inside `blk.{i}`
LLAMA_BLOCK_TENSORS: dict[str, str] = {f"{x.ours}.weight": f"{x.gguf}.weight" for x in LLAMA_LAYERS}
# what the other members of the family add to a block, by the `Family` feature that adds it
FEATURE_TENSORS: dict[str, dict[str, str]] = {
    "qkv_bias": {f"attn.w{x}.bias": f"attn_{x}.bias" for x in "qkv"},
    "qk_norm": {"attn.q_norm.weight": "attn_q_norm.weight", "attn.k_norm.weight": "attn_k_norm.weight"},
    "post_norms": {
        "post_attn_norm.weight": "post_attention_norm.weight",
        "post_ffn_norm.weight": "post_ffw_norm.weight",
    },
}


def block_tensors(arch: str) -> dict[str, str]:
    """Our parameter name -> GGUF tensor name inside a block of `arch`, a llama-family architecture."""
    family = FAMILIES[arch]
    names = dict(LLAMA_BLOCK_TENSORS)
    for feature, extra in FEATURE_TENSORS.items():
        if getattr(family, feature):
            names.update(extra)
    return names


# LoRA target short name -> our module path inside `blocks.{i}`, in block order
LORA_TARGETS: dict[str, str] = {x.lora: x.ours for x in LLAMA_LAYERS if x.lora}
# our module path -> the layer (for adapters: GGUF stem, HF module)
LLAMA_BY_PATH: dict[str, Layer] = {x.ours: x for x in LLAMA_LAYERS}

# gpt2: our parameter name inside `blocks.{i}` -> GGUF tensor name inside `blk.{i}`
GPT2_BLOCK_TENSORS: dict[str, str] = {
    f"{ours}.{kind}": f"{theirs}.{kind}"
    for ours, theirs in (
        ("attn_norm", "attn_norm"),
        ("attn.qkv", "attn_qkv"),
        ("attn.proj", "attn_output"),
        ("ffn_norm", "ffn_norm"),
        ("ffn.up", "ffn_up"),
        ("ffn.down", "ffn_down"),
    )
    for kind in ("weight", "bias")
}

# tensors outside the blocks, our parameter name -> GGUF name: before the blocks, after them
TOKEN_EMBD = "token_embd.weight"
OUTPUT = "output.weight"  # an untied head, after everything else
ROPE_FREQS = "rope_freqs.weight"  # llama3-style per-pair RoPE divisors (llama.cpp's freq_factors)
LLAMA_INPUT_TENSORS = {"tok_embd.weight": TOKEN_EMBD}
LLAMA_OUTPUT_TENSORS = {"norm.weight": "output_norm.weight"}
GPT2_INPUT_TENSORS = {"tok_embd.weight": TOKEN_EMBD, "pos_embd.weight": "position_embd.weight"}
GPT2_OUTPUT_TENSORS = {"norm.weight": "output_norm.weight", "norm.bias": "output_norm.bias"}

# vit: the encoder blocks use gpt2's module paths and GGUF names (GPT2_BLOCK_TENSORS); around them
VIT_INPUT_TENSORS = {
    "patch_embd.proj.weight": "patch_embd.weight",
    "patch_embd.proj.bias": "patch_embd.bias",
    "cls_token": "cls_token",
    "pos_embd": "position_embd",
}
VIT_OUTPUT_TENSORS = {
    "norm.weight": "output_norm.weight",
    "norm.bias": "output_norm.bias",
    "head.weight": "output.weight",
    "head.bias": "output.bias",
}
