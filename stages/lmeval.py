"""lm-evaluation-harness with our model registered: `python -m stages.lmeval` takes lm-eval's own
arguments (console script `smollm-lm-eval`), e.g.

    python -m stages.lmeval --model smollm-gguf --model_args path=models/export/model.gguf \\
        --tasks hellaswag,arc_easy,piqa --batch_size 16

lm-eval 0.4.13 (the newest on PyPI) loads no model plugins, so this registers `smollm-gguf`
(`pipeline.evaluate.lmeval`) and then runs lm-eval's CLI. A user mistake lm-eval or we refuse (a task whose
data is missing, a path that is not a GGUF) ends as one `error:` line and exit 2, lm-eval's own
message kept on that line. Not a DVC stage and no MLflow run.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from urllib.parse import urlparse

from pipeline.errors import PipelineError, one_line, problem
from pipeline.evaluate.lmeval import lm_eval_module, model_class
from stages._run.exits import fail

# What lm-eval raises for a task it cannot build (missing data files, an unknown task or dataset,
# a malformed task YAML): passed through on one line. Anything else is a bug and keeps its traceback.
USER_ERRORS = (FileNotFoundError, NotADirectoryError, PermissionError, ValueError, KeyError)
PROXY_VARS = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")
log = logging.getLogger("stages.lmeval")


def offline_unless_hub_reachable(timeout: float = 3.0) -> bool:
    """Without a network, `datasets` retries the Hub for ~40 s before it fails (and before a cached dataset
    is used at all); one quick connect decides it first. Set before lm-eval imports huggingface_hub and
    datasets, which read these variables once. Skipped when the user chose (HF_*_OFFLINE) or a proxy is set
    (the Hub may be reachable only through it). True when it switched to offline."""
    if any(v in os.environ for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", *PROXY_VARS)):
        return False
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return False
    except OSError as e:
        os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
        log.warning(f"lmeval: {host} unreachable ({e}): running offline, with cached or local datasets only")
        return True


def run(argv: list[str]) -> None:
    """lm-eval's CLI on `argv` (without the program name), `smollm-gguf` registered first."""
    offline_unless_hub_reachable()
    model_class()
    harness = lm_eval_module("lm_eval.__main__")
    sys.argv = ["lm_eval", *argv]
    harness.cli_evaluate()


def _where(argv: list[str]) -> str:
    """The command for the error line, its --tasks first: a long --model_args path hid them."""
    tasks = next((a.split("=", 1)[1] for a in argv if a.startswith("--tasks=")), None)
    if tasks is None and "--tasks" in argv[:-1]:
        tasks = argv[argv.index("--tasks") + 1]
    return ("lm_eval" + (f" --tasks {tasks}" if tasks else "") + " " + " ".join(argv))[:160]


def main() -> None:
    argv = sys.argv[1:]  # lm-eval rewrites sys.argv (it inserts its `run` subcommand)
    try:
        run(argv)
    except PipelineError as e:
        fail(str(e))
    except (ConnectionError, TimeoutError, *USER_ERRORS) as e:
        if os.environ.get("SMOLLM_TRACEBACK"):
            raise
        fail(problem(_where(argv), *_explain(e)))


def _explain(e: Exception) -> tuple[str, str, str]:
    """(expected, found, fix) for a harness failure a user can mend: no network for a Hub dataset, or bad
    tasks and arguments."""
    if isinstance(e, (ConnectionError, TimeoutError)):  # a Hub dataset (hellaswag, arc_easy, ...) offline
        return (
            "each task's dataset on this machine (cached, or local files)",
            f"no way to download it: {one_line(e, 200)}",
            "run once where the Hugging Face Hub is reachable (datasets caches it under ~/.cache/huggingface; "
            "later runs without the Hub use the cache), or a task YAML over local files (--include_path)",
        )
    return (
        "tasks whose data loads and valid arguments",
        f"{type(e).__name__}: {one_line(e, 300)}",
        "check the task's dataset_path / data_files (hub datasets need a network), or rerun with "
        "SMOLLM_TRACEBACK=1 for the traceback",
    )


if __name__ == "__main__":
    main()
