"""train.precision=auto: bf16 only where the device has bf16 instructions (on an AVX2-only CPU torch's bf16
matmul is a slow path, ~31x fp32's step time) and a bf16 matmul is measured faster than fp32's (an Intel
Xeon with AVX512-BF16 and no AMX ran the step 1.7x slower in bf16), what the train stage ran in recorded,
and an explicit bf16 where it is slow kept but said once."""

from __future__ import annotations

import logging
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

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
    """Set what torch says the CPU has and what the bf16 probe measures; the once-per-process warning forgotten."""
    devices._warn_slow_bf16.cache_clear()

    def use(caps: dict, speedup: float = 3.0) -> None:
        monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: caps)
        monkeypatch.setattr(devices, "cpu_bf16_speedup", lambda: speedup)

    yield use
    devices._warn_slow_bf16.cache_clear()


@pytest.mark.parametrize(
    ("caps", "speedup", "want"),
    [(AVX2, 3.0, "fp32"), (ZEN4, 4.5, "bf16"), (SAPPHIRE, 3.0, "bf16"), (ZEN4, 0.7, "fp32"), (ZEN4, 1.1, "fp32")],
)
def test_auto_is_bf16_only_with_bf16_instructions_that_are_faster(
    cpu_caps, caps: dict, speedup: float, want: str
) -> None:
    cpu_caps(caps, speedup)
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
    assert line.startswith("train.precision=bf16 on a cpu where bf16 is slow (no bf16 instructions)")
    assert "train.precision=auto" in line
    devices._warn_slow_bf16.cache_clear()
    cpu_caps(ZEN4, 0.7)  # the instructions, measured slower than fp32
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=devices.__name__):
        assert resolve_precision("bf16", CPU) == "bf16"
    (line,) = [r.getMessage() for r in caplog.records]
    assert "a bf16 matmul measured 0.70x fp32's speed" in line
    cpu_caps(ZEN4)
    caplog.clear()
    assert resolve_precision("bf16", CPU) == "bf16" and not caplog.records


def test_the_machine_here_resolves_to_what_its_cpu_reports_and_measures() -> None:
    caps = torch.cpu.get_capabilities()
    has = bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))
    if caps.get("architecture") == "x86_64":
        assert devices.cpu_bf16_instructions() is has
        assert native_bf16(CPU) is (has and devices.cpu_bf16_speedup() >= devices.BF16_MIN_SPEEDUP)
    assert resolve_precision("auto", CPU) in ("bf16", "fp32")


def test_the_probe_measures_a_real_matmul_once_per_process() -> None:
    devices.cpu_bf16_speedup.cache_clear()
    first = devices.cpu_bf16_speedup()
    assert 0.01 < first < 100  # a ratio of two measured times, not a constant
    assert devices.cpu_bf16_speedup() == first  # cached: every stage of a process sees one decision


def _rank_precision(rank: int, port: int, speedups: tuple[float, float], results) -> None:
    """One torchrun-like rank: its own probe's figure, then the train stage's `with_precision`."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    os.environ.update(LOCAL_RANK=str(rank))
    torch.cpu.get_capabilities = lambda: ZEN4
    devices.cpu_bf16_speedup = lambda: speedups[rank]
    try:
        results[rank] = with_precision(TrainConfig(precision="auto", device="cpu")).precision
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


@pytest.mark.parametrize(("speedups", "want"), [((1.25, 1.15), "fp32"), ((3.0, 4.0), "bf16")])
def test_torchrun_ranks_agree_on_auto_precision(speedups: tuple[float, float], want: str) -> None:
    """A CPU whose bf16 ratio sits near the threshold could split the ranks of one job between bf16 and
    fp32: they agree, bf16 only where every rank measured it fast."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(_rank_precision, args=(port, speedups, results), nprocs=2, join=True)
    assert dict(results) == {0: want, 1: want}
