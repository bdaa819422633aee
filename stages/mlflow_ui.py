"""`make mlflow-ui`: the MLflow UI on the project's store, opened where the runs are.

MLflow 3 opens an experiment in its GenAI view (traces, "No data available"); the run list is
behind its "Model training" toggle. The URL printed here, `#/experiments/<id>/runs?workflowType=
machine_learning`, opens the run list directly. With `MLFLOW_TRACKING_URI` pointing at a server,
it prints that server's URL instead of starting a UI.

    python -m stages.mlflow_ui [port]      (default 5000)
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
from pathlib import Path

from pipeline.config import TrackingConfig
from pipeline.errors import ConfigError, problem
from pipeline.tracking import Tracker, default_tracking_uri, is_local_store, project_root

HOST = "127.0.0.1"


def runs_url(base: str, experiment_id: str) -> str:
    return f"{base.rstrip('/')}/#/experiments/{experiment_id}/runs?workflowType=machine_learning"


def parse_port(text: str) -> int:
    """The UI's port (the command's one argument, `make mlflow-ui PORT=...`), refused in one line if it is none."""
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ConfigError(
            problem(
                f"port {text!r}", "a TCP port number in 1-65535", repr(text), "give one, e.g. make mlflow-ui PORT=5001"
            )
        )
    return int(text)


def check_free(port: int) -> None:
    """`mlflow ui` on a taken port logs an error and exits 0, after this launcher printed a URL that the
    other server (perhaps another project's UI, showing other runs) answers: refuse that first."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a closed UI's port is free
        try:
            s.bind((HOST, port))
        except OSError as e:
            found = f"it is taken ({e.strerror}: another mlflow ui or server?)"
            fix = f"stop that server or pick a free port, e.g. make mlflow-ui PORT={port + 1 if port < 65535 else 5001}"
            raise ConfigError(problem(f"port {port} on {HOST}", "a free port for the UI", found, fix)) from None


def main() -> None:
    try:
        port = parse_port(sys.argv[1] if len(sys.argv) > 1 else "5000")
        uri = default_tracking_uri(project_root(Path.cwd()))
        if is_local_store(uri):
            check_free(port)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    experiment = TrackingConfig().experiment
    tracker = Tracker(uri, experiment, project_root(Path.cwd()) / "mlartifacts")
    if not is_local_store(uri):
        print(f"open {runs_url(uri, tracker.experiment_id)}  (experiment {experiment} on {uri})")
        return
    print(f"open {runs_url(f'http://{HOST}:{port}', tracker.experiment_id)}  (experiment {experiment})", flush=True)
    mlflow = shutil.which("mlflow", path=str(Path(sys.executable).parent)) or "mlflow"
    os.execv(mlflow, [mlflow, "ui", "--backend-store-uri", uri, "--host", HOST, "--port", str(port)])


if __name__ == "__main__":
    main()
