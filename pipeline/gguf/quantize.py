"""K-quant exports through llama.cpp's own quantizer (llama-cpp-python's `llama_model_quantize`).

gguf-py quantizes the legacy block types (Q4_0 ... Q8_0) in numpy, but not the K-quants, and
llama.cpp's K-quant "mixes" (Q4_K_M: most matrices Q4_K, some Q6_K, the head Q6_K) are a policy
of its quantizer, not a tensor type. So a K-quant export is an f32 GGUF quantized by llama.cpp,
exactly as `llama-quantize model-f32.gguf model-Q4_K_M.gguf Q4_K_M` would do it.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
from pathlib import Path

from pipeline.errors import ConfigError, GGUFError, problem
from pipeline.io.files import atomic_file

# export dtype -> the name of llama.cpp's enum llama_ftype member
K_QUANTS = {
    "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M",
    "q5_k_m": "LLAMA_FTYPE_MOSTLY_Q5_K_M",
    "q6_k": "LLAMA_FTYPE_MOSTLY_Q6_K",
}


def llamacpp_installed() -> bool:
    """Whether llama-cpp-python can be imported (checked without importing it: that loads libllama)."""
    try:
        return importlib.util.find_spec("llama_cpp") is not None
    except (ImportError, ValueError):  # blocked, or a half-imported module without a spec
        return False


def require_llamacpp(dtype: str, key: str = "export.dtype") -> None:
    """A K-quant asked for (by config key `key`) without llama-cpp-python: one named line with the fix."""
    if not llamacpp_installed():
        raise ConfigError(
            problem(
                f"config key {key}",
                f"llama-cpp-python installed for {dtype} (K-quants are written by llama.cpp's quantizer)",
                "no llama_cpp module",
                "`make llamacpp` (or pip install llama-cpp-python), or use q8_0/q5_1/q5_0/q4_1/q4_0",
            )
        )


def llamacpp_quantize(
    src: Path, dst: str | os.PathLike[str], dtype: str, threads: int = 1, requantize: bool = False
) -> Path:
    """`src` (an f32/f16 GGUF) quantized by llama.cpp into `dst` (written atomically), its logs muted.

    `requantize`: `src` may itself be quantized (llama-quantize --allow-requantize): its blocks are
    dequantized and quantized again, e.g. a K-quant QLoRA base made from a Q4_1 donor."""
    require_llamacpp(dtype)
    import llama_cpp
    from llama_cpp._utils import suppress_stdout_stderr

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, K_QUANTS[dtype])
    params.nthread = threads
    params.allow_requantize = requantize
    with atomic_file(dst) as tmp:
        with suppress_stdout_stderr(disable=False):
            status = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
        if status != 0:  # raised inside: nothing is left at `dst`
            raise GGUFError(
                problem(str(src), f"a GGUF llama.cpp can quantize to {dtype}", f"status {status}", "export f32 or q8_0")
            )
    return Path(dst)
