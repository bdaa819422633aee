"""lm-evaluation-harness on our models (`pipeline.evaluate.lmeval`): its scores equal our own forward pass's,
a local multiple-choice JSONL task runs offline through lm-eval's real evaluator, and bad input
(missing task data, a path that is not a GGUF) ends as one line."""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline.errors import ConfigError, GGUFError
from pipeline.gguf.reader import GGUFFile
from pipeline.inference.generate import load_for_generation
from pipeline.tokenizer.chat_template import render_messages
from tests.conftest import ROOT, write_tiny_gguf

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # read when `datasets` is first imported: local files only
lm_eval = pytest.importorskip("lm_eval")
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.api.registry import Registry  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from pipeline.evaluate.lmeval import MODEL_NAME, model_class  # noqa: E402
from stages.lmeval import offline_unless_hub_reachable  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

# Easy two-way questions for the tiny model's alphabet (lowercase letters, space, punctuation).
TINY_DOCS = [
    ("the cat sat on the", ["mat", "zq"], 1),
    ("one two three", ["four", "xkcd"], 1),
    ("a b c d", ["e", "qqq"], 1),
    ("hello there, how are", ["you", "zzz"], 0),
    ("the sun is", ["hot", "purple rain"], 1),
    ("red green", ["blue", "k"], 0),
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("lmeval") / "tiny.gguf", vocab=64, width=16, model=True)


def direct_logprob(model: torch.nn.Module, ids: list[int], n_cont: int) -> tuple[float, bool]:
    """The last `n_cont` tokens of `ids` scored by one plain forward pass (full logits, no batching)."""
    with torch.no_grad():
        logits = model(torch.tensor([ids[:-1]]))[0].float()
    logp = torch.log_softmax(logits, -1)[-n_cont:]
    target = torch.tensor(ids[-n_cont:])
    return float(logp.gather(1, target[:, None]).sum()), bool((logits[-n_cont:].argmax(-1) == target).all())


def ll_requests(pairs: list[tuple[str, str]]) -> list[Instance]:
    return [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]


def test_loglikelihood_is_the_sum_of_token_logprobs_of_a_forward_pass(tiny: Path) -> None:
    lm = model_class()(path=str(tiny), batch_size=3)
    model, tok, _ = load_for_generation(str(tiny))
    model.eval()
    long_context = "the cat sat on the mat and then the dog sat on the cat " * 2  # past context_length 32
    pairs = [(q, " " + c) for q, choices, _ in TINY_DOCS for c in choices[:1]] + [(long_context, "again")]
    pairs += [("the cat sat on the", one) for one in (" a", " t", "s")]  # one-token choices: one shared row
    got = lm.loglikelihood(ll_requests(pairs))
    for (context, continuation), (logprob, greedy) in zip(pairs, got):
        ctx, whole = tok.encode(context.rstrip(" ")), tok.encode(context + continuation)
        ids = whole[-(model.cfg.context_length + 1) :]  # what fits, as lm-eval's HF model truncates
        want, want_greedy = direct_logprob(model, ids, len(whole) - len(ctx))
        assert logprob == pytest.approx(want, abs=1e-4)
        assert greedy == want_greedy
    assert len({round(lp, 3) for lp, _ in got}) == len(got)  # not one number for everything


def test_rolling_loglikelihood_scores_every_token_once(tiny: Path) -> None:
    lm = model_class()(path=str(tiny), batch_size=2)
    model, tok, _ = load_for_generation(str(tiny))
    model.eval()
    short, long = "the cat sat.", "the cat sat on the mat and then the dog ran far, far away. " * 2
    got_short, got_long = lm.loglikelihood_rolling(
        [Instance("loglikelihood_rolling", {}, (t,), 0) for t in (short, long)]
    )
    ids = [tok.bos_id, *tok.encode(short)]
    assert got_short == pytest.approx(direct_logprob(model, ids, len(ids) - 1)[0], abs=1e-4)
    n_long = len(tok.encode(long))
    assert n_long > model.cfg.context_length and math.isfinite(got_long)
    first = [tok.bos_id, *tok.encode(long)][: model.cfg.context_length + 1]  # the first window, scored alone
    assert got_long < direct_logprob(model, first, len(first) - 1)[0]


def test_generate_until_is_the_product_greedy_completion_cut_at_until(tiny: Path) -> None:
    lm = model_class()(path=str(tiny))
    free = lm.generate_until([Instance("generate_until", {}, ("the cat", {"until": ["\n\n"], "max_gen_toks": 8}), 0)])
    assert len(free) == 1 and free[0]
    stop = free[0][len(free[0]) // 2 :][:1]  # a character it will produce: the text must end before it
    cut = lm.generate_until([Instance("generate_until", {}, ("the cat", {"until": [stop], "max_gen_toks": 8}), 0)])
    assert cut[0] == free[0][: free[0].index(stop)]


def write_task(folder: Path, data: Path, name: str = "tiny_mc") -> Path:
    """A multiple-choice task over a local JSONL (lm-eval's `json` dataset builder: no network)."""
    folder.mkdir(parents=True, exist_ok=True)
    yaml = (
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        f"  cache_dir: {folder / 'hf-cache'}\n"
        "test_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
    )
    (folder / f"{name}.yaml").write_text(yaml)
    return folder


def write_docs(path: Path, docs: list[tuple[str, list[str], int]]) -> Path:
    path.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in docs))
    return path


def own_accuracy(path: str, docs: list[tuple[str, list[str], int]]) -> tuple[float, list[list[float]]]:
    """The task scored by our model directly: each choice's log-likelihood after the question and
    lm-eval's " " delimiter, the highest taken as the answer."""
    model, tok, _ = load_for_generation(path)
    model.eval()
    right, scores = 0, []
    for question, choices, answer in docs:
        ctx = tok.encode(question)
        lls = [
            direct_logprob(model, tok.encode(f"{question} {c}"), len(tok.encode(f"{question} {c}")) - len(ctx))[0]
            for c in choices
        ]
        scores.append(lls)
        right += int(max(range(len(lls)), key=lls.__getitem__) == answer)
    return right / len(docs), scores


def run_task(path: str, tasks: Path, name: str = "tiny_mc") -> dict:
    model_class()
    return lm_eval.simple_evaluate(
        model=MODEL_NAME,
        model_args={"path": path},
        tasks=[name],
        task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
        batch_size=4,
        device="cpu",
        log_samples=True,
    )


def test_a_local_multiple_choice_task_through_lm_eval_scores_as_our_model_does(tiny: Path, tmp_path: Path) -> None:
    tasks = write_task(tmp_path / "tasks", write_docs(tmp_path / "tiny.jsonl", TINY_DOCS))
    out = run_task(str(tiny), tasks)
    want_acc, want_scores = own_accuracy(str(tiny), TINY_DOCS)
    assert out["results"]["tiny_mc"]["acc,none"] == pytest.approx(want_acc)
    samples = sorted(out["samples"]["tiny_mc"], key=lambda s: s["doc_id"])
    assert len(samples) == len(TINY_DOCS)
    for sample, want in zip(samples, want_scores):
        got = [float(resp[0][0]) for resp in sample["resps"]]
        assert got == pytest.approx(want, abs=1e-4)


def test_apply_chat_template_renders_the_gguf_template_and_scores_it(tiny: Path, tmp_path: Path) -> None:
    tasks = write_task(tmp_path / "tasks", write_docs(tmp_path / "tiny.jsonl", TINY_DOCS[:2]))
    model_class()
    manager = TaskManager(include_path=str(tasks), include_defaults=False)
    kwargs = {"batch_size": 4, "device": "cpu", "log_samples": True, "apply_chat_template": True}
    out = lm_eval.simple_evaluate(
        model=MODEL_NAME, model_args={"path": str(tiny)}, tasks=["tiny_mc"], task_manager=manager, **kwargs
    )
    model, tok, metadata = load_for_generation(str(tiny))
    model.eval()
    for sample in out["samples"]["tiny_mc"]:
        question = TINY_DOCS[sample["doc_id"]][0]
        want_context = render_messages(
            tok, metadata["tokenizer.chat_template"], [{"role": "user", "content": question}], True
        )
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"]):
            assert context == want_context and context.endswith("<|im_start|>assistant\n")
            # lm-eval moves the context's trailing whitespace (the template's "\n") into the continuation
            ctx, whole = tok.encode(context.rstrip()), tok.encode(context + continuation)
            fits = whole[-(model.cfg.context_length + 1) :]  # the tiny model's 32 tokens
            assert float(resp[0][0]) == pytest.approx(direct_logprob(model, fits, len(whole) - len(ctx))[0], abs=1e-4)


EASY = [
    ("The capital of France is", ["Paris", "a banana"], 0),
    ("One, two, three, four,", ["five", "purple"], 0),
    ("Water is", ["wet", "made of iron wires"], 0),
    ("The opposite of hot is", ["dry spaghetti", "cold"], 1),
    ("Monday, Tuesday,", ["Wednesday", "elephant"], 0),
    ("A dog is an", ["animal", "equation"], 0),
    ("The sky is", ["blue", "a sandwich"], 0),
    ("Ice is frozen", ["kettle", "water"], 1),
]


@pytest.mark.slow
def test_the_donor_gguf_beats_chance_on_easy_questions(smollm2_path: Path, tmp_path: Path) -> None:
    """The real Q4_1/Q8_0 donor through lm-eval: finite scores, and easy questions mostly right."""
    types = {GGUFFile(smollm2_path).tensor_info(n).ggml_type for n in GGUFFile(smollm2_path).tensor_names()}
    assert {"Q4_1", "Q8_0"} <= types
    tasks = write_task(tmp_path / "tasks", write_docs(tmp_path / "easy.jsonl", EASY), "easy_mc")
    out = run_task("smollm2", tasks, "easy_mc")
    scores = [float(r[0][0]) for s in out["samples"]["easy_mc"] for r in s["resps"]]
    assert len(scores) == 2 * len(EASY) and all(math.isfinite(s) and s < 0 for s in scores)
    assert out["results"]["easy_mc"]["acc,none"] >= 0.75


def test_the_declared_entry_point_loads_the_registered_model_class() -> None:
    """pyproject's `lm_eval.models` entry point, resolved the way lm-eval's registry resolves one."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    target = meta["entry-points"]["lm_eval.models"][MODEL_NAME]
    registry = Registry("model")
    registry.register(MODEL_NAME, target=importlib.metadata.EntryPoint(MODEL_NAME, target, "lm_eval.models"))
    cls = registry.get(MODEL_NAME)
    assert cls is model_class() and issubclass(cls, lm_eval.api.model.TemplateLM)
    assert lm_eval.api.registry.get_model(MODEL_NAME) is cls
    assert meta["scripts"]["smollm-lm-eval"] == "stages.lmeval:main"


def test_registering_ours_keeps_lm_evals_own_models() -> None:
    """lm-eval 0.4.13 fills its model registry only when it is empty: ours must not hide `hf` & co."""
    code = (
        "from pipeline.evaluate.lmeval import model_class\nmodel_class()\n"
        "from lm_eval.api.registry import model_registry\nprint(sorted(model_registry.keys()))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert {"hf", "gguf", "dummy", MODEL_NAME} <= set(eval(out.stdout))


def test_a_path_that_is_not_a_gguf_is_one_named_error(tmp_path: Path) -> None:
    text = tmp_path / "notes.gguf"
    text.write_text("not a model\n")
    with pytest.raises(GGUFError, match="notes.gguf: expected a GGUF file"):
        model_class()(path=str(text))
    with pytest.raises(ConfigError, match="path=.*missing.gguf: expected a GGUF file or model directory"):
        model_class()(path=str(tmp_path / "missing.gguf"))
    with pytest.raises(ConfigError, match="--model_args: expected keys among path, .* found pretrained"):
        model_class()(path=str(text), pretrained="gpt2")


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("SMOLLM_TRACEBACK", None)
    cmd = [sys.executable, "-m", "stages.lmeval", "--model", MODEL_NAME, *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_cli_runs_the_task_and_refuses_bad_input_on_one_line(tiny: Path, tmp_path: Path) -> None:
    tasks = write_task(tmp_path / "tasks", write_docs(tmp_path / "tiny.jsonl", TINY_DOCS))
    ok = cli("--model_args", f"path={tiny}", "--tasks", "tiny_mc", "--include_path", str(tasks), cwd=ROOT)
    assert ok.returncode == 0, ok.stderr[-2000:]
    want_acc, _ = own_accuracy(str(tiny), TINY_DOCS)
    row = next(line for line in ok.stdout.splitlines() if line.startswith("|tiny_mc"))
    assert float(row.split("|")[7]) == pytest.approx(want_acc, abs=1e-4)

    missing = write_task(tmp_path / "bad", tmp_path / "nowhere.jsonl", "tiny_missing")
    bad = cli("--model_args", f"path={tiny}", "--tasks", "tiny_missing", "--include_path", str(missing), cwd=ROOT)
    last = bad.stderr.strip().splitlines()[-1]
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert last.startswith("error: lm_eval") and "FileNotFoundError" in last and "nowhere.jsonl" in last
    assert "; fix: " in last

    text = tmp_path / "model.gguf"
    text.write_text("not a model\n")
    notgguf = cli("--model_args", f"path={text}", "--tasks", "tiny_mc", "--include_path", str(tasks), cwd=ROOT)
    assert notgguf.returncode == 2 and "Traceback" not in notgguf.stderr
    assert notgguf.stderr.strip().splitlines()[-1].startswith(f"error: {text}: expected a GGUF file")


def test_a_hub_task_without_a_network_is_one_line_naming_the_download(tiny: Path, tmp_path: Path) -> None:
    """--tasks arc_easy (or any Hub dataset) on a machine without a network ended in a 60-line
    ConnectionError traceback (after ~40 s of retries without HF_HUB_OFFLINE)."""
    folder = tmp_path / "hub"
    folder.mkdir()
    (folder / "hub_mc.yaml").write_text(
        "task: hub_mc\ndataset_path: allenai/ai2_arc\ndataset_name: ARC-Easy\n"
        f"dataset_kwargs:\n  cache_dir: {folder / 'hf-cache'}\n"
        "test_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices.text}}"\ndoc_to_target: 0\n'
        "metric_list:\n  - metric: acc\n"
    )
    out = cli("--model_args", f"path={tiny}", "--tasks", "hub_mc", "--include_path", str(folder), cwd=ROOT)
    last = out.stderr.strip().splitlines()[-1]
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert last.startswith("error: lm_eval") and "allenai/ai2_arc" in last
    assert "later runs without the Hub use the cache" in last
    assert " run --model" not in last  # the command as typed, not as lm-eval rewrote it


def test_an_unreachable_hub_switches_to_offline_at_once_unless_the_user_chose(monkeypatch) -> None:
    """Without a network, `datasets` retried the Hub for ~40 s before failing, even for a cached dataset."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "https://hub.nonexistent.invalid")  # RFC 6761: never resolves
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy:3128")  # the Hub may be reachable through it: no probe
    assert not offline_unless_hub_reachable() and "HF_HUB_OFFLINE" not in os.environ
    monkeypatch.delenv("HTTPS_PROXY")
    assert offline_unless_hub_reachable()
    assert os.environ["HF_HUB_OFFLINE"] == os.environ["HF_DATASETS_OFFLINE"] == "1"
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # the user's choice stands
    assert not offline_unless_hub_reachable() and os.environ["HF_HUB_OFFLINE"] == "0"


def test_without_lm_eval_the_command_names_the_extra_to_install() -> None:
    code = (
        "import sys\nsys.modules['lm_eval'] = None  # as if the [eval] extra were not installed\n"
        "sys.argv = ['smollm-lm-eval', '--tasks', 'hellaswag']\nfrom stages.lmeval import main\nmain()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert out.stderr.startswith("error: --model smollm-gguf: expected lm-eval installed") and ".[eval]" in out.stderr
