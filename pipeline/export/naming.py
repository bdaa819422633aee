"""Ship-ready names: `general.*` keys by llama.cpp's conventions and the conventional file name.

GGUF's naming convention is `<BaseName>-<SizeLabel>-<FineTune>-<Version>-<Encoding>.gguf`
(https://github.com/ggml-org/ggml/blob/master/docs/gguf.md); gguf-py implements it
(`gguf.utility.naming_convention`, `size_label`) and writes the keys (`gguf.Metadata`). We take the
donor's identity from its own `general.*` keys (organization, basename, size label, license), with
the casing and variant ("Instruct") from its file name when that names the same basename: the
packaged donor says `general.basename = smollm2` and `general.finetune = 8k-lc100k-mix1-ep2` (a
training-run tag), while its file is `SmolLM2-135M-Instruct.Q4_1.gguf`, the hub repo's name.

So a LoRA fine-tune of it on the pydoc Q/A set exported as Q8_0 is
`SmolLM2-135M-Instruct-lora-pydoc-Q8_0.gguf`, and a 28M subclone student trained on pydoc text
`SmolLM2-28M-subclone-pydoc-F32.gguf` (a student is no longer the donor's "Instruct" variant).
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gguf import GGUFValueType, GGUFWriter
from gguf.metadata import Metadata
from gguf.utility import naming_convention, size_label

from pipeline.gguf.reader import GGUFFile, TypedValue

# export dtype -> the encoding part of the file name (llama.cpp's spelling)
ENCODINGS = {"bf16": "BF16", "q4_k_m": "Q4_K_M", "q5_k_m": "Q5_K_M", "q6_k": "Q6_K"}
_QUANT_SUFFIX = re.compile(r"[.-](F32|F16|BF16|Q\d\w*|IQ\d\w*|TQ\d\w*)$", re.IGNORECASE)


@dataclass(frozen=True)
class ShipInfo:
    """What names an export besides the donor: how it was made, and the user's overrides."""

    recipe: str = ""  # recipe name: lora, qlora, subclone, ...
    data: str = ""  # the data's short name: pydoc, or the stem of data.path
    finetune: bool = False  # a fine-tune of the donor itself keeps the donor's variant (Instruct)
    name: str = ""  # export.name: the basename; "" = the donor's
    version: str = ""  # export.version
    description: str = ""
    tags: tuple[str, ...] = field(default_factory=tuple)


@dataclass(frozen=True)
class DonorIdentity:
    """Who the donor is, hub-style: `HuggingFaceTB/SmolLM2-135M-Instruct` and its parts."""

    model_id: str  # organization/name when the organization is known, else the name
    basename: str
    variant: str | None  # the finetune part of the donor's own name, e.g. Instruct
    size_label: str | None
    organization: str | None
    license: str | None


def _str(meta: dict[str, Any], key: str) -> str | None:
    value = meta.get(key)
    return value if isinstance(value, str) and value.strip() else None


def donor_identity(g: GGUFFile) -> DonorIdentity:
    """The donor's hub-style identity from its `general.*` keys and its file name (see the module doc)."""
    meta = g.metadata
    stem = _QUANT_SUFFIX.sub("", Path(g.path).name.removesuffix(".gguf"))
    _, _, base, variant, _, size = Metadata.get_model_id_components(stem)
    key_base, org = _str(meta, "general.basename"), _str(meta, "general.organization")
    if key_base and (base or "").lower() != key_base.lower():  # the file name is not the model's name
        stem, base, variant = key_base, key_base, None
        size = _str(meta, "general.size_label")
    base = base or _str(meta, "general.name") or stem
    name = stem.strip().replace(" ", "-")
    return DonorIdentity(
        model_id=f"{org}/{name}" if org else name,
        basename=base.strip().replace(" ", "-"),
        variant=variant,
        size_label=_str(meta, "general.size_label") or size,
        organization=org,
        license=_str(meta, "general.license"),
    )


def general_metadata(donor: DonorIdentity, ship: ShipInfo, n_params: int) -> Metadata:
    """The export's `general.*` keys as gguf-py's Metadata: basename, size, finetune, version,
    license (the donor's: a derived model keeps it), base_model.0.* = the donor, the dataset."""
    size = size_label(n_params, 0, 0, 0)
    parts = [donor.variant] if ship.finetune and donor.variant else []
    parts += [p for p in (ship.recipe, ship.data) if p]
    finetune = "-".join(parts) or None
    basename = ship.name.strip().replace(" ", "-") or donor.basename
    base_entry: dict[str, str] = {"name": donor.model_id.split("/")[-1].replace("-", " ")}
    if donor.organization:
        base_entry |= {"organization": donor.organization, "repo_url": f"https://huggingface.co/{donor.model_id}"}
    return Metadata(
        name=" ".join(p for p in (basename, size, *(finetune or "").split("-")) if p),
        basename=basename,
        size_label=size,
        finetune=finetune,
        version=ship.version or None,
        description=ship.description or None,
        license=donor.license,
        base_models=[base_entry],
        datasets=[{"name": ship.data}] if ship.data else None,
        tags=list(ship.tags) or None,
    )


def general_keys(meta: Metadata, arch: str) -> dict[str, TypedValue]:
    """The keys gguf-py's own writer would store for `meta`, typed, for our writer's metadata dict."""
    writer = GGUFWriter(None, arch)
    meta.set_gguf_meta_model(writer)
    out = {}
    for key, v in writer.kv_data[0].items():
        if key == "general.architecture":
            continue
        sub = v.sub_type if v.type == GGUFValueType.ARRAY else None
        out[key] = TypedValue(v.value, int(v.type), None if sub is None else int(sub))
    return out


def file_name(meta: Metadata, dtype: str) -> str:
    """`<BaseName>-<SizeLabel>-<FineTune>-<Version>-<Encoding>.gguf` by gguf-py's naming_convention."""
    encoding = ENCODINGS.get(dtype, dtype.upper())
    if dtype.startswith("auto:"):  # a size budget: the types were chosen within it
        encoding = f"AUTO-{dtype.removeprefix('auto:')}MB"
    return naming_convention(meta.name, meta.basename, meta.finetune, meta.version, meta.size_label, encoding) + ".gguf"


def data_label(source: str, path: str) -> str:
    """The data's short name in file names: the file or folder's stem, or the built-in set's (pydoc)."""
    if path:
        name = Path(path.rstrip("/")).name
        for suffix in (".gz", ".zst"):  # c.jsonl.gz -> c: the compression, then (stem) the format
            name = name.removesuffix(suffix)
        return Path(name).stem.replace("_", "-").replace(" ", "-") or source
    return "pydoc" if source in ("pydoc", "instruct") else source


def link_or_copy(src: Path, dst: Path) -> Path:
    """`dst` as a hard link to `src` (no second copy on disk), or a copy where links are refused.

    Not a symlink: DVC caches a directory out file by file, and a hard link or a copy is just
    another file with the same hash (stored once in the cache, checked out by its cache.type).
    """
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)
    return dst
