"""The optimizer, its schedule, and the training loop's settings."""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.config.checks import at_least, check, choice, integer, positive

PRECISIONS = ("auto", "bf16", "fp32")  # auto: bf16 where the device has bf16 instructions, else fp32
DEVICES = ("auto", "cpu", "cuda", "mps")
OPTIMIZERS = ("adamw", "lbfgs")
PARALLEL = ("ddp", "fsdp")
SWITCHES = ("auto", "true", "false")  # train.compile, train.cuda_graph: auto = on where CUDA is
DISTILL_MODES = ("cached", "online")
# train.qat: the export types whose blocks training can see (pipeline.training.qat)
QAT_TYPES = ("", "q8_0", "q4_0", "q6_k", "q5_k_m", "q4_k_m")
DISTILL_SOURCES = (
    "corpus",
    "donor",
)  # what text cached distillation reads: the train split, or the donor's continuations


@dataclass
class OptimConfig:
    """The optimizer (AdamW, or L-BFGS as llama.cpp's trainer had) and its learning-rate schedule
    (linear warmup, cosine decay to a floor)."""

    name: str = "adamw"  # adamw | lbfgs
    lr: float = 1e-3  # 0: the donor's cut's, once the corpus is packed (pipeline.config.student)
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    warmup_steps: int = 30
    min_lr_ratio: float = 0.1  # floor of the cosine, as a fraction of lr
    table_lr_scale: float = 1.0  # the token table's (and an untied head's) rate, as a fraction of lr; 0 freezes it
    cycle_steps: int = 0  # >0: cosine restarts every cycle_steps after warmup
    grad_clip: float = 1.0  # 0 disables clipping
    lbfgs_history: int = 10  # L-BFGS: curvature pairs kept
    lbfgs_max_iter: int = 1  # L-BFGS: iterations (on the same batch) per training step

    def __post_init__(self) -> None:
        choice(self.name, "optim.name", OPTIMIZERS)
        at_least(self.lr, "optim.lr", 0, "use e.g. 0.001, or 0 for the donor's cut's (donor.student)")
        for key in ("lbfgs_history", "lbfgs_max_iter", "eps"):
            positive(getattr(self, key), f"optim.{key}")
        check(0 <= self.beta1 < 1, "optim.beta1", "a value in [0, 1)", self.beta1, "use e.g. 0.9")
        check(0 <= self.beta2 < 1, "optim.beta2", "a value in [0, 1)", self.beta2, "use e.g. 0.95")
        at_least(self.weight_decay, "optim.weight_decay", 0, "use e.g. 0.1")
        at_least(self.warmup_steps, "optim.warmup_steps", 0, "use e.g. 30")
        check(0 <= self.min_lr_ratio <= 1, "optim.min_lr_ratio", "a value in [0, 1]", self.min_lr_ratio, "use 0.1")
        at_least(self.cycle_steps, "optim.cycle_steps", 0, "use 0 for no restarts")
        at_least(self.table_lr_scale, "optim.table_lr_scale", 0, "use 1, below 1 to slow it, 0 to freeze")
        at_least(self.grad_clip, "optim.grad_clip", 0, "use 0 to disable")


@dataclass
class DistillConfig:
    """Distillation from the donor: the loss is (1-weight)*CE(data) + weight*T^2*KL(teacher_T || student_T)
    over the teacher's top-k tokens plus one bucket for the rest (`pipeline.models.ops.losses`).

    `cached`: the teach stage stores the donor's top-k per train position once (`data/teach`), and
    batches gather them; `online`: the donor runs on every batch (for corpora too big to cache).
    """

    weight: float = 0.0  # 0 = off (the teach stage then only records that it is off)
    temperature: float = 1.0
    top_k: int = 32  # at most the vocab; in cached mode at most the k the cache was made with
    mode: str = "cached"  # cached | online
    context: int = 512  # cached mode: the donor's window; every cached position sees >= train.seq_len tokens
    cache_tokens: int = 262144  # cached mode: at most this many train positions (evenly spread spans); 0 = all
    span: int = 8192  # cached mode: tokens per cached span (under a budget, more spans reach more of the corpus)
    source: str = "corpus"  # cached mode: the text the donor is cached over: corpus | donor (its own continuations)
    prompt_tokens: int = 32  # source=donor: train tokens each continuation starts from
    share: float = 0.0  # cached spans: the share of micro-batches that distil (0 = the cache's share of what is read)

    def __post_init__(self) -> None:
        check(0 <= self.weight <= 1, "train.distill.weight", "a value in [0, 1]", self.weight, "use 0 (off) to 1")
        positive(self.temperature, "train.distill.temperature")
        integer(self.top_k, "train.distill.top_k", 1, "use e.g. 32 (at most the vocab size)")
        choice(self.mode, "train.distill.mode", DISTILL_MODES)
        integer(self.context, "train.distill.context", 2, "use e.g. 512 (more than train.seq_len)")
        integer(self.cache_tokens, "train.distill.cache_tokens", 0, "use 0 (the whole train split) or e.g. 262144")
        integer(self.span, "train.distill.span", 2, "use e.g. 8192 (tokens per cached span)")
        choice(self.source, "train.distill.source", DISTILL_SOURCES)
        integer(self.prompt_tokens, "train.distill.prompt_tokens", 1, "use e.g. 32 (fewer than train.seq_len)")
        check(0 <= self.share <= 1, "train.distill.share", "a value in [0, 1]", self.share, "use 0 (auto) to 1")

    @property
    def enabled(self) -> bool:
        return self.weight > 0


VOCABS = ("auto", "full", "corpus")


@dataclass
class TrainConfig:
    """The training loop: steps, batch shape, precision, validation cadence."""

    steps: int = 300  # 0 (and eval_every 0): the donor's cut's (pipeline.config.student)
    batch_size: int = 8
    seq_len: int = 128  # text windows; instruct rows are data.max_seq_len long
    grad_accum: int = 1
    precision: str = "auto"  # auto | bf16 autocast | fp32 (`models.devices.resolve_precision`)
    eval_every: int = 100
    log_every: int = 10
    max_epochs: float = 4.0  # warn when the steps pass over the train split more often than this (0: never)
    epochs: float = 0.0  # > 0: size the run in passes over the train split (sets the step count); 0: use steps
    keep_best: bool = True  # the weights written (and exported) are those of the lowest val loss, not the last
    early_stop_patience: int = 0  # > 0: stop after this many evaluations without a new best val loss
    device: str = "auto"
    threads: int = 0  # 0: torch's default
    compile: str = "auto"  # auto (on CUDA) | true | false: torch.compile the model (`training.runtime.compile_model`)
    activation_checkpointing: bool = False  # recompute block activations in backward (less memory)
    cuda_graph: str = (
        "auto"  # auto | true | false: on CUDA, token windows, each step one CUDA graph (`training.graphed`)
    )
    fused_kernels: bool = True  # on CUDA with Triton: RMSNorm, RoPE, SwiGLU as Triton kernels (`models.ops.fused`)
    checkpoint_every: int = 100  # also always at the end; 0: only at the end
    keep_checkpoints: int = 2  # newest K checkpoints kept per config
    checkpoint_dir: str = "checkpoints"  # relative to the project root; outside DVC's outs so a crash keeps it
    resume: str = "auto"  # auto (newest valid compatible checkpoint) | never | path to a checkpoint dir
    skip_nonfinite: bool = False  # true: skip a step with a non-finite loss/gradient instead of stopping
    parallel: str = "ddp"  # under torchrun: ddp (replicated) | fsdp (sharded parameters)
    qat: str = ""  # quantization-aware training to the export's type: "" (off) | q8_0 | q4_0 | q6_k | q5_k_m | q4_k_m
    qat_start: float = 0.5  # train.qat: from this fraction of the steps on
    qat_imatrix: int = (
        0  # train.qat: tokens of the train split for the importance matrix QAT and the export share; 0 = none
    )
    vocab: str = "auto"  # softmax rows: full | corpus (ids the data and teacher use) | auto (corpus above 65,536)
    vocab_negatives: int = 8192  # train.vocab=corpus: other ids sampled per step, standing for the rest
    distill: DistillConfig = field(default_factory=DistillConfig)

    def __post_init__(self) -> None:
        choice(self.vocab, "train.vocab", VOCABS)
        at_least(self.vocab_negatives, "train.vocab_negatives", 0, "use e.g. 8192")
        for key in ("steps", "eval_every"):  # 0: the donor's cut's (donor.student)
            at_least(getattr(self, key), f"train.{key}", 0, "use e.g. 100, or 0 for the donor's cut's")
        for key in ("batch_size", "seq_len", "log_every", "keep_checkpoints"):
            positive(getattr(self, key), f"train.{key}")
        check(self.grad_accum >= 1, "train.grad_accum", "an integer >= 1", self.grad_accum, "use 1 for none")
        choice(self.precision, "train.precision", PRECISIONS)
        choice(self.device, "train.device", DEVICES)
        at_least(self.threads, "train.threads", 0, "use 0 for torch's default")
        at_least(self.max_epochs, "train.max_epochs", 0, "use 4, or 0 to never warn")
        at_least(self.epochs, "train.epochs", 0, "use 0 to size the run by train.steps")
        at_least(self.early_stop_patience, "train.early_stop_patience", 0, "use 0 to never stop early")
        at_least(self.checkpoint_every, "train.checkpoint_every", 0, "use 0 to checkpoint only at the end")
        check(bool(self.checkpoint_dir), "train.checkpoint_dir", "a directory", self.checkpoint_dir, "use checkpoints")
        check(bool(self.resume), "train.resume", "auto, never or a checkpoint directory", self.resume, "use auto")
        choice(self.parallel, "train.parallel", PARALLEL)
        for key in ("compile", "cuda_graph"):  # a bool given on the command line arrives as "True" / "False"
            setattr(self, key, str(getattr(self, key)).lower())
            choice(getattr(self, key), f"train.{key}", SWITCHES)
        check(
            self.qat in QAT_TYPES,
            "train.qat",
            "'' (off), q8_0, q4_0, q6_k, q5_k_m or q4_k_m",
            self.qat,
            "use one of them (= export.dtype)",
        )
        check(0 <= self.qat_start < 1, "train.qat_start", "a fraction in [0, 1)", self.qat_start, "use e.g. 0.5")
        check(
            self.qat_imatrix >= 0, "train.qat_imatrix", ">= 0 tokens", self.qat_imatrix, "use 0 for none, or e.g. 65536"
        )

    def check_distill_context(self) -> None:
        """Cached distillation's windows advance by context - seq_len, so the context must exceed seq_len.
        Not in __post_init__: the composed config first bounds seq_len by model.context_length (the real
        limit when seq_len is too large), then calls this; the teach stage and the loop call it too."""
        d = self.distill
        if d.enabled and d.mode == "cached" and d.source == "donor":
            check(
                d.prompt_tokens < self.seq_len,
                "train.distill.prompt_tokens",
                f"fewer than train.seq_len={self.seq_len} (each continuation is one window of train.seq_len + 1)",
                d.prompt_tokens,
                f"set train.distill.prompt_tokens to e.g. {self.seq_len // 4}",
            )
        elif d.enabled and d.mode == "cached":
            check(
                d.context > self.seq_len,
                "train.distill.context",
                f"more than train.seq_len={self.seq_len} (each cached position sees train.seq_len tokens before it)",
                d.context,
                f"set train.distill.context to e.g. {4 * self.seq_len}",
            )
