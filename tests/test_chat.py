"""Chat: turns through the chat template, the KV cache kept across turns (a turn feeds only the new
tokens, and answers exactly what a fresh run over the whole rendered conversation would), /reset,
and the `stages.chat` REPL on the real SmolLM2 through stdin."""

from __future__ import annotations

import io
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.config import ChatConfig
from pipeline.errors import ChatTemplateError, ConfigError
from pipeline.inference.chat_session import ChatSession, common_prefix
from pipeline.inference.decode import for_decoding
from pipeline.inference.generate import load_for_generation
from pipeline.inference.sampling import Sampling, generate_ids
from pipeline.modeldir import save_model_dir
from pipeline.models.llama import Llama
from pipeline.models.transformer import TransformerConfig, init_weights
from pipeline.tokenizer.chat_template import default_stop_ids, render_messages
from pipeline.tokenizer.gguf_tokenizer import GGUFTokenizer
from stages.chat import open_session, repl
from tests.conftest import ROOT, write_tiny_gguf

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def chat_files(tmp_path_factory) -> tuple[Path, Path]:
    """(model dir, tokenizer GGUF): a random 2-layer llama (context 128), the tiny byte-level tokenizer
    and ChatML template."""
    d = tmp_path_factory.mktemp("chat")
    path = write_tiny_gguf(d / "tiny.gguf", vocab=64, width=16, model=True)
    model = Llama(TransformerConfig(64, 32, 2, 4, 2, 64, 128))
    init_weights(model, 0.3, 0)
    (d / "model").mkdir()
    save_model_dir(d / "model", model)
    return d / "model", path


@pytest.fixture(scope="module")
def session_parts(chat_files: tuple[Path, Path]) -> tuple:
    model_dir, path = chat_files
    model, tok, meta = load_for_generation(str(model_dir), tokenizer_gguf=str(path))
    return model.eval(), tok, str(meta["tokenizer.chat_template"])


def test_second_turn_feeds_only_new_tokens_and_answers_as_a_fresh_run(session_parts: tuple) -> None:
    model, tok, template = session_parts
    chat = ChatSession(model, tok, template, Sampling(), max_new_tokens=3)
    pieces: list[str] = []
    first, stats1 = chat.turn("hi", pieces.append)
    assert "".join(pieces) == first and stats1.reused_tokens == 0
    assert stats1.new_prompt_tokens == stats1.prompt_tokens
    cached = list(chat.fed)
    second, stats2 = chat.turn("ok")
    ids2 = chat.fed[: stats2.prompt_tokens]
    assert stats2.reused_tokens == common_prefix(cached, ids2) > stats1.prompt_tokens  # turn 1's prompt, and more
    assert stats2.new_prompt_tokens == stats2.prompt_tokens - stats2.reused_tokens < stats2.prompt_tokens
    fresh = generate_ids(model, ids2, 3, stop_ids=default_stop_ids(tok, chat=True))
    assert tok.decode(fresh) == second
    assert [m["role"] for m in chat.messages] == ["user", "assistant", "user", "assistant"]


@pytest.mark.parametrize("precision", ["int8", "fp32"])
def test_a_packed_decoder_cuts_its_cache_back_and_answers_as_a_fresh_run(session_parts: tuple, precision: str) -> None:
    """The preallocated cache (`pipeline.inference.decode`) is cut back by moving its length."""
    model, tok, template = session_parts
    packed = for_decoding(model, precision)
    chat = ChatSession(packed, tok, template, Sampling(), max_new_tokens=3)
    chat.turn("hi")
    chat.fed[-1] = -1  # as if the answer re-tokenized differently: the cache must be cut before it
    second, stats = chat.turn("ok")
    ids2 = chat.fed[: stats.prompt_tokens]
    assert 0 < stats.reused_tokens < len(ids2) and chat.cache.length == len(chat.fed)
    assert tok.decode(generate_ids(packed, ids2, 3, stop_ids=default_stop_ids(tok, chat=True))) == second


def test_reset_and_a_full_context_drop_the_oldest_turns(session_parts: tuple) -> None:
    model, tok, template = session_parts
    chat = ChatSession(model, tok, template, Sampling(), max_new_tokens=3, system="be")
    for text in "abcdefgh":  # ~25 tokens an exchange, context 128: old exchanges go, the system turn stays
        chat.turn(text)
        assert len(chat.fed) <= model.cfg.context_length
    assert chat.messages[0] == {"role": "system", "content": "be"} and chat.messages[-2]["content"] == "h"
    assert len(chat.messages) < 17
    before = [dict(m) for m in chat.messages]
    with pytest.raises(ConfigError, match="chat message: expected a prompt of at most 125 tokens"):
        chat.turn("a" * 200)
    assert chat.messages == before  # a refused message leaves the conversation as it was
    chat.reset()
    assert chat.messages == [{"role": "system", "content": "be"}] and chat.fed == [] and chat.cache.length == 0
    _, stats = chat.turn("a")
    assert stats.reused_tokens == 0


def test_a_system_message_with_no_room_left_is_refused_at_the_start(session_parts: tuple) -> None:
    """A system message filling the context made every message, even "hi", "a prompt of at most 125 tokens,
    found 140; fix: send a shorter message": the session could answer nothing and blamed the user's line."""
    model, tok, template = session_parts
    with pytest.raises(ConfigError) as err:
        ChatSession(model, tok, template, Sampling(), max_new_tokens=3, system="a" * 130)
    message = str(err.value)
    assert message.startswith("system: expected a system message that leaves room for a message")
    assert "context_length=128" in message and "fix: shorten system" in message and "\n" not in message
    fits = ChatSession(model, tok, template, Sampling(), max_new_tokens=3, system="a" * 90)
    assert fits.turn("b")[1].prompt_tokens <= 125  # a system message that leaves room still chats


def test_max_new_tokens_over_half_the_context_is_capped_with_one_line(
    chat_files: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """The default 256 on a 128-token model left no room for any prompt: every message was refused."""
    model_dir, path = chat_files
    cfg = ChatConfig(model_path=str(model_dir), tokenizer_gguf=str(path), precision="fp32", device="cpu")
    session = open_session(cfg)
    assert cfg.max_new_tokens == 256 and session.max_new_tokens == 64
    note = capsys.readouterr().err.strip().splitlines()
    assert note == [
        "chat: max_new_tokens=256 leaves too little of the model's context_length=128 for a prompt; "
        "answers are capped at 64 tokens (half the context)"
    ]
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\n"))
    repl(session)
    assert re.search(r"chat: turn 1: \d+ new prompt tokens", capsys.readouterr().err)
    half = ChatSession(session.model, session.tok, session.template, max_new_tokens=64)
    assert half.max_new_tokens == 64 and half.note == ""  # half the context is kept as asked, no line


def test_repl_prints_a_refused_message_as_one_line_and_goes_on(
    session_parts: tuple, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    model, tok, template = session_parts
    chat = ChatSession(model, tok, template, Sampling(), max_new_tokens=3)
    monkeypatch.setattr(sys, "stdin", io.StringIO("a" * 200 + "\nhi\n"))
    repl(chat)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 2 and err[0].startswith("error: chat message: expected a prompt of at most 125 tokens")
    assert err[1].startswith("chat: turn 1: ")  # the next message is answered, numbered as the first turn
    assert [m["content"] for m in chat.messages if m["role"] == "user"] == ["hi"]


def test_chat_cli_answers_two_turns_on_smollm2_reusing_the_cache(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "stages.chat", "model_path=smollm2", "temperature=0", "max_new_tokens=12", "threads=1"]
        + [f"hydra.run.dir={tmp_path}"],
        input="What is 2+2?\nAnd 3+3?\n/quit\nnever read\n",
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    turns = re.findall(r"chat: turn (\d): (\d+) new prompt tokens, (\d+) reused from the cache", proc.stderr)
    assert [t[0] for t in turns] == ["1", "2"], proc.stderr
    (_, new1, reused1), (_, new2, reused2) = [tuple(map(int, t)) for t in turns]
    assert reused1 == 0 and reused2 >= new1 and 0 < new2 < new1  # turn 2 fed only its own message
    answers = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(answers) == 2 and "4" in answers[0], proc.stdout


def test_chat_cli_bad_model_is_one_line(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "stages.chat", "model_path=/no/such.gguf", f"hydra.run.dir={tmp_path}"],
        input="",
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: model_path=/no/such.gguf")


def test_conf_chat_yaml_matches_the_schema() -> None:
    from omegaconf import OmegaConf

    from pipeline.config import ChatConfig
    from stages._run.typed import structured_config

    on_disk = OmegaConf.load(ROOT / "conf" / "chat.yaml")
    on_disk.pop("hydra")
    on_disk.model_path = "smollm2"
    assert isinstance(structured_config(ChatConfig, on_disk), ChatConfig)
    assert set(on_disk) == set(ChatConfig.__dataclass_fields__)


def _llama3_style_tokenizer(extra: dict | None = None) -> GGUFTokenizer:
    """A byte-level vocabulary whose EOS is `<|end_of_text|>` while its turns end with `<|eot_id|>`, as
    many Llama 3 Instruct GGUFs are written."""
    tokens = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<turn_end>", *"abc"]
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "llama-bpe", "tokenizer.ggml.tokens": tokens}
    meta |= {"tokenizer.ggml.token_type": [3, 3, 3, 3, 1, 1, 1], "tokenizer.ggml.merges": []}
    meta |= {"tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 1}
    return GGUFTokenizer(meta | (extra or {}), "llama3.gguf")


def test_chat_stops_at_the_end_of_turn_token_llama_cpp_stops_at_not_only_eos() -> None:
    """A Llama 3 style donor: before, chat/generate chat=true ran past `<|eot_id|>` to max_new_tokens
    (only EOS and ChatML's `<|im_end|>` stopped it); llama.cpp stops there, and now so do we."""
    tok = _llama3_style_tokenizer()
    assert default_stop_ids(tok, chat=True) == (1, 2)
    assert default_stop_ids(tok, chat=False) == (1,)
    declared = _llama3_style_tokenizer({"tokenizer.ggml.eot_token_id": 3})  # the file names its own
    assert default_stop_ids(declared, chat=True) == (1, 3, 2)


NO_SYSTEM_TEMPLATE = (  # Mistral's: user and assistant turns only
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
    "{% elif m['role'] == 'assistant' %}{{ m['content'] + eos_token }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)


def test_a_template_without_a_system_role_says_to_leave_the_system_message_out() -> None:
    """Before: 'found an error: Only user and assistant roles are supported!; fix: fix the template in
    the GGUF, or use chat=false', though the conversation renders once system= is left out."""
    tok = _llama3_style_tokenizer()
    user = {"role": "user", "content": "a"}
    assert render_messages(tok, NO_SYSTEM_TEMPLATE, [user], True) == "<|begin_of_text|>[INST] a [/INST]"
    with pytest.raises(ChatTemplateError, match="takes a system message") as info:
        render_messages(tok, NO_SYSTEM_TEMPLATE, [{"role": "system", "content": "b"}, user], True)
    assert "system=''" in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(ChatTemplateError, match="roles are supported"):  # another role: the template's own error
        render_messages(
            tok, NO_SYSTEM_TEMPLATE, [{"role": "system", "content": "b"}, {"role": "tool", "content": "c"}], True
        )
