"""train.precision=auto: bf16 only where the device has bf16 instructions (on an AVX2-only CPU torch's bf16
matmul is a slow path, ~31x fp32's step time), what the train stage ran in recorded, and an explicit bf16
where it is slow kept but said once."""

from __future__ import annotations

import logging

import pytest
import torch

from pipeline.config import TrainConfig
from pipeline.models import devices
from pipeline.models.devices import native_bf16, resolve_precision
from pipeline.training.trainer import with_precision

CPU = torch.device("cpu")
AVX2 = {"avx2": True, "avx512_bf16": False, "amx_bf16": False, "num_logical_cores": 2}
ZEN4 = {**AVX2, "avx512_bf16": True}
SAPPHIRE = {**AVX2, "amx_bf16": True}


@pytest.fixture
def cpu_caps(monkeypatch: pytest.MonkeyPatch):
    """Set what torch says the CPU has; the once-per-process warning forgotten."""
    devices._warn_slow_bf16.cache_clear()

    def use(caps: dict) -> None:
        monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: caps)

    yield use
    devices._warn_slow_bf16.cache_clear()


@pytest.mark.parametrize(("caps", "want"), [(AVX2, "fp32"), (ZEN4, "bf16"), (SAPPHIRE, "bf16")])
def test_auto_is_bf16_only_with_bf16_instructions(cpu_caps, caps: dict, want: str) -> None:
    cpu_caps(caps)
    assert native_bf16(CPU) is (want == "bf16")
    assert resolve_precision("auto", CPU) == want
    assert resolve_precision("fp32", CPU) == "fp32"  # an explicit choice is kept
    assert with_precision(TrainConfig(device="cpu")).precision == want  # the schema's default is auto


def test_an_explicit_bf16_on_a_slow_cpu_is_kept_and_said_once(cpu_caps, caplog: pytest.LogCaptureFixture) -> None:
    cpu_caps(AVX2)
    with caplog.at_level(logging.WARNING, logger=devices.__name__):
        assert resolve_precision("bf16", CPU) == "bf16"
        assert resolve_precision("bf16", CPU) == "bf16"
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("train.precision=bf16 on a cpu without bf16 instructions") and "train.precision=auto" in line
    cpu_caps(ZEN4)
    caplog.clear()
    assert resolve_precision("bf16", CPU) == "bf16" and not caplog.records


def test_the_machine_here_resolves_to_what_its_cpu_reports() -> None:
    caps = torch.cpu.get_capabilities()
    fast = bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))
    if caps.get("architecture") == "x86_64":
        assert native_bf16(CPU) is fast
    assert resolve_precision("auto", CPU) in ("bf16", "fp32")
