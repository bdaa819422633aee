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
import sys
from pathlib import Path

from pipeline.config import TrackingConfig
from pipeline.tracking import Tracker, default_tracking_uri, is_local_store, project_root

HOST = "127.0.0.1"


def runs_url(base: str, experiment_id: str) -> str:
    return f"{base.rstrip('/')}/#/experiments/{experiment_id}/runs?workflowType=machine_learning"


def main() -> None:
    port = sys.argv[1] if len(sys.argv) > 1 else "5000"
    uri = default_tracking_uri(project_root(Path.cwd()))
    experiment = TrackingConfig().experiment
    tracker = Tracker(uri, experiment, project_root(Path.cwd()) / "mlartifacts")
    if not is_local_store(uri):
        print(f"open {runs_url(uri, tracker.experiment_id)}  (experiment {experiment} on {uri})")
        return
    print(f"open {runs_url(f'http://{HOST}:{port}', tracker.experiment_id)}  (experiment {experiment})", flush=True)
    mlflow = shutil.which("mlflow", path=str(Path(sys.executable).parent)) or "mlflow"
    os.execv(mlflow, [mlflow, "ui", "--backend-store-uri", uri, "--host", HOST, "--port", port])


if __name__ == "__main__":
    main()
