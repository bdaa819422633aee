"""The train stage's allocator: tcmalloc preloaded once where the machine has it, never forced."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from stages._malloc import SWITCH, fast_malloc, malloc_env

ROOT = Path(__file__).resolve().parents[1]

# prints which allocator the process runs under, after asking for the restart
PROBE = (
    "from stages._malloc import allocator_in_use, reexec_with_fast_malloc; reexec_with_fast_malloc(); import os, sys; "
    "print(os.getpid(), allocator_in_use().replace(' ', '_'), os.environ.get('PIPELINE_MALLOC'), sys.argv[1:])"
)


def test_the_env_names_the_library_once_and_keeps_an_existing_preload() -> None:
    lib = fast_malloc()
    env = malloc_env({"LD_PRELOAD": "libfoo.so", "PATH": "/bin"})
    if lib is None:
        assert env == {"LD_PRELOAD": "libfoo.so", "PATH": "/bin"}
        return
    assert env["LD_PRELOAD"] == f"libfoo.so {lib}" and env[SWITCH] == lib and env["PATH"] == "/bin"
    assert malloc_env(env) == env  # already preloaded: nothing added twice
    assert malloc_env({SWITCH: "system"}) == {SWITCH: "system"}  # the user's opt-out wins


def probe(env: dict[str, str]) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, "a", "b=c"], env=env, cwd=ROOT, capture_output=True, text=True, check=True
    )
    return out.stdout.strip().split(maxsplit=3)


@pytest.mark.skipif(fast_malloc() is None, reason="no tcmalloc/jemalloc here (apt install libtcmalloc-minimal4)")
def test_the_process_restarts_under_the_library_with_its_arguments() -> None:
    env = {k: v for k, v in os.environ.items() if k not in (SWITCH, "LD_PRELOAD")}
    pid, allocator, switch, args = probe(env)
    assert allocator in fast_malloc() and switch == fast_malloc() and args == "['a', 'b=c']"  # the tag names it
    pid, allocator, switch, args = probe({**env, SWITCH: "system"})
    assert allocator == "glibc_malloc" and switch == "system" and args == "['a', 'b=c']"


@pytest.mark.skipif(fast_malloc() is None, reason="no tcmalloc/jemalloc here (apt install libtcmalloc-minimal4)")
def test_the_train_stage_restarts_before_torch_loads() -> None:
    """The restart re-runs the interpreter; done after the stage's imports it loaded torch twice (3.18 s
    of every train launch on a 2-core CPU: benchmarks/results/stage_startup_avx2_2026-11-29.json)."""
    env = {k: v for k, v in os.environ.items() if k not in (SWITCH, "LD_PRELOAD")}
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "stages.train", "--help"],
        env=env, cwd=ROOT, capture_output=True, text=True, check=True,
    )
    torch_loads = [line for line in out.stderr.splitlines() if line.split("|")[-1].strip() == "torch"]
    assert len(torch_loads) == 1, torch_loads
