"""Export, evaluate and tracking settings, and `PipelineConfig`: the whole composed `params.yaml`."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from pipeline.config.checks import at_least, check, choice, positive
from pipeline.config.data_schema import DataConfig, DonorConfig
from pipeline.config.model_schema import ModelConfig, RecipeConfig
from pipeline.config.train_schema import OptimConfig, TrainConfig
from pipeline.models.names import LLAMA_FAMILY

# = pipeline.gguf.writer.TENSOR_TYPES (gguf-py writes them) + K_QUANTS (llama.cpp's quantizer does; a test checks)
EXPORT_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k_m", "q5_k_m", "q6_k")
IMATRIX_TYPES = ("q4_0", "q4_1", "q5_0", "q5_1", "q4_k_m", "q5_k_m", "q6_k")  # their quantizers weight columns


@dataclass
class ExportConfig:
    """The exported GGUF's tensor type and name."""

    dtype: str = "f32"
    name: str = ""  # the file's basename (general.basename); "" = the donor's (SmolLM2)
    version: str = ""  # general.version and the file name's version part, e.g. v1.0; "" = none
    imatrix: int = 0  # tokens of the train split for an importance matrix (pipeline.export.corpus_imatrix); 0 = off

    def __post_init__(self) -> None:
        if self.dtype.startswith(
            "auto:"
        ):  # a size budget: the types chosen by measurement (pipeline.export.auto_types)
            mb = self.dtype.removeprefix("auto:")
            ok = mb.replace(".", "", 1).isdigit() and float(mb) > 0
            check(
                ok,
                "export.dtype",
                f"auto:<MB> with a positive size, or one of {', '.join(EXPORT_TYPES)}",
                self.dtype,
                "use e.g. auto:20",
            )
        else:
            choice(self.dtype, "export.dtype", EXPORT_TYPES)  # a K-quant's llama.cpp is checked by the stages
        at_least(self.imatrix, "export.imatrix", 0, "use 0 for none, or e.g. 65536 tokens")
        if self.imatrix:
            types = "|".join(IMATRIX_TYPES)
            check(
                self.dtype in IMATRIX_TYPES or self.dtype.startswith("auto:"),
                "export.dtype",
                f"{types} or auto:<MB> with export.imatrix",
                self.dtype,
                "set export.imatrix=0",
            )


@dataclass
class EvaluateConfig:
    """Samples written after evaluation, for fixed prompts; `baseline_val_loss` (> 0: the val loss of a
    from-scratch run of this shape, e.g. `dvc exp show`'s) adds the fraction of its gap to the donor closed."""

    prompts: list[str] = field(default_factory=lambda: ["The for statement", "A function definition", "Exceptions are"])
    max_new_tokens: int = 40
    temperature: float = 0.8
    top_k: int = 40
    seed: int = 0
    baseline_val_loss: float = 0.0
    llamacpp_windows: int = 4  # val windows llama.cpp runs for the parity check (0: off)
    llamacpp_max_kl: float = 0.03  # mean KL(ours || llama.cpp) per token above which evaluate fails
    quant_types: list[str] = field(default_factory=list)  # also score the export quantized to each (e.g. q4_k_m)

    def __post_init__(self) -> None:
        positive(self.max_new_tokens, "evaluate.max_new_tokens")
        at_least(self.llamacpp_windows, "evaluate.llamacpp_windows", 0, "use 0 to turn the llama.cpp check off")
        positive(self.llamacpp_max_kl, "evaluate.llamacpp_max_kl")
        at_least(self.baseline_val_loss, "evaluate.baseline_val_loss", 0, "use 0 for none")
        positive(self.temperature, "evaluate.temperature")
        at_least(self.top_k, "evaluate.top_k", 0, "use 0 for no top-k")
        for dtype in self.quant_types:  # a K-quant's llama.cpp is checked by the stage
            choice(dtype, "evaluate.quant_types", tuple(t for t in EXPORT_TYPES if t != "f32"))


@dataclass
class ReportConfig:
    """The report stage: how many of the newest evaluate runs in the MLflow experiment it compares this run with."""

    compare_runs: int = 10

    def __post_init__(self) -> None:
        at_least(self.compare_runs, "report.compare_runs", 0, "use 0 for no comparison")


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
    report: ReportConfig = field(default_factory=ReportConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    output: str = "text"  # text | quiet | json (one JSON object with the stage's metrics on stdout)

    def __post_init__(self) -> None:
        choice(self.output, "output", ("text", "quiet", "json"))
        if self.train.qat:
            self._check_qat()
        if self.export.imatrix or self.train.qat_imatrix:
            self._check_imatrix()
        if self.model.arch == "vit" or self.data.images:
            self._check_images()
            return
        if self.recipe.finetune:  # the base GGUF fixes the context length; train checks against it
            return
        length_key = "data.max_seq_len" if self.data.source == "instruct" else "train.seq_len"
        length = self.data.max_seq_len if self.data.source == "instruct" else self.train.seq_len
        check(
            length <= self.model.context_length,
            length_key,
            f"at most model.context_length={self.model.context_length}",
            length,
            f"lower {length_key} or raise model.context_length",
        )
        self.train.check_distill_context()
        if self.recipe.name == "draft":
            self._check_draft()

    def _check_qat(self) -> None:
        """QAT trains to one file: the export at the same type, of a whole model trained by AdamW."""
        qat = self.train.qat
        check(
            self.export.dtype == qat,
            "export.dtype",
            f"{qat}, the type train.qat trains to",
            self.export.dtype,
            f"set export.dtype={qat}",
        )
        check(
            self.recipe.trainable == "all",
            "train.qat",
            f"off for adapters (recipe.trainable={self.recipe.trainable}): their base is frozen",
            qat,
            "set train.qat=''",
        )
        check(self.optim.name == "adamw", "train.qat", "off for optim=lbfgs", qat, "use optim=adamw")
        if qat in ("q8_0", "q4_0"):
            return
        where = f"model.arch={self.model.arch}, recipe.init={self.recipe.init}"
        k_ok = self.model.arch in ("donor", *LLAMA_FAMILY, "gpt2") and self.recipe.init != "lens"
        check(k_ok, "train.qat", f"{qat}: a llama or gpt2 without a lens (llama.cpp's mix)", where, "use q8_0 or q4_0")

    def _check_imatrix(self) -> None:
        """An importance matrix is collected over running text by a llama/gpt2 forward, in train.seq_len
        windows: by export (export.imatrix), or by train for QAT (train.qat_imatrix), whose matrix the
        export then takes: never both."""
        key, n = (
            ("train.qat_imatrix", self.train.qat_imatrix)
            if self.train.qat_imatrix
            else ("export.imatrix", self.export.imatrix)
        )
        if self.train.qat_imatrix:
            qat = self.train.qat
            check(qat in IMATRIX_TYPES, key, f"train.qat one of {'|'.join(IMATRIX_TYPES)}", repr(qat), "set 0")
            both = self.export.imatrix
            check(not both, "export.imatrix", "0 with train.qat_imatrix (the export takes QAT's matrix)", both, "set 0")
        text = self.data.source != "instruct" and not self.data.images
        ok = self.model.arch in ("donor", *LLAMA_FAMILY, "gpt2") and text
        where = f"model.arch={self.model.arch}, data.source={self.data.source}"
        check(ok, key, "off for image models and instruct rows (it needs running text)", where, "set 0")
        seq = self.train.seq_len
        check(n >= seq, key, f">= train.seq_len={seq} tokens (one window)", n, f"use e.g. {64 * seq}")

    def _check_draft(self) -> None:
        """recipe=draft learns the donor's greedy choices from its cached distribution over running text,
        as a llama (the shape llama.cpp's and our speculative decoding pair with the donor)."""
        d = self.train.distill.weight
        check(d > 0, "train.distill.weight", "> 0 for recipe=draft (it learns the donor's choices)", d, "set 1.0")
        check(
            self.data.source != "instruct",
            "data.source",
            "running text for recipe=draft (the donor's distribution is cached over a token stream)",
            self.data.source,
            "use data=pydoc, data=text or data=jsonl",
        )
        arch = self.model.arch
        check(arch in ("donor", *LLAMA_FAMILY), "model.arch", "donor for recipe=draft", arch, "use model=draft")

    def _check_images(self) -> None:
        """The ViT recipe: image data, a from-scratch model, patches that tile the image."""
        check(
            self.data.images,
            "data.source",
            "digits or images for model.arch=vit",
            self.data.source,
            "use data=digits or data=images data.path=dir/ (recipe=vit-tiny sets them)",
        )
        check(
            self.model.arch == "vit",
            "model.arch",
            f"vit for image data (data.source={self.data.source})",
            self.model.arch,
            "use model=vit-tiny (recipe=vit-tiny sets it)",
        )
        check(
            self.recipe.init == "scratch",
            "recipe.init",
            "scratch for model.arch=vit",
            self.recipe.init,
            "use recipe=vit-tiny",
        )
        patch = self.model.patch_size
        check(
            self.data.image_size % patch == 0,
            "data.image_size",
            f"a multiple of model.patch_size={patch}",
            self.data.image_size,
            f"set data.image_size={max(1, round(self.data.image_size / patch)) * patch} or a model.patch_size "
            "that divides it",
        )
        check(
            self.train.distill.weight == 0, "train.distill.weight", "0 for images", self.train.distill.weight, "set 0"
        )


def needs_cut(cfg: PipelineConfig) -> bool:
    """Whether model.n_layer, optim.lr, train.steps or train.eval_every waits at 0 for the corpus's cut."""
    return 0 in (cfg.model.n_layer, cfg.optim.lr, cfg.train.steps, cfg.train.eval_every)


def with_student_cut(cfg: PipelineConfig, train_tokens: int) -> tuple[PipelineConfig, str]:
    """`cfg` with its keys at 0 set from the cut for `train_tokens`, and the cut's name ("" if none was)."""
    if not needs_cut(cfg):
        return cfg, ""
    t = cfg.train
    name, cut = cfg.donor.student.pick(train_tokens, t.batch_size * t.seq_len * t.grad_accum)
    model = replace(cfg.model, n_layer=cfg.model.n_layer or cut.n_layer)
    optim = replace(cfg.optim, lr=cfg.optim.lr or cut.lr)
    train = replace(t, steps=t.steps or cut.steps, eval_every=t.eval_every or cut.eval_every)
    return replace(cfg, model=model, optim=optim, train=train), name
