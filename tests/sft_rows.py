"""Fine-tuning rows shared by the SFT tests: a small chat set (every row format trains from it) and the data shapes of
the oracle suite (chats with and without tool calls, TRL's prompt/completion, ShareGPT), and how kubetron encodes
one row (the trainer's Encoder, in process)."""

from __future__ import annotations

import copy
import json

import numpy as np
from kubetron.data.finetuning import FinetuningDataset
from kubetron.data.sft.encode import Encoder
from kubetron.data.sft.rows import RowKeys, parse_row

from tests.chat_tokenizers import CHATS

QA = [("What color is snow?", "Snow is white."), ("What is the capital of France?", "Paris."),
      ("Is the sky blue?", "Yes, the sky is blue."), ("And 7+3?", "7+3=10."), ("12*12?", "144"),
      ("Grass?", "Grass is green."), ("Answer briefly.", "Please think step by step."), ("Hi", "Hello!")] * 3
SYSTEM = "You are a helpful assistant."


def _system(i: int) -> bool:
    return i % 3 == 0


def messages_rows() -> list[dict]:
    return [{"messages": ([{"role": "system", "content": SYSTEM}] if _system(i) else [])
             + [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for i, (q, a) in enumerate(QA)]


def samples(path, tok, **kw) -> list[dict[str, np.ndarray]]:
    ds = FinetuningDataset(path, tok, 64, packing=True, seed=1, **kw)
    return [ds[i] for i in range(len(ds))]


def assert_same(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b) and len(a) > 1
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for k in x:
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)



WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def _call(name: str, city: str, n: int, as_dict: bool = False) -> dict:
    args = {"city": city}
    return {"id": f"call0000{n}", "type": "function",
            "function": {"name": name, "arguments": args if as_dict else json.dumps(args)}}


def _result(text: str, n: int) -> dict:
    return {"role": "tool", "content": text, "tool_call_id": f"call0000{n}"}


ASK = {"role": "user", "content": "What is the weather in Paris?"}
SUNNY = {"role": "assistant", "content": "The weather in Paris is sunny, 21 C."}


def _tool_chat(content, calls=None, as_dict=False) -> list[dict]:
    calls = calls or [_call("get_weather", "Paris", 1, as_dict)]
    return [ASK, {"role": "assistant", "content": content, "tool_calls": calls},
            *[_result('{"weather": "sunny", "celsius": 21}', n) for n in range(1, len(calls) + 1)], SUNNY]


SHAPES = {
    "one-turn": {"messages": CHATS[0]},
    "system-two-turns": {"messages": CHATS[1]},
    "three-turns": {"messages": CHATS[2]},
    "reasoning-in-content": {"messages": [
        {"role": "user", "content": "7+3?"}, {"role": "assistant", "content": "<think>\nSmall sums.\n</think>\n\n10"},
        {"role": "user", "content": "12*12?"},
        {"role": "assistant", "content": "<think>\nLet me think step by step.\n</think>\n\n144"}]},
    "reasoning-field": {"messages": [{"role": "user", "content": "Is snow white?"},
                                     {"role": "assistant", "content": "Yes.", "reasoning_content": "Snow is white."}]},
    "tool-call-content-null": {"messages": _tool_chat(None), "tools": [WEATHER]},
    "tool-call-content-empty": {"messages": _tool_chat(""), "tools": [WEATHER]},
    "tool-call-with-text": {"messages": _tool_chat("Let me check the weather."), "tools": [WEATHER]},
    "parallel-calls": {"messages": _tool_chat(None, [_call("get_weather", "Paris", 1),
                                                     _call("get_weather", "Tokyo", 2)]), "tools": [WEATHER]},
    "sequential-calls": {"messages": [
        ASK, {"role": "assistant", "content": None, "tool_calls": [_call("get_weather", "Paris", 1)]},
        _result('{"error": "try the city code"}', 1),
        {"role": "assistant", "content": None, "tool_calls": [_call("get_weather", "PAR", 2)]},
        _result('{"weather": "sunny", "celsius": 21}', 2), SUNNY], "tools": [WEATHER]},
    "tools-as-json-string": {"messages": _tool_chat(None), "tools": json.dumps([WEATHER])},
    "arguments-as-dict": {"messages": _tool_chat(None, as_dict=True), "tools": [WEATHER]},
    "content-parts": {"messages": [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in CHATS[0]]},
    "trl-prompt-completion-chat": {"prompt": CHATS[1][1:4], "completion": CHATS[1][4:]},
    "trl-prompt-completion-tool-call": {
        "prompt": [ASK], "completion": [{"role": "assistant", "content": None,
                                         "tool_calls": [_call("get_weather", "Paris", 1)]}], "tools": [WEATHER]},
    "sharegpt": {"conversations": [{"from": "human", "value": "What color is snow?"},
                                   {"from": "gpt", "value": "Snow is white."}]},
    "prompt-completion-text": {"prompt": "What is the capital of France? A:", "completion": " Paris."},
}


def kubetron_example(tok, row: dict) -> tuple[list[int], list[int]]:
    """ids and mask (1 where the id is a trained target) as the trainer's build makes them."""
    example = parse_row(copy.deepcopy(row), RowKeys())
    encoded = Encoder(tok, 4096, True, None, "finetuning.data_path").encode([("rows.jsonl:1", example)])
    ids, flags = encoded.ids[0].tolist(), encoded.flags[0].tolist()
    return ids, [0] + flags[1:]


