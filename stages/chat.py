"""chat: a multi-turn REPL with a model and its GGUF chat template, answers streamed as they come.

`python -m stages.chat model_path=smollm2` (or models/export/model.gguf). Reads one message per
line from stdin; `/reset` starts over, `/quit` or end of input leaves. The answer goes to stdout;
a line per turn on stderr says how many prompt tokens were fed and how many came from the KV cache.
A max_new_tokens over half the model's context is capped there (a line says so); a message too long
for the context is one `error:` line and the next message is read. Not a DVC stage and no MLflow run.
"""

from __future__ import annotations

import sys

import hydra
import torch
from omegaconf import DictConfig

from pipeline.config import ChatConfig
from pipeline.errors import PipelineError
from pipeline.inference.chat_session import ChatSession, TurnStats
from pipeline.inference.decode import for_decoding
from pipeline.inference.generate import chat_prompt, load_for_generation
from pipeline.inference.sampling import Sampling
from pipeline.models.devices import pick_device
from stages._run.exits import entry, fail
from stages._run.lifecycle import CONFIG_PATH
from stages._run.typed import structured_config

# A base model (Gemma 3 270M's GGUF) carries no chat template: its turns are continued as plain text,
# each message where the last answer stopped, and the REPL says so.
PLAIN_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% if not loop.last %}\n{% endif %}{% endfor %}"
PLAIN_NOTE = (
    "chat: {name} has no chat template (tokenizer.chat_template): a base model. Each message is continued "
    "as plain text after the conversation so far; for an instruct template pass tokenizer_gguf=<a GGUF with one>"
)


def open_session(cfg: ChatConfig) -> ChatSession:
    """The model, its tokenizer and chat template; a GGUF without one chats in plain text, saying so."""
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    model, tok, metadata = load_for_generation(cfg.model_path, cfg.tokenizer_gguf, cfg.lora)
    model = for_decoding(model, cfg.precision, pick_device(cfg.device))
    sampling = Sampling(cfg.temperature, cfg.top_k, cfg.top_p, cfg.repetition_penalty, cfg.repetition_last_n, cfg.seed)
    template = metadata.get("tokenizer.chat_template")
    if template:
        chat_prompt(metadata, tok, "hi")  # a template that does not render is a one-line error, now
    else:
        print(PLAIN_NOTE.format(name=cfg.tokenizer_gguf or cfg.model_path), file=sys.stderr, flush=True)
    session = ChatSession(model, tok, str(template or PLAIN_TEMPLATE), sampling, cfg.max_new_tokens, cfg.system)
    if session.note:  # max_new_tokens capped to leave room for a prompt in a small context
        print(session.note, file=sys.stderr, flush=True)
    return session


def report(n: int, stats: TurnStats) -> str:
    rate = stats.answer_tokens / stats.seconds if stats.seconds > 0 else 0.0
    return (
        f"chat: turn {n}: {stats.new_prompt_tokens} new prompt tokens, {stats.reused_tokens} reused from the cache, "
        f"{stats.answer_tokens} answer tokens ({stats.stop_reason}), {rate:.1f} tokens/s"
    )


def repl(session: ChatSession) -> None:
    """Read messages until /quit or end of input; stream each answer to stdout. A message the
    session refuses (too long for the context) is one `error:` line, and the session goes on."""
    interactive = sys.stdin.isatty()
    n = 0
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() == "/quit":
            return
        text = line.rstrip("\n")
        if text.strip() == "/reset":
            session.reset()
            n = 0
            print("chat: conversation reset", file=sys.stderr, flush=True)
            continue
        if not text.strip():
            continue
        try:
            _, stats = session.turn(text, lambda piece: print(piece, end="", flush=True))
        except PipelineError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            continue
        n += 1
        print(flush=True)
        print(report(n, stats), file=sys.stderr, flush=True)


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="chat")
def main(cfg: DictConfig) -> None:
    try:
        repl(open_session(structured_config(ChatConfig, cfg, "conf/chat.yaml")))
    except PipelineError as e:
        fail(str(e))


if __name__ == "__main__":
    entry(main)
