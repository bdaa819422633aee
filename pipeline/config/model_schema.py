"""The model's hyper-parameters and the recipe: how it is realized and what trains."""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.config.checks import check, choice, integer, positive
from pipeline.errors import ConfigError, problem
from pipeline.models.names import ARCHITECTURES, LLAMA_FAMILY, LORA_TARGETS

MODEL_ARCHS = ("donor", *ARCHITECTURES)  # donor: the donor GGUF's own architecture and rules
INITS = ("scratch", "pca", "lens", "subclone", "base")  # base: the GGUF at donor.path itself (fine-tuning)
LAYER_RULES = ("circuit", "importance", "even", "first", "first_last")  # which donor layers a subclone keeps
TRAINABLE = ("all", "lora")
FINETUNE_MODES = ("lora", "qlora", "full")  # how a fine-tune loads its base: see RecipeConfig.mode


def explicit_layers(value: str) -> tuple[int, ...] | None:
    """`recipe.subclone.layers` as donor layer indexes ('0,1,8,29': ascending, no repeats), else None."""
    parts = value.replace(" ", "").split(",")
    if not all(p.isdigit() for p in parts):
        return None
    layers = tuple(int(p) for p in parts)
    return layers if all(a < b for a, b in zip(layers, layers[1:])) else None


@dataclass
class ModelConfig:
    """Model hyper-parameters; the realized architecture (`models.transformer.TransformerConfig`) adds the
    vocabulary (from the tokenizer) and what the recipe derives (donor width, RoPE factors).

    `arch` is `donor` (the donor GGUF's architecture and its rules: head width, RoPE base, scaling and
    factors, norm epsilon, sliding layers; `rope_theta`/`norm_eps` 0 take the donor's too), one of the
    llama family (llama, qwen2, qwen3, gemma3), gpt2 or vit; gpt2 has no grouped-query attention
    (n_kv_head = n_head) and no RoPE (rope_theta is ignored). `head_dim` 0 is d_model/n_head (the donor's
    with arch=donor). vit (image classification, `pipeline.models.vit`) reads d_model, n_layer, n_head, d_ff
    (the MLP width), norm_eps, init_std and the three keys below; the image size and channels come from the
    packed images (data.image_size, data.channels), like a vocabulary from a tokenizer.
    """

    arch: str = "llama"
    d_model: int = 192
    n_layer: int = 4  # 0: the donor's cut for the corpus (donor.student; pipeline.config.student)
    n_head: int = 6
    n_kv_head: int = 2
    d_ff: int = 512
    context_length: int = 256
    head_dim: int = 0
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    init_std: float = 0.02
    # vit only:
    patch_size: int = 4  # pixels per patch side; data.image_size must be a multiple
    n_classes: int = 10  # must equal the number of classes in the data
    dropout: float = 0.0  # after the embeddings, attention output and MLP (training only)

    def __post_init__(self) -> None:
        choice(self.arch, "model.arch", MODEL_ARCHS)
        integer(self.head_dim, "model.head_dim", 0, "set model.head_dim=0 (d_model/n_head, or the donor's)")
        integer(self.patch_size, "model.patch_size", 1, "set model.patch_size=4")
        integer(self.n_classes, "model.n_classes", 2, "set model.n_classes to the number of classes in the data")
        check(0.0 <= self.dropout < 1.0, "model.dropout", "in [0, 1)", self.dropout, "set model.dropout=0")
        integer(self.n_layer, "model.n_layer", 0, "set model.n_layer=0 (the donor's cut: donor.student) or more")
        for key in ("d_model", "n_head", "n_kv_head", "d_ff", "context_length"):
            positive(getattr(self, key), f"model.{key}")
        check(
            self.arch == "donor" or self.head_dim or self.d_model % self.n_head == 0,
            "model.n_head",
            f"a divisor of model.d_model={self.d_model}",
            self.n_head,
            "choose n_head so that d_model/n_head is a whole head size",
        )
        check(
            self.arch != "gpt2" or self.n_kv_head == self.n_head,
            "model.n_kv_head",
            f"model.n_head={self.n_head} for arch gpt2 (it has no grouped-query attention)",
            self.n_kv_head,
            f"set model.n_kv_head={self.n_head}",
        )
        check(
            self.arch == "vit" or self.n_head % self.n_kv_head == 0,  # vit has no kv groups (n_kv_head unused)
            "model.n_kv_head",
            f"a divisor of model.n_head={self.n_head}",
            self.n_kv_head,
            "choose n_kv_head so that n_head/n_kv_head is a whole group size",
        )
        head = self.head_dim or self.d_model // self.n_head
        check(
            self.arch not in LLAMA_FAMILY or head % 2 == 0,
            "model.head_dim" if self.head_dim else "model.d_model",
            "a head size (head_dim, or d_model/n_head) that is even, for RoPE",
            head,
            "change d_model, n_head or head_dim",
        )
        for key in ("rope_theta", "norm_eps", "init_std"):
            if self.arch != "donor" or key == "init_std" or getattr(self, key) != 0:  # donor: 0 = the donor's
                positive(getattr(self, key), f"model.{key}")


@dataclass
class LoraConfig:
    """LoRA adapters (`recipe.trainable=lora`): rank, alpha (scale alpha/rank), dropout, target
    layers among q, k, v, o, gate, up, down, and the seeded init: A ~ U(-1/sqrt(in), 1/sqrt(in))
    x init_scale (PEFT's kaiming-uniform), B zero, so step 0 is the base."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.05
    targets: list[str] = field(default_factory=lambda: ["q", "v"])
    init_seed: int = 0
    init_scale: float = 1.0

    def __post_init__(self) -> None:
        integer(self.rank, "recipe.lora.rank", 1, "set recipe.lora.rank=8")
        check(self.alpha > 0, "recipe.lora.alpha", "a number > 0", self.alpha, "set recipe.lora.alpha=16")
        check(0.0 <= self.dropout < 1.0, "recipe.lora.dropout", "in [0, 1)", self.dropout, "set recipe.lora.dropout=0")
        check(self.init_scale >= 0, "recipe.lora.init_scale", "a number >= 0", self.init_scale, "set 1")
        unknown = [t for t in self.targets if t not in LORA_TARGETS]
        if unknown or not self.targets or len(set(self.targets)) != len(self.targets):
            raise ConfigError(
                problem(
                    "config key recipe.lora.targets",
                    f"a non-empty list of distinct names among {list(LORA_TARGETS)}",
                    f"{list(self.targets)}" + (f" (unknown: {unknown})" if unknown else ""),
                    "use e.g. recipe.lora.targets=[q,v]",
                )
            )

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


@dataclass
class SubcloneConfig:
    """Whole-network transfer (`recipe.init=subclone`): the donor stage's calibration run and which
    donor layers realize keeps (see pipeline/init/subclone.py).

    `calib_tokens` tokens of the packed train split, in windows of `calib_seq_len`, measure the
    donor (~1000 tok/s on 2 CPU cores). A residual coordinate with more than `outlier_factor`/d of
    the energy stays an axis of its own instead of being rotated. `layers`: importance (the highest
    block influence), circuit (those, the donor's copy circuit in, `pipeline.donor.circuits`), even
    (evenly spaced), first, first_last (the first n-1 and the last), or a list of donor layers.
    Realize then refits the final-norm gain on the student's own final states (`head_fit_tokens`
    train tokens, `head_fit_iters` L-BFGS iterations; 0 tokens skips it): with fewer layers the
    student's states are not the donor's, so the closed-form gain misjudges the logits' scale.
    """

    calib_tokens: int = 16384
    calib_seq_len: int = 256
    outlier_factor: float = 20.0
    layers: str = "importance"
    head_fit_tokens: int = 1024
    head_fit_iters: int = 25

    def __post_init__(self) -> None:
        integer(self.calib_seq_len, "recipe.subclone.calib_seq_len", 2, "set recipe.subclone.calib_seq_len=256")
        integer(
            self.calib_tokens,
            "recipe.subclone.calib_tokens",
            self.calib_seq_len,
            "set recipe.subclone.calib_tokens to at least recipe.subclone.calib_seq_len, e.g. 16384",
        )
        check(
            self.outlier_factor > 1,
            "recipe.subclone.outlier_factor",
            "a number > 1 (times the mean energy share)",
            self.outlier_factor,
            "set recipe.subclone.outlier_factor=20",
        )
        check(
            self.layers in LAYER_RULES or explicit_layers(self.layers) is not None,
            "recipe.subclone.layers",
            f"one of {', '.join(LAYER_RULES)}, or ascending donor layer indexes such as '0,1,8,29'",
            self.layers,
            "set recipe.subclone.layers=importance, or quote a list: recipe.subclone.layers='0,1,8,29'",
        )
        integer(self.head_fit_tokens, "recipe.subclone.head_fit_tokens", 0, "set recipe.subclone.head_fit_tokens=1024")
        integer(self.head_fit_iters, "recipe.subclone.head_fit_iters", 1, "set recipe.subclone.head_fit_iters=25")


@dataclass
class RecipeConfig:
    """How the model is realized and what trains.

    `init`: scratch, PCA warm-start (pca), PCA lens, every weight from the donor (subclone), or
    `base`, the GGUF at donor.path itself (fine-tuning). `trainable`: all parameters, or only LoRA
    adapters on a frozen base; `quantized` (QLoRA) keeps the frozen base's matrices in their GGUF block format.
    """

    name: str = "warm-start"
    init: str = "pca"
    trainable: str = "all"  # all | lora
    quantized: bool = False
    lora: LoraConfig = field(default_factory=LoraConfig)
    subclone: SubcloneConfig = field(default_factory=SubcloneConfig)

    def __post_init__(self) -> None:
        choice(self.init, "recipe.init", INITS)
        choice(self.trainable, "recipe.trainable", TRAINABLE)
        check(
            self.trainable == "all" or self.init == "base",
            "recipe.init",
            "base (adapters train on a pretrained GGUF) with recipe.trainable=lora",
            self.init,
            "use recipe=lora or recipe=qlora, or set recipe.trainable=all",
        )
        check(
            not self.quantized or self.trainable == "lora",
            "recipe.quantized",
            "false unless recipe.trainable=lora (quantized blocks are frozen)",
            self.quantized,
            "use recipe=qlora, or set recipe.quantized=false",
        )

    @property
    def finetune(self) -> bool:
        """The model is a pretrained GGUF (donor.path), not built from `model`."""
        return self.init == "base"

    @property
    def mode(self) -> str:
        """The fine-tune mode, the one spelling every module uses: lora, qlora or full."""
        if self.trainable == "lora":
            return "qlora" if self.quantized else "lora"
        return "full"
