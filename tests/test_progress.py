"""Progress where it lands: in a log (no terminal: dvc repro, CI, a pipe) a plain line every tenth of the
work or every 30 s; a tqdm bar only on a terminal. The train stage's 400 steps had written ~1,200
carriage-return redraws into one line of its log."""

from __future__ import annotations

import logging

import pytest

from pipeline import progress
from pipeline.progress import Progress


def test_without_a_terminal_a_known_total_is_ten_plain_lines(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="pipeline.progress"), Progress("train", 400, "steps") as bar:
        for step in range(400):
            bar.note(f"loss={4 - step / 200:.3f}")
            bar.update(1)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 10 and all("\r" not in line for line in lines)
    assert lines[0].startswith("train: 40/400 steps (10%), ") and lines[-1].startswith("train: 400/400 steps (100%)")
    assert "elapsed" in lines[0] and "left" in lines[0] and lines[-1].endswith("; loss=2.005")


def test_without_a_total_a_line_every_thirty_seconds(caplog: pytest.LogCaptureFixture, monkeypatch) -> None:
    clock = [0.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])
    with caplog.at_level(logging.INFO, logger="pipeline.progress"), Progress("pack", unit="doc") as bar:
        for _ in range(100):
            clock[0] += 1.0  # a document a second: 100 s in all
            bar.update(1)
    lines = [r.getMessage() for r in caplog.records]
    assert [line.split(",")[0] for line in lines] == ["pack: 30 doc", "pack: 60 doc", "pack: 90 doc"]


def test_a_resumed_run_counts_from_where_it_resumed(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="pipeline.progress"), Progress("train", 10, "steps", initial=6) as bar:
        for _ in range(4):
            bar.update(1)
    assert [r.getMessage().split(",")[0] for r in caplog.records] == [
        f"train: {n}/10 steps ({n}0%)" for n in (7, 8, 9, 10)
    ]


def test_disabled_is_silent(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="pipeline.progress"), Progress("x", 3, enabled=False) as bar:
        bar.update(3)
    assert not caplog.records
