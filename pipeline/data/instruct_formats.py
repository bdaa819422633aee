"""The instruction-data shapes people publish, read as one conversation (`[{role, content}, ...]` ending
with the assistant's answer): `{"prompt","response"}`, TRL's `{"prompt","completion"}`, Alpaca's
`{"instruction","input","output"}`, ShareGPT's `{"conversations": [{"from","value"}]}` and
`{"messages": [{"role","content"}]}`. Each malformed line is named, with what it should have held."""

from __future__ import annotations

import json
from typing import Any

from pipeline.errors import DataError, problem

SHAPE = (
    'an object with string "prompt" and "response" (or "completion"), Alpaca "instruction"/"input"/"output", '
    '"conversations" (ShareGPT) or "messages" ending with an assistant turn'
)
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
# the roles chat templates render (OpenAI's, llama 3's tool roles); another one is a typo or ShareGPT's spelling
MESSAGE_ROLES = ("system", "developer", "user", "assistant", "tool", "function", "ipython")


def conversation(obj: Any, where: str) -> list[dict[str, str]]:
    """The messages of one parsed JSONL line, whatever its shape; the last is the assistant's."""
    if not isinstance(obj, dict):
        raise DataError(problem(where, SHAPE, type(obj).__name__, "fix or remove the line"))
    if "messages" in obj:
        msgs = _checked(obj["messages"], where, "role", "content", "messages: a list of >= 2 {role, content} strings")
        _known_roles(msgs, where)
    elif "conversations" in obj:
        turns = _checked(obj["conversations"], where, "from", "value", "conversations: >= 2 {from, value} strings")
        msgs = [_sharegpt(t, where) for t in turns]
    elif "instruction" in obj and "output" in obj:
        msgs = _alpaca(obj, where)
    else:
        answer = obj.get("response", obj.get("completion"))
        if not isinstance(obj.get("prompt"), str) or not isinstance(answer, str):
            raise DataError(problem(where, SHAPE, _found(obj), "fix or remove the line"))
        msgs = [{"role": "user", "content": obj["prompt"]}, {"role": "assistant", "content": answer}]
    if msgs[-1]["role"] != "assistant":
        raise DataError(
            problem(where, "the last message from role 'assistant'", repr(msgs[-1]["role"]), "end with the answer")
        )
    return msgs


def _found(obj: dict[str, Any]) -> str:
    """What a prompt/response line holds: the fields that are there but not text (`"response": 3`), else its keys."""
    present = [k for k in ("prompt", "response", "completion") if k in obj]
    wrong = [
        f'"{k}" of type {type(obj[k]).__name__} ({json.dumps(obj[k])[:40]})'
        for k in present
        if not isinstance(obj[k], str)
    ]
    return ", ".join(wrong) if "prompt" in obj and len(present) > 1 and wrong else f"keys {sorted(obj)}"


def _checked(turns: Any, where: str, role: str, content: str, expected: str) -> list[dict[str, str]]:
    ok = isinstance(turns, list) and len(turns) >= 2
    ok = ok and all(isinstance(t, dict) and isinstance(t.get(role), str) for t in turns)
    ok = ok and all(isinstance(t.get(content), str) for t in turns)
    if not ok:
        raise DataError(problem(where, f"{expected}", repr(turns)[:80], "fix the line"))
    return [{"role": t[role], "content": t[content]} for t in turns]


def _known_roles(msgs: list[dict[str, str]], where: str) -> None:
    """A role no chat template knows (`"human"`, `"bot"`) would be rendered as a header the model never saw."""
    unknown = next((m["role"] for m in msgs if m["role"] not in MESSAGE_ROLES), None)
    if unknown is not None:
        hint = f"'{SHAREGPT_ROLES[unknown]}' (ShareGPT's '{unknown}')" if unknown in SHAREGPT_ROLES else "one of those"
        raise DataError(
            problem(where, f"each messages role one of {', '.join(MESSAGE_ROLES)}", repr(unknown), f"use {hint}")
        )


def _sharegpt(turn: dict[str, str], where: str) -> dict[str, str]:
    role = SHAREGPT_ROLES.get(turn["role"])
    if role is None:
        raise DataError(
            problem(where, f"a ShareGPT 'from' in {sorted(SHAREGPT_ROLES)}", repr(turn["role"]), "fix the line")
        )
    return {"role": role, "content": turn["content"]}


def _alpaca(obj: dict[str, Any], where: str) -> list[dict[str, str]]:
    """Alpaca: the instruction, then its input (when non-empty) after a blank line, as the user's turn. A null
    input (what pandas and many exports write for a missing one) is no input."""
    extra = obj.get("input")
    parts = [obj.get("instruction"), "" if extra is None else extra, obj.get("output")]
    if not all(isinstance(p, str) for p in parts):
        expected = 'Alpaca string "instruction", "input", "output"'
        raise DataError(problem(where, expected, repr(obj)[:80], "fix the line"))
    instruction, extra, output = parts
    prompt = f"{instruction}\n\n{extra}" if extra.strip() else instruction
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": output}]
