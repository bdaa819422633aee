"""LoRA under torchrun: two gloo processes, each with half of every batch, train the adapters to the
losses one process reaches on the whole batch (DDP all-reduces only the adapters' gradients, each
rank's weighted by its share of the batch's response tokens)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.config import OptimConfig, TrainConfig
from pipeline.data.packed import load_meta
from pipeline.init.realize import realize_finetune
from pipeline.training.loop import TrainJob
from pipeline.training.trainer import TrainInputs, run_train
from tests.test_finetune import OPTIM, RECIPES, base, packed  # noqa: F401 (fixtures)

ROOT = Path(__file__).resolve().parent.parent
# fp32: in bf16 the two ranks' one-row matmuls round differently from one process's two-row ones
# (5.7e-4 apart by step 4 at this learning rate), which is not what this test is about
TRAIN = dict(steps=4, batch_size=2, seq_len=64, eval_every=2, log_every=1, threads=1, precision="fp32")

# one rank of the job: the library's train stage body, rank 0 writes the per-step losses
DRIVER = """
import json, sys
from pathlib import Path
from pipeline.config import OptimConfig, TrainConfig
from pipeline.training.loop import TrainJob
from pipeline.training.trainer import TrainInputs, run_train
from pipeline.training.distributed import is_main_process
init, packed, out, losses = map(Path, sys.argv[1:5])
optim = OptimConfig(**json.loads(sys.argv[6]))
result = run_train(TrainInputs(init, packed, out), TrainJob(TrainConfig(**json.loads(sys.argv[5])), optim, 0))
if is_main_process():
    losses.write_text(json.dumps([h["train_loss"] for h in result.history]))
"""


def optim_kwargs(optim: OptimConfig) -> dict:
    return {"lr": optim.lr, "warmup_steps": optim.warmup_steps}


@pytest.mark.slow
def test_lora_two_processes_match_one_process(tmp_path: Path, base, packed: Path) -> None:  # noqa: F811
    init = tmp_path / "init"
    realize_finetune(RECIPES["lora"], base.f32, load_meta(packed).vocab_size, init)
    optim = OptimConfig(**optim_kwargs(OPTIM["lora"]))
    single = run_train(TrainInputs(init, packed, tmp_path / "single"), TrainJob(TrainConfig(**TRAIN), optim, 0))
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    losses = tmp_path / "losses.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(driver)]
    cmd += [
        str(init),
        str(packed),
        str(tmp_path / "ddp"),
        str(losses),
        json.dumps(TRAIN),
        json.dumps(optim_kwargs(optim)),
    ]
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    two = json.loads(losses.read_text())
    one = [h["train_loss"] for h in single.history]
    assert len(two) == len(one) == TRAIN["steps"]
    assert two == pytest.approx(one, abs=1e-4)
    assert len(set(one)) > 1  # the adapters moved: the losses change from step to step
