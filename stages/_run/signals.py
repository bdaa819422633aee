"""A stage stopped by Ctrl-C or SIGTERM (`kill`, SLURM's scancel, torchrun stopping its workers) ends like
any refused input: its temp outputs removed (`atomic_dir`), its MLflow run KILLED, one line and exit 128+N.
By default SIGTERM killed the process on the spot (a run left RUNNING, a temp directory left) and Ctrl-C
printed a traceback. The train loop installs its own handlers while it steps (it checkpoints first)."""

from __future__ import annotations

import signal
import threading
from typing import Any

from pipeline.errors import problem


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the stage was, so that cleanup runs as for Ctrl-C."""

    signum = signal.SIGTERM


def stop_on_sigterm() -> Any:
    """SIGTERM raises `Terminated` from now on; returns the handler it replaced (None off the main
    thread, where Python cannot handle signals)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def handle(signum: int, frame: object) -> None:
        raise Terminated

    return signal.signal(signal.SIGTERM, handle)


def restore_sigterm(previous: Any) -> None:
    if previous is not None:
        signal.signal(signal.SIGTERM, previous)


def stopped(stage: str, e: KeyboardInterrupt) -> tuple[str, int]:
    """(the one line, the exit code) for a stage stopped by a stop request, which is not a mistake."""
    signum = getattr(e, "signum", signal.SIGINT)
    resume = " (train continues from its newest checkpoint)" if stage == "train" else ""
    message = problem(
        f"{stage} stopped by {signal.Signals(signum).name}",
        "a run to the end",
        "a stop request; its outputs are replaced only when it completes, so the previous ones are as they were",
        f"run it again{resume}",
    )
    return message, 128 + signum
