"""`python -m stages.generate`: a tool's schema (conf/generate.yaml), not part of params.yaml."""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.config.checks import at_least, check, choice, integer, positive
from pipeline.config.train_schema import DEVICES

# how generate and chat store the weights (pipeline.inference.decode): int8 rows, int4 blocks (CPU), bf16, or exact fp32
DECODE_PRECISIONS = ("int8", "int4", "bf16", "fp32")


@dataclass
class GenerateConfig:
    """`python -m stages.generate` (conf/generate.yaml, not part of params.yaml): which model, which
    prompt, and llama.cpp-style sampling. temperature=0 is greedy; top_k=0 / top_p=1 disable those."""

    model_path: str = ""  # a GGUF, a model dir (models/init, models/train), or `smollm2`
    prompt: str = ""
    prompt_file: str = ""  # the prompt from a file, or `-` for stdin: free text needs no Hydra quoting
    tokenizer_gguf: str = "smollm2"  # the tokenizer of a model dir (a GGUF brings its own)
    lora: str = ""  # a LoRA adapter on top (llama.cpp adapter GGUF or PEFT dir), as llama-cli --lora
    chat: bool = False  # render the prompt with the GGUF's tokenizer.chat_template
    system: str = ""  # optional system message for chat
    parse_special: bool = False  # true: special-token strings typed in prompt/system become control tokens
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 40
    top_p: float = 0.95
    repetition_penalty: float = 1.0  # 1 disables
    repetition_last_n: int = 64  # tokens the penalty looks back over; 0 none, -1 the whole context
    stop: list[str] = field(default_factory=list)  # stop strings (trimmed from the completion)
    stop_ids: list[int] | None = None  # None: EOS (+ end-of-turn tokens with chat); [] for none
    seed: int = 0
    cache: bool = True  # false recomputes the whole window every token (for checking the cache)
    precision: str = "int8"  # int8 | int4 (CPU) | bf16 | fp32 weights (pipeline.inference.decode)
    device: str = "auto"
    threads: int = 0  # 0: torch's default
    draft: str = ""  # a draft model sharing the vocabulary (a student GGUF): greedy speculative decoding
    draft_k: int = 2  # most tokens the draft proposes per check (2: the CPU's check cost jumps at 4 positions)
    draft_precision: str = "int8"  # the draft's weights: its rounding changes what it proposes, never the output
    draft_p_min: float = 0.2  # the draft stops at a token it gives less than this (llama.cpp's --draft-p-min)

    def __post_init__(self) -> None:
        check(bool(self.model_path), "model_path", "a model", "nothing", "set model_path=smollm2 or a GGUF/dir path")
        integer(self.draft_k, "draft_k", 1, "use e.g. 2")
        choice(self.draft_precision, "draft_precision", DECODE_PRECISIONS)
        check(0 <= self.draft_p_min <= 1, "draft_p_min", "a probability in [0, 1]", self.draft_p_min, "use e.g. 0.2")
        greedy = self.temperature <= 0 and self.repetition_penalty == 1.0 and self.cache and not self.lora
        check(
            not self.draft or greedy,
            "draft",
            "greedy decoding with the cache (temperature=0, repetition_penalty=1, cache=true, no lora)",
            f"temperature={self.temperature}, repetition_penalty={self.repetition_penalty}, cache={self.cache}",
            "set temperature=0, or drop draft",
        )
        check(
            not (self.prompt and self.prompt_file),
            "prompt / prompt_file",
            "one of them",
            "both",
            "drop one: prompt=... for short text, prompt_file=path.txt (or - for stdin) for free text",
        )
        check(all(self.stop), "stop", "non-empty stop strings", self.stop, "remove the empty string")
        check_sampling(self)


@dataclass
class ChatConfig:
    """`python -m stages.chat` (conf/chat.yaml): a multi-turn REPL over a model's chat template, with
    the sampling of generate (defaults: SmolLM2's suggested temperature 0.2, top-p 0.9)."""

    model_path: str = ""  # a GGUF, a model dir, or `smollm2`
    tokenizer_gguf: str = "smollm2"  # the tokenizer (and chat template) of a model dir
    lora: str = ""  # a LoRA adapter on top (llama.cpp adapter GGUF or PEFT dir)
    system: str = ""  # a system message opening every conversation
    max_new_tokens: int = 256  # per answer
    temperature: float = 0.2
    top_k: int = 40
    top_p: float = 0.9
    repetition_penalty: float = 1.0
    repetition_last_n: int = 64
    seed: int = 0
    precision: str = "int8"  # int8 | int4 (CPU) | bf16 | fp32 weights (pipeline.inference.decode)
    device: str = "auto"
    threads: int = 0

    def __post_init__(self) -> None:
        check(bool(self.model_path), "model_path", "a model", "nothing", "set model_path=smollm2 or a GGUF/dir path")
        check_sampling(self)


def check_sampling(cfg: GenerateConfig | ChatConfig) -> None:
    """The sampling and runtime keys generate and chat share, each refused by name."""
    positive(cfg.max_new_tokens, "max_new_tokens")
    at_least(cfg.temperature, "temperature", 0, "use 0 for greedy")
    at_least(cfg.top_k, "top_k", 0, "use 0 to disable top-k")
    check(0 < cfg.top_p <= 1, "top_p", "a value in (0, 1]", cfg.top_p, "use 1 to disable top-p")
    positive(cfg.repetition_penalty, "repetition_penalty")
    at_least(cfg.repetition_last_n, "repetition_last_n", -1, "use 64, 0 for none or -1 for the whole context")
    choice(cfg.precision, "precision", DECODE_PRECISIONS)
    choice(cfg.device, "device", DEVICES)
    at_least(cfg.threads, "threads", 0, "use 0 for torch's default")
