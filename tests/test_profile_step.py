"""benchmarks/profile_step.py on this CPU: the smoke shape through the real training loop, profiled and
summarised, so the one command a GPU session runs first is known to work before it costs device time."""

from __future__ import annotations

import importlib
import json
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType
from torch.autograd.profiler_util import FunctionEvent

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def profile_step() -> Iterator[ModuleType]:
    """The script as a module; its folder on sys.path, as when it runs (the benchmarks import each other)."""
    folder = str(ROOT / "benchmarks")
    sys.path.insert(0, folder)
    try:
        yield importlib.import_module("profile_step")
    finally:
        sys.path.remove(folder)


def test_profile_step_summarises_the_smoke_shape(profile_step: ModuleType, tmp_path: Path) -> None:
    argv = ["--device", "cpu", "--shape", "smoke", "--steps", "2", "--warmup", "1", "--out", str(tmp_path)]
    s = profile_step.main(argv)

    for key in ("step_ms", "step_ms_unprofiled", "tokens_per_s", "mfu", "top", "categories", "host_waits"):
        assert key in s
    assert s["step_ms"] > 0 and s["step_ms_unprofiled"] > 0 and len(s["step_ms_each"]) == 2
    assert s["tokens_per_s"] == pytest.approx(2 * 64 / s["step_ms"] * 1e3)
    assert s["mfu"] is None  # no peak given on a CPU
    cats = s["categories"]
    assert set(cats) == {c for c, _ in profile_step.CATEGORIES} | {profile_step.OTHER}
    assert sum(c["share"] for c in cats.values()) == pytest.approx(1.0)
    assert cats["matmul"]["share"] > 0 and cats["optimizer"]["share"] > 0
    assert s["top"] and all(r["ms_per_step"] > 0 and r["calls_per_step"] > 0 for r in s["top"])
    # the ops' self times make up the step (the rest is the profiler's own overhead)
    assert sum(c["ms_per_step"] for c in cats.values()) == pytest.approx(sum(s["step_ms_each"]) / 2, rel=0.25)
    waits = s["host_waits"]
    assert waits["log_step"] == 1  # exactly one profiled step logs: the second of two
    assert waits["per_step"]["sync_calls"] == [0, 0] and waits["per_step"]["sync_warnings"] == [0, 0]
    saved = json.loads((tmp_path / "profile_smoke_cpu.json").read_text())
    assert saved["step_ms"] == s["step_ms"]


def test_categories_by_name(profile_step: ModuleType) -> None:
    """CPU op names and CUDA kernel names land in the categories the GPU session acts on."""
    cases = {
        "aten::mm": "matmul",
        "nvjet_tst_128x64_64x8_1x2_h_bz_coopA_NNT": "matmul",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64": "matmul",
        "pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128>>": "attention",
        "aten::_scaled_dot_product_flash_attention_for_cpu_backward": "attention",
        "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>": "elementwise+casts",
        "aten::add_": "elementwise+casts",
        "aten::_to_copy": "elementwise+casts",
        "Memcpy HtoD (Pinned -> Device)": "elementwise+casts",
        "triton_poi_fused_mul_silu_0": "elementwise+casts",
        "aten::_softmax": "reduce/softmax/loss",
        "void at::native::reduce_kernel<512, 1, ReduceOp<float, MeanOps<float>>>": "reduce/softmax/loss",
        "triton_red_fused__to_copy_mean_pow_rsqrt_0": "reduce/softmax/loss",
        "aten::_fused_adamw_": "optimizer",
        "void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor<float, 4>>": "optimizer",
        "aten::empty_strided": "other",
    }
    assert {name: profile_step.category(name) for name in cases} == cases


class _Mark:
    """A CUDA event stand-in: `at` ms on the GPU's clock."""

    def __init__(self, at: float):
        self.at = at

    def elapsed_time(self, later: _Mark) -> float:
        return later.at - self.at


def _event(name: str, start: float, end: float, cuda: bool = False, annotation: bool = False) -> FunctionEvent:
    device = DeviceType.CUDA if cuda else DeviceType.CPU
    return FunctionEvent(0, name, 1, start, end, device_type=device, use_device="cuda", is_user_annotation=annotation)


def test_cuda_summary_from_profiler_events(profile_step: ModuleType, monkeypatch, capsys) -> None:
    """The CUDA half of the summary (no GPU here): two profiled steps of 100 µs, the second the log step."""
    window = profile_step.Window(torch.device("cuda"), 1, 2)
    window.marks, window.timed = [_Mark(0.0), _Mark(0.1), _Mark(0.2)], [_Mark(0.0), _Mark(0.1), _Mark(0.3)]
    sync = warnings.WarningMessage(profile_step.SYNC_WARNING, UserWarning, str(ROOT / "pipeline/x.py"), 7)
    window.warned = [[sync], []]
    events = [
        *(_event("ProfilerStep*", a, b) for a, b in ((0, 100), (100, 200), (200, 210))),
        _event("aten::mm", 10, 20),
        _event("cudaLaunchKernel", 12, 13),
        _event("sm90_xmma_gemm_bf16", 30, 60, cuda=True),
        _event("ProfilerStep#0", 0, 100, cuda=True, annotation=True),  # mirrored on the GPU: not work
        _event("cudaStreamSynchronize", 150, 160),  # the log step's read of the queued figures
        _event("Memcpy DtoH (Device -> Pageable)", 150, 151, cuda=True),
    ]
    window.prof = SimpleNamespace(events=lambda: events)
    monkeypatch.setattr(profile_step, "device_name", lambda device: "a GPU")
    args = profile_step.parse_args(["--steps", "2", "--warmup", "1"])
    s = profile_step.summarize(window, profile_step.pick_shapes("smoke", None, None)[0], args, 1.0)
    profile_step.report(s, cuda=True)

    assert s["step_ms"] == pytest.approx(0.1) and s["step_ms_unprofiled"] == pytest.approx(0.15)
    assert s["kernels_per_step"] == 0.5 and s["launch_calls_per_step"] == 0.5 and s["d2h_copies_per_step"] == 0.5
    assert s["gpu_idle"] == pytest.approx(1 - 31 / 200)
    assert s["categories"]["matmul"]["share"] == pytest.approx(30 / 31)
    waits = s["host_waits"]
    assert waits["per_step"]["sync_calls"] == [0, 1] and waits["per_step"]["sync_warnings"] == [1, 0]
    assert waits["nonlog_max"] == {"sync_calls": 0, "sync_warnings": 1, "reads": 0, "memcpy_calls": 0}
    assert waits["sources"] == [("non-log sync at pipeline/x.py:7", 1)]
    assert s["top_host"][0]["name"] == "aten::mm"
    out = capsys.readouterr().out
    assert "non-log sync at pipeline/x.py:7 x1" in out and "GPU idle 84.5%" in out


def test_every_named_shape_builds_a_model_with_a_rope_base(profile_step: ModuleType) -> None:
    """A config shape of model.arch=donor leaves rope_theta at 0 (the donor's); the benchmark's model must
    take the donor's base, or its first step is NaN (the default shape's was, before it did)."""
    shapes = importlib.import_module("gpu_common").named_shapes()  # the fixture put benchmarks/ on the path
    assert shapes["default"].rope_theta == shapes["135m"].rope_theta > 0
    assert all(shape.config().rope_theta > 0 for shape in shapes.values())


def test_profile_step_never_writes_the_committed_results_by_default(
    profile_step: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A profile on another machine overwrote benchmarks/results/profile_default_cpu.json; only an
    explicit --out (or $OUT) may name that folder now."""
    monkeypatch.delenv("OUT", raising=False)
    out = Path(profile_step.parse_args(["--device", "cpu"]).out).resolve()
    assert not out.is_relative_to(ROOT / "benchmarks" / "results")
    monkeypatch.setenv("OUT", str(ROOT / "benchmarks" / "results"))
    assert Path(profile_step.parse_args(["--device", "cpu"]).out) == ROOT / "benchmarks" / "results"
