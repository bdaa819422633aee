"""How a stage reports: through `logging`, so Hydra's per-job log file holds what the console shows.

`output=text` (default): progress and one summary line per stage on the console, plain.
`output=quiet`: warnings and errors only, no progress bars.
`output=json`: like quiet, then exactly one JSON object on stdout with the stage's metrics
(`{"stage": ..., "metrics": {...}, "mlflow_run_id": ...}`), for scripts.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

OUTPUTS = ("text", "quiet", "json")
PLAIN = logging.Formatter("%(message)s")
# Optuna's sweeper imports alembic, whose plugin set-up logs seven INFO lines before any job starts:
# quiet it at import, since the sweeper runs before `configure`.
logging.getLogger("alembic").setLevel(logging.WARNING)


def configure(output: str) -> None:
    """Plain console lines (Hydra's file handler keeps its timestamps); quiet levels for quiet/json."""
    root = logging.getLogger()
    if not root.handlers:  # not under Hydra (a stage body called from Python): log to stderr
        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    console_level = logging.INFO if output == "text" else logging.WARNING
    for handler in root.handlers:
        if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
            handler.setFormatter(PLAIN)
            handler.setLevel(console_level)
            if output == "json":  # stdout carries the one JSON object only
                handler.setStream(sys.stderr)
        elif isinstance(handler, logging.FileHandler) and handler.mode == "a":
            _start_fresh(handler)  # DVC runs log to logs/<stage>.log: one run per file
    root.setLevel(min(root.level or logging.INFO, logging.INFO))
    logging.getLogger("gguf").setLevel(logging.WARNING)  # gguf-py narrates every file it writes


def _start_fresh(handler: logging.FileHandler) -> None:
    handler.acquire()
    try:
        handler.close()
        handler.mode = "w"
        handler.stream = handler._open()
    finally:
        handler.release()


def log_file() -> str | None:
    """The file Hydra's job logging writes (logged as an MLflow artifact), if any."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            return handler.baseFilename
    return None


def emit_json(output: str, stage: str, metrics: dict[str, Any], run_id: str | None) -> None:
    if output == "json":
        sys.stdout.write(json.dumps({"stage": stage, "metrics": metrics, "mlflow_run_id": run_id}) + "\n")
        sys.stdout.flush()
