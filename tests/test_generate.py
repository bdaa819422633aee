"""Generation: llama.cpp-style sampler pieces, stops, seeds, the KV cache, chat templates, the CLI."""

from __future__ import annotations

import io
import json
import math
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from pipeline.config import GenerateConfig
from pipeline.errors import ChatTemplateError, ConfigError, PipelineError
from pipeline.gguf.reader import GGUFFile
from pipeline.inference.decode import for_decoding
from pipeline.inference.generate import chat_prompt, encode_prompt, load_for_generation, run_generate, unescape
from pipeline.inference.sampling import (
    Sampling,
    complete,
    find_stop,
    generate_ids,
    penalize_repetition,
    pick_next,
    top_k_filter,
    top_p_filter,
)
from pipeline.modeldir import load_model_dir, save_model_dir
from pipeline.models.llama import Llama
from pipeline.models.transformer import KVCache, TransformerConfig, init_weights
from pipeline.tokenizer.chat_template import default_stop_ids, render_chat
from pipeline.tokenizer.gguf_tokenizer import GGUFTokenizer, tokenizer_from_gguf
from stages._run.typed import structured_config
from stages.generate import with_prompt

ROOT = Path(__file__).resolve().parent.parent  # not `from tests.conftest`: works under plain `pytest` too


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One torch thread here: these models are tiny (threads only add OpenMP hand-offs, which cost
    seconds on a busy 2-core machine), and the CLI test compares ids across processes with threads=1."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class ScriptedModel(nn.Module):
    """A stand-in model: the last position's logits are `next_logits(total tokens so far)`. It
    fills the KV cache like a real one, so generation's cache bookkeeping is exercised."""

    def __init__(self, next_logits: Callable[[int], torch.Tensor], context_length: int = 64):
        super().__init__()
        self.cfg = SimpleNamespace(context_length=context_length, n_layer=1)
        self.next_logits = next_logits
        self.dummy = nn.Parameter(torch.zeros(1))

    def forward(self, idx: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        t = idx.shape[1]
        end = t if cache is None else cache.length + t
        if cache is not None:
            cache.append(0, torch.zeros(1, 1, t, 1), torch.zeros(1, 1, t, 1))
        last = self.next_logits(end)
        return torch.cat((torch.zeros(1, t - 1, last.numel()), last.view(1, 1, -1)), dim=1)


def scripted(script: list[int], prompt_len: int, vocab: int = 32) -> ScriptedModel:
    """Emits `script` one id after another (then id vocab-1) whatever the sampling settings."""

    def next_logits(end: int) -> torch.Tensor:
        pos = end - prompt_len
        logits = torch.zeros(vocab)
        logits[script[pos] if pos < len(script) else vocab - 1] = 50.0
        return logits

    return ScriptedModel(next_logits)


def letters(ids: list[int]) -> str:
    return "".join(chr(ord("a") + i) if i < 26 else " " for i in ids)


def to_ids(text: str) -> list[int]:
    return [ord(c) - ord("a") if c != " " else 26 for c in text]


def tiny_llama(context_length: int = 16, seed: int = 0) -> Llama:
    cfg = TransformerConfig(
        vocab_size=64, d_model=32, n_layer=2, n_head=4, n_kv_head=2, d_ff=64, context_length=context_length
    )
    model = Llama(cfg)
    init_weights(model, 0.3, seed)  # a large std so the logits are far from uniform
    return model.eval()


# ----- sampler pieces on hand-made logits -----


def test_top_k_keeps_exactly_the_k_largest() -> None:
    out = top_k_filter(torch.tensor([1.0, 5.0, 3.0, 4.0, 2.0]), 2)
    assert torch.isfinite(out).nonzero().flatten().tolist() == [1, 3]
    assert out[1] == 5.0 and out[3] == 4.0
    tied = top_k_filter(torch.tensor([1.0, 5.0, 5.0, 5.0]), 2)
    assert int(torch.isfinite(tied).sum()) == 2
    same = torch.tensor([1.0, 2.0])
    assert torch.equal(top_k_filter(same, 0), same) and torch.equal(top_k_filter(same, 5), same)


@pytest.mark.parametrize(("p", "kept"), [(0.45, 1), (0.7, 2), (0.85, 3), (0.97, 4), (1.0, 4)])
def test_top_p_keeps_the_smallest_set_reaching_p(p: float, kept: int) -> None:
    probs = torch.tensor([0.15, 0.5, 0.05, 0.3])  # sorted: 0.5, 0.3, 0.15, 0.05
    out = top_p_filter(probs.log(), p)
    survivors = set(torch.isfinite(out).nonzero().flatten().tolist())
    assert survivors == set(torch.argsort(probs, descending=True)[:kept].tolist())


@pytest.mark.parametrize("seed", range(5))
def test_top_p_matches_a_brute_force_nucleus(seed: int) -> None:
    logits = torch.randn(50, generator=torch.Generator().manual_seed(seed)) * 2
    for p in (0.1, 0.5, 0.9):
        probs = torch.softmax(logits, -1).double()
        order = torch.argsort(probs, descending=True)
        k = next(k for k in range(1, 51) if probs[order[:k]].sum() >= p)  # smallest set reaching p
        kept = set(torch.isfinite(top_p_filter(logits, p)).nonzero().flatten().tolist())
        assert kept == set(order[:k].tolist())


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits() -> None:
    logits = torch.tensor([2.0, -1.0, 0.5, -3.0])
    out = penalize_repetition(logits, [0, 1, 1], 2.0)
    assert out.tolist() == [1.0, -2.0, 0.5, -3.0]
    assert logits.tolist() == [2.0, -1.0, 0.5, -3.0]  # not modified in place
    assert torch.equal(penalize_repetition(logits, [0, 1], 1.0), logits)


def test_greedy_pick_takes_the_penalized_argmax() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.tensor([3.0, 2.0, -1.0])
    assert pick_next(logits, 0.0, 1, gen) == 0
    assert pick_next(logits, 0.0, 0, gen, repetition_penalty=2.0, seen=[0]) == 1


@pytest.mark.parametrize(("last_n", "expected"), [(0, [0, 0, 0, 0, 0]), (1, [0, 1, 0, 1, 0]), (-1, [0, 1, 0, 0, 0])])
def test_repetition_penalty_looks_back_over_its_window(last_n: int, expected: list[int]) -> None:
    fixed = torch.full((8,), -5.0)
    fixed[0], fixed[1] = 3.0, 2.0
    model = ScriptedModel(lambda end: fixed.clone())
    out = generate_ids(model, [5], 5, repetition_penalty=2.0, repetition_last_n=last_n)
    assert out == expected


def test_sampling_stays_inside_top_k_and_top_p() -> None:
    logits = torch.tensor([2.0, 1.9, 1.8, 0.0, -1.0, 1.7])
    gen = torch.Generator().manual_seed(0)
    drawn_k = {pick_next(logits, 1.0, 2, gen) for _ in range(300)}
    assert drawn_k == {0, 1}
    nucleus = set(torch.isfinite(top_p_filter(logits, 0.5)).nonzero().flatten().tolist())
    drawn_p = {pick_next(logits, 1.0, 0, gen, top_p=0.5) for _ in range(300)}
    assert drawn_p == nucleus and len(nucleus) < logits.numel()


def test_seeded_sampling_is_reproducible() -> None:
    model = tiny_llama(context_length=64)
    a = generate_ids(model, [1, 2, 3], 20, temperature=1.5, top_k=0, seed=7)
    b = generate_ids(model, [1, 2, 3], 20, temperature=1.5, top_k=0, seed=7)
    c = generate_ids(model, [1, 2, 3], 20, temperature=1.5, top_k=0, seed=8)
    assert a == b and len(a) == 20
    assert a != c


# ----- stops -----


def test_find_stop_returns_the_earliest_stop() -> None:
    assert find_stop("hello world", ["world", "lo"]) == 3
    assert find_stop("hello", ["xyz", ""]) is None


def test_command_line_escapes_in_stop_strings() -> None:
    assert unescape(r"\n\n") == "\n\n" and unescape(r"a\tb\\n") == "a\tb\\n" and unescape("é\\x") == "é\\x"


def test_stop_string_trims_the_completion() -> None:
    script = to_ids("hello world again")
    done = complete(scripted(script, 1), letters, [0], 30, Sampling(), stop_strings=["lo w", "again"])
    assert done.text == "hel" and done.stop_reason == "stop_string"
    assert letters(done.ids) == "hello w"  # generation ended on the token that completed the stop string


def test_stop_id_ends_generation_and_is_not_included() -> None:
    script = to_ids("abc") + [30, 4, 5]
    done = complete(scripted(script, 2), letters, [0, 1], 30, Sampling(), stop_ids=[30])
    assert done.ids == to_ids("abc") and done.text == "abc" and done.stop_reason == "stop_id"
    assert generate_ids(scripted(script, 2), [0, 1], 30, 0.0, 0, 0, (30,)) == to_ids("abc")  # evaluate's call


def test_max_new_tokens_ends_generation() -> None:
    done = complete(scripted(to_ids("abcdef"), 1), letters, [0], 4, Sampling(), stop_strings=["zz"])
    assert done.text == "abcd" and done.stop_reason == "length"


# ----- the KV cache -----


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_cache_and_recompute_give_identical_ids_through_the_sliding_window(temperature: float) -> None:
    model = tiny_llama(context_length=16)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    kw = {"temperature": temperature, "top_k": 0, "seed": 3}
    cached = generate_ids(model, prompt, 24, use_cache=True, **kw)  # 32 tokens > context 16
    fresh = generate_ids(model, prompt, 24, use_cache=False, **kw)
    assert cached == fresh and len(cached) == 24


def test_greedy_is_the_argmax_of_a_full_forward() -> None:
    model = tiny_llama(context_length=32)
    prompt = [7, 8, 9]
    out = generate_ids(model, prompt, 6)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out]))[0]
    assert logits[len(prompt) - 1 : -1].argmax(-1).tolist() == out


# ----- chat templates -----


USER = "What is 2+2?"


@pytest.fixture(scope="module")
def smol_tok(smollm2: GGUFFile) -> GGUFTokenizer:
    return tokenizer_from_gguf(smollm2)


def test_smollm2_chat_template_renders_chatml(smollm2: GGUFFile, smol_tok: GGUFTokenizer) -> None:
    text = chat_prompt(smollm2.metadata, smol_tok, USER)
    assert text.startswith("<|im_start|>system\n")  # the template's default system turn
    assert text.endswith(f"<|im_start|>user\n{USER}<|im_end|>\n<|im_start|>assistant\n")
    with_system = chat_prompt(smollm2.metadata, smol_tok, USER, system="Be brief.")
    assert with_system == f"<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n{USER}<|im_end|>\n" + (
        "<|im_start|>assistant\n"
    )
    template = smollm2.metadata["tokenizer.chat_template"]
    no_gen = render_chat(template, [{"role": "user", "content": USER}], "", "", add_generation_prompt=False)
    assert no_gen.endswith("<|im_end|>\n") and "<|im_start|>assistant" not in no_gen
    ids = encode_prompt(smol_tok, text, 8192)
    start, end = smol_tok.token_to_id("<|im_start|>"), smol_tok.token_to_id("<|im_end|>")
    assert ids.count(start) == 3 and ids.count(end) == 2  # special tokens recognised as single ids
    assert end in default_stop_ids(smol_tok, chat=True)


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ cycler.__init__.__globals__ }}",
        "{{ ''.__class__ }}",
        "{% for c in ''.__class__.__mro__[1].__subclasses__() %}{{ c }}{% endfor %}",
        "{% if joiner.__init__ %}x{% endif %}",
        "{{ messages.append({'role': 'system'}) }}",
    ],
)
def test_templates_escaping_the_sandbox_are_refused(template: str) -> None:
    with pytest.raises(ChatTemplateError) as err:
        render_chat(template, [{"role": "user", "content": "hi"}], "<s>", "</s>", source="evil.gguf chat template")
    message = str(err.value)
    assert message.startswith("evil.gguf chat template:") and "sandbox" in message and "\n" not in message


def test_template_errors_are_one_line(smollm2: GGUFFile, smol_tok: GGUFTokenizer) -> None:
    with pytest.raises(ChatTemplateError, match="only user turns"):
        render_chat("{{ raise_exception('only user turns') }}", [], "", "")
    with pytest.raises(ChatTemplateError, match="syntax error"):
        render_chat("{% if %}", [], "", "")
    no_template = {k: v for k, v in smollm2.metadata.items() if k != "tokenizer.chat_template"}
    with pytest.raises(ChatTemplateError, match="chat=true"):
        chat_prompt(no_template, smol_tok, USER)


# ----- config, inputs, checkpoints -----


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -1),
        ("repetition_penalty", 0.0),
        ("max_new_tokens", 0),
        ("repetition_last_n", -2),
        ("precision", "fp8"),
    ],
)
def test_generate_config_rejects_out_of_range_values(key: str, value: object) -> None:
    cfg = OmegaConf.create({"model_path": "smollm2", "prompt": "hi", key: value})
    with pytest.raises(ConfigError) as err:
        structured_config(GenerateConfig, cfg, "conf/generate.yaml")
    assert key in str(err.value) and "\n" not in str(err.value)


def test_conf_generate_yaml_matches_the_schema() -> None:
    on_disk = OmegaConf.load(ROOT / "conf" / "generate.yaml")
    on_disk.pop("hydra")
    on_disk.model_path, on_disk.prompt = "smollm2", "hi"
    assert isinstance(structured_config(GenerateConfig, on_disk), GenerateConfig)
    assert set(on_disk) == set(GenerateConfig.__dataclass_fields__)


def test_prompt_longer_than_the_context_is_refused(smol_tok: GGUFTokenizer) -> None:
    with pytest.raises(ConfigError, match="context_length=16"):
        encode_prompt(smol_tok, "word " * 40, 16)


def test_checkpoint_directory_generates_with_the_named_tokenizer(tmp_path: Path, smol_tok: GGUFTokenizer) -> None:
    cfg = TransformerConfig(
        vocab_size=smol_tok.vocab_size, d_model=16, n_layer=1, n_head=2, n_kv_head=1, d_ff=32, context_length=32
    )
    model = Llama(cfg)
    init_weights(model, 0.02, 0)
    save_model_dir(tmp_path, model)
    result = run_generate(GenerateConfig(model_path=str(tmp_path), prompt="Hello", max_new_tokens=4, stop_ids=[]))
    assert result["prompt_ids"] == smol_tok.encode("Hello")
    assert result["ids"] == generate_ids(load_model_dir(tmp_path), result["prompt_ids"], 4)
    assert result["n_tokens"] == 4 and result["completion"] == smol_tok.decode(result["ids"])
    too_big = smol_tok.vocab_size
    with pytest.raises(ConfigError, match=rf"^stop_ids: expected token ids in \[0, {too_big}\).*found -1, {too_big};"):
        run_generate(GenerateConfig(model_path=str(tmp_path), prompt="Hello", stop_ids=[2, -1, too_big]))


def test_missing_model_path_is_a_pipeline_error(tmp_path: Path) -> None:
    with pytest.raises(PipelineError, match="no such file or directory"):
        load_for_generation(str(tmp_path / "nope.gguf"))


# ----- the stage CLI on SmolLM2 -----


PROMPT = "The capital of France is"


def _cli(tmp: Path, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "stages.generate", *overrides, f"hydra.run.dir={tmp}"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.fixture(scope="module")
def cli_greedy(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.Popen, Path]:
    """Started first, so the subprocess loads SmolLM2 while this process loads it too."""
    out = tmp_path_factory.mktemp("generate")
    return _cli(out, "model_path=smollm2", f"prompt={PROMPT}", "max_new_tokens=8", "threads=1"), out


@pytest.fixture(scope="module")
def smol_model(smollm2: GGUFFile) -> nn.Module:
    from pipeline.models.llama_gguf import load_llama

    return load_llama(smollm2)[0].eval()


def test_cli_greedy_completion_equals_the_library(
    cli_greedy: tuple[subprocess.Popen, Path], smol_model: nn.Module, smol_tok: GGUFTokenizer
) -> None:
    proc, out = cli_greedy
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    ids = smol_tok.encode(PROMPT)
    expected = generate_ids(for_decoding(smol_model, "int8"), ids, 8, stop_ids=(smol_tok.eos_id,))  # the default
    result = json.loads((out / "generate.json").read_text())
    assert result["prompt_ids"] == ids and result["ids"] == expected
    assert result["completion"] == smol_tok.decode(expected) and result["completion"] in stdout
    assert result["completion"].strip() and math.isfinite(result["tokens_per_s"]) and result["tokens_per_s"] > 0


@pytest.mark.parametrize(
    ("overrides", "start"),
    [
        (["model_path=/no/such/model.gguf", "prompt=hi"], "error: model_path=/no/such/model.gguf"),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(tmp_path: Path, overrides: list[str], start: str) -> None:
    proc = _cli(tmp_path, *overrides)
    _, stderr = proc.communicate(timeout=120)
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(start), stderr


@pytest.mark.parametrize("tool", ["generate", "chat"])
def test_help_shows_the_tools_own_keys_not_the_pipelines_groups(tool: str) -> None:
    """Hydra's default help listed conf/'s groups (data, model, preset...), which neither tool reads."""
    out = subprocess.run(
        [sys.executable, "-m", f"stages.{tool}", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert f"Usage: python -m stages.{tool} model_path=" in out.stdout and "model_path: ???" in out.stdout
    assert "Configuration groups" not in out.stdout and "preset:" not in out.stdout


def test_free_text_prompts_come_from_a_file_or_stdin(tmp_path, monkeypatch) -> None:
    text = 'Hello, world! "quoted" {braces} = [brackets]\nsecond line'
    (tmp_path / "p.txt").write_text(text + "\n")
    assert with_prompt(GenerateConfig(model_path="m", prompt_file=str(tmp_path / "p.txt"))).prompt == text
    monkeypatch.setattr("sys.stdin", io.StringIO(text))
    assert with_prompt(GenerateConfig(model_path="m", prompt_file="-")).prompt == text
    with pytest.raises(PipelineError, match="prompt_file=.*nope.txt: expected a readable UTF-8 text file"):
        with_prompt(GenerateConfig(model_path="m", prompt_file=str(tmp_path / "nope.txt")))
    with pytest.raises(PipelineError, match="prompt / prompt_file: expected one of them, found 'both'"):
        GenerateConfig(model_path="m", prompt="a", prompt_file="b")


def test_an_adapter_given_as_the_model_is_named_with_the_lora_fix(tmp_path: Path) -> None:
    """`model_path=models/export/adapter.gguf` said 'expected metadata key llama.embedding_length, found it is
    missing; fix: use a complete GGUF', and `model_path=models/export/peft` 'peft/config.json: expected a saved
    model file; fix: run the stage that writes it'; both are adapters, whose place is `lora=`."""
    import numpy as np

    from pipeline.gguf.writer import write_gguf

    gguf = tmp_path / "adapter.gguf"
    a, b = np.zeros((8, 16), np.float32), np.zeros((16, 8), np.float32)
    tensors = {"blk.0.attn_q.weight.lora_a": a, "blk.0.attn_q.weight.lora_b": b}
    write_gguf(gguf, "llama", {"general.type": "adapter", "adapter.type": "lora"}, tensors, dtype="f32")
    peft = tmp_path / "peft"
    peft.mkdir()
    (peft / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    for path in (gguf, peft):
        with pytest.raises(ConfigError) as err:
            load_for_generation(str(path))
        assert str(err.value) == (
            f"model_path={path}: expected a model (a GGUF or a model directory), found a LoRA adapter, which holds "
            f"no base weights; fix: give the base as model_path and this as lora, e.g. model_path=smollm2 lora={path}"
        )


def test_a_folder_that_is_no_model_is_named_as_one(tmp_path: Path) -> None:
    """It said '<dir>/config.json: expected a saved model file; fix: run the stage that writes it'."""
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(ConfigError) as err:
        load_for_generation(str(tmp_path))
    assert str(err.value) == (
        f"model_path={tmp_path}: expected a GGUF file or a model directory (config.json + model.safetensors, as "
        "realize and train write), found a directory without config.json; fix: point model_path at a .gguf (e.g. "
        "models/export/model.gguf) or at models/train"
    )
