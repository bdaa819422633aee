"""The train stage's CPU allocator: tcmalloc (or jemalloc) when the machine has it, glibc's otherwise.

Packed rows change every step's tensor sizes, and glibc's malloc serves them from a heap that
fragments: on LoRA steps of SmolLM2-135M (4 x 256 packed rows, 2 threads) peak RSS climbed 1.13 ->
1.88 GB over 12 steps, and each step page-faulted its fresh heap in. With tcmalloc preloaded the same
steps peaked at 1.32 GB and ran 18% faster (measured side by side, docs/finetuning.md). A library
cannot swap the allocator of a running process, so the stage re-executes itself once with
LD_PRELOAD naming the library; `PIPELINE_MALLOC=system` keeps glibc's.
"""

from __future__ import annotations

import ctypes.util
import os
import sys
from pathlib import Path

# in order of preference: tcmalloc_minimal is Debian's libtcmalloc-minimal4 (apt install libtcmalloc-minimal4)
LIBRARIES = ("tcmalloc_minimal", "tcmalloc", "jemalloc")
SWITCH = "PIPELINE_MALLOC"  # "system": glibc's malloc; set to the library's name once it is preloaded


def fast_malloc() -> str | None:
    """The soname of the first allocator in LIBRARIES the dynamic loader can find, else None."""
    if not sys.platform.startswith("linux"):
        return None
    return next((found for name in LIBRARIES if (found := ctypes.util.find_library(name))), None)


def malloc_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's) with the fast allocator preloaded, or unchanged where there is
    none or `PIPELINE_MALLOC` is already set (to `system`, or by an earlier preload)."""
    env = dict(os.environ if env is None else env)
    lib = None if env.get(SWITCH) else fast_malloc()
    if lib is None:
        return env
    preload = " ".join(p for p in (env.get("LD_PRELOAD", ""), lib) if p)
    # tcmalloc reports every allocation over 1 GB on stderr; a large validation batch is not news
    return {**env, "LD_PRELOAD": preload, SWITCH: lib, "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": str(2**40)}


def reexec_with_fast_malloc() -> None:
    """Restart this process (same pid, same arguments) under the fast allocator, once; a no-op where
    there is none, where it is already preloaded, or with `PIPELINE_MALLOC=system`."""
    env = malloc_env()
    if env.get(SWITCH) == os.environ.get(SWITCH):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def allocator_in_use() -> str:
    """The allocator this process runs under, as its memory map shows: what its speed and memory figures
    depend on, tagged on the MLflow run so that runs compare like with like."""
    try:
        mapped = Path("/proc/self/maps").read_text()
    except OSError:
        return "the platform's malloc"
    return next((name for name in ("tcmalloc", "jemalloc") if f"lib{name}" in mapped), "glibc malloc")
