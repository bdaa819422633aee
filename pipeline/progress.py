"""Progress of a long loop, readable where it lands: a tqdm bar on a terminal; in a log (`dvc repro`
captured to a file, a pipe, CI) a plain line every tenth of the work or every 30 s instead of
thousands of carriage-return redraws. Nothing is shown until the loop has run for half a second, so
an input refused at once prints its one error line and no empty bar.
"""

from __future__ import annotations

import logging
import sys
import time
from datetime import timedelta
from types import TracebackType

from tqdm.auto import tqdm

log = logging.getLogger(__name__)

LINE_PARTS = 10  # a log line each time another tenth of a known total is done
LINE_SECONDS = 30.0  # and at least this often
QUIET_SECONDS = 0.5  # nothing shown before the loop has run this long


class Progress:
    """`update(n)` as work is done, `note(text)` for the figures shown beside it (loss, tokens/s)."""

    def __init__(self, desc: str, total: int | None = None, unit: str = "it", enabled: bool = True, initial: int = 0):
        self.desc, self.total, self.unit, self.n = desc, total, unit, initial
        self.started = self._last_line = time.monotonic()
        self._initial, self._text = initial, ""
        self._part = self._part_of(initial)
        on_terminal = enabled and sys.stderr.isatty()
        self._lines = enabled and not on_terminal
        self._bar = None
        if on_terminal:
            self._bar = tqdm(
                total=total, initial=initial, desc=desc, unit=unit, dynamic_ncols=True, delay=QUIET_SECONDS
            )

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def update(self, n: int = 1) -> None:
        self.n += n
        if self._bar is not None:
            self._bar.update(n)
        elif self._lines:
            self._maybe_line()

    def note(self, text: str) -> None:
        self._text = text
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=False)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, kind: type | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def _part_of(self, n: int) -> int:
        """How many whole tenths of the total `n` is (0 without a total)."""
        return n * LINE_PARTS // self.total if self.total else 0

    def _maybe_line(self) -> None:
        now, part = time.monotonic(), self._part_of(self.n)
        if part == self._part and now - self._last_line < LINE_SECONDS:
            return
        self._part, self._last_line = part, now
        log.info(self.line())

    def line(self) -> str:
        """e.g. `train: 120/400 steps (30%), 2.6 steps/s, 0:00:46 elapsed, ~0:01:47 left; loss=3.21`."""
        elapsed = self.elapsed
        rate = (self.n - self._initial) / elapsed if elapsed > 0 else 0.0
        done = f"{self.n:,} {self.unit}"
        if self.total:
            done = f"{self.n:,}/{self.total:,} {self.unit} ({self.n / self.total:.0%})"
        parts = [done, f"{rate:,.1f} {self.unit}/s", f"{_clock(elapsed)} elapsed"]
        if self.total and rate > 0:
            parts.append(f"~{_clock((self.total - self.n) / rate)} left")
        return f"{self.desc}: {', '.join(parts)}" + (f"; {self._text}" if self._text else "")


def _clock(seconds: float) -> str:
    return str(timedelta(seconds=round(seconds)))
