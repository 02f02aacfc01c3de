"""The row formats of fine-tuning data, each turned into a prompt/answer pair or a chat.

* OpenAI chat: ``{"messages": [{"role", "content"}, ...]}`` (the key is ``finetuning.messages_key``); a content
  may be a list of text parts ``[{"type": "text", "text": ...}]``, joined with newlines (as vLLM does); an
  optional ``"tools"`` list (or that list as a JSON string, as TRL reads it) goes to the template. An assistant
  message with ``tool_calls`` (OpenAI's form, ``content`` null or ``""`` or text) is trained like any other.
* TRL prompt/completion: ``{"prompt": str, "completion": str}`` (standard: a pair), or both lists of messages
  (conversational: a chat whose completion's assistant turns are trained, the prompt's are context).
* ShareGPT: ``{"conversations": [{"from": "human" | "gpt" | "system" | ..., "value": ...}]}``.
* ``{"input": str, "output": str}`` with the keys ``finetuning.input_key`` / ``output_key``.

Messages are passed to the template as transformers' ``apply_chat_template`` passes them: keys whose value is null
are dropped (OpenAI's ``content: null`` beside ``tool_calls``), and a reasoning under ``reasoning_content``,
``thinking`` or ``reasoning`` is given under the first two as well. Rows of Parquet and Arrow files hold structs,
which give every row every key any row has (null where it had none): there, null entries are dropped at any depth,
inside tool calls and tool specs too, so a tool call's arguments are the row's own (:func:`without_nulls`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

ROLES_SHAREGPT = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "tool": "tool", "function_response": "tool", "observation": "tool"}
_REASONING = ("reasoning_content", "thinking", "reasoning")


@dataclass(frozen=True)
class Pair:
    """A prompt (no loss) and its answer (loss, then the end-of-document token when add_eod)."""

    prompt: str
    answer: str


@dataclass(frozen=True)
class Chat:
    """A conversation for the chat template; `trained[i]`: message i is an assistant turn trained on."""

    messages: tuple
    trained: tuple
    tools: list | None = None


@dataclass(frozen=True)
class RowKeys:
    """The configured keys (finetuning.input_key, output_key, messages_key)."""

    input: str = "input"
    output: str = "output"
    messages: str = "messages"

    def formats(self) -> str:
        return (f"{{{self.messages!r}: [{{role, content}}]}} (OpenAI chat), {{'prompt', 'completion'}} (TRL: text "
                f"or messages), {{'conversations': [{{from, value}}]}} (ShareGPT), {{{self.input!r}, "
                f"{self.output!r}}} (finetuning.input_key/output_key)")


class TableRow(dict):
    """A row read from a Parquet or Arrow table (its structs carry every key of every row, null where absent)."""


def without_nulls(value):
    """`value` with every null dict entry removed, at any depth (what a struct column adds to a row)."""
    if isinstance(value, dict):
        return {k: without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [without_nulls(v) for v in value]
    return value


def _strip_nested(value):
    """Nulls dropped inside tool calls and tool specs (message-level keys stay: a null content is meaningful)."""
    if isinstance(value, list):
        return [_strip_message(m) if isinstance(m, dict) else without_nulls(m) for m in value]
    return value


def _strip_message(m: dict) -> dict:
    """A table row's message with the nulls its struct added dropped, inside tool calls and tool specs too."""
    return without_nulls(m)


class RowError(ValueError):
    """A row that is not one of the formats; the message names what is wrong (the caller adds file:line)."""


def parse_row(row, keys: RowKeys) -> Pair | Chat:
    """The example a row holds, or RowError saying what is wrong with it."""
    if not isinstance(row, dict):
        raise RowError(f"not an object but {type(row).__name__}")
    if isinstance(row, TableRow):
        row = {k: (_strip_nested(v) if k in ("tools", keys.messages, "prompt", "completion") else v)
               for k, v in row.items()}
    if keys.messages in row:
        return _chat(_messages(row[keys.messages], keys.messages), None, row.get("tools"))
    if "conversations" in row:
        return _chat(_sharegpt(row["conversations"]), None, row.get("tools"))
    if "prompt" in row or "completion" in row:
        return _prompt_completion(row)
    if keys.input in row or keys.output in row:
        return Pair(*(_text(row, k) for k in (keys.input, keys.output)))
    found = ", ".join(repr(k) for k in row) or "none"
    raise RowError(f"keys {found} are none of the formats: {keys.formats()}")


def _text(row: dict, key: str) -> str:
    if not isinstance(row.get(key), str):
        raise RowError(f"has no {key!r} key" if key not in row else f"has a non-string {key!r} key")
    return row[key]


def _prompt_completion(row: dict) -> Pair | Chat:
    prompt, completion = row.get("prompt"), row.get("completion")
    if isinstance(prompt, str) and isinstance(completion, str):
        return Pair(prompt, completion)
    if isinstance(prompt, list) and isinstance(completion, list):
        before, after = _messages(prompt, "prompt"), _messages(completion, "completion")
        return _chat(before + after, len(before), row.get("tools"))
    raise RowError("'prompt' and 'completion' must both be strings (TRL's standard form) or both lists of "
                   "messages (its conversational form)")


def _chat(messages: list[dict], first_trained: int | None, tools) -> Chat:
    start = first_trained or 0
    trained = tuple(i >= start and is_answer(m) for i, m in enumerate(messages))
    if not any(trained):
        roles = ", ".join(dict.fromkeys(repr(m["role"]) for m in messages[start:]))
        raise RowError(f"has no assistant message to learn from (roles: {roles}; the turns trained on are role "
                       "'assistant' with content or tool_calls)")
    if isinstance(tools, str):  # TRL's form in a string column: the list as JSON
        try:
            tools = json.loads(tools)
        except ValueError as e:
            raise RowError(f"'tools' is a string but not JSON ({e})") from None
    if tools is not None and not isinstance(tools, list):
        raise RowError("'tools' must be a list (or that list as a JSON string)")
    return Chat(tuple(messages), trained, tools)


def is_answer(m: dict) -> bool:
    """An assistant message the model learns to write: text, or tool calls (with null, "" or text content)."""
    return m["role"] == "assistant" and (isinstance(m.get("content"), str) or bool(m.get("tool_calls")))


def _messages(value, key: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise RowError(f"{key!r} must be a non-empty list of {{role, content}} messages")
    return [_message(m, key, n) for n, m in enumerate(value, 1)]


def _message(m, key: str, n: int) -> dict:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise RowError(f"{key!r} message {n} is not a {{role, content}} object")
    out = {k: v for k, v in m.items() if v is not None}
    if "content" in out:
        out["content"] = _content(out["content"], key, n)
    calls = out.get("tool_calls")
    if calls is not None and not (isinstance(calls, list) and all(isinstance(c, dict) for c in calls)):
        raise RowError(f"{key!r} message {n}: tool_calls must be a list of objects")
    reasoning = next((m[k] for k in _REASONING if m.get(k) is not None), None)
    if reasoning is not None:
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out


def _content(value, key: str, n: int) -> str:
    """A string, or OpenAI's text parts joined with newlines."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                       and isinstance(p.get("text"), str) for p in value):
        return "\n".join(p["text"] for p in value)
    raise RowError(f"{key!r} message {n}: content must be a string or a list of {{type: text, text}} parts "
                   "(other parts, such as images, are not read)")


def _sharegpt(value) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise RowError("'conversations' must be a non-empty list of {from, value} turns")
    out = []
    for n, turn in enumerate(value, 1):
        if not isinstance(turn, dict) or turn.get("from") not in ROLES_SHAREGPT or not isinstance(turn.get("value"),
                                                                                                  str):
            said = turn.get("from") if isinstance(turn, dict) else turn
            raise RowError(f"'conversations' turn {n} ({said!r}) is not {{from, value}} with from one of "
                           f"{', '.join(ROLES_SHAREGPT)}")
        out.append({"role": ROLES_SHAREGPT[turn["from"]], "content": turn["value"]})
    return out
