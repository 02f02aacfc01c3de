"""kubetron's fine-tuning ids and loss masks, judged against transformers and TRL.

For eight template families - tokenizers built here like Llama 3.1's, Qwen2.5's, Qwen3's, Mistral v0.3's, Gemma 2's,
Phi-3's, a ChatML model's and DeepSeek V3's, each with the model's published chat template (TRL ships them) - and
seventeen data shapes (single and multi-turn, system prompts, reasoning, tool calls with content null, "" and text,
parallel and sequential calls, the `tools` column as a list and as JSON, content parts, TRL's prompt/completion in both
forms, ShareGPT):

* ids: kubetron's are transformers' `apply_chat_template(messages, tools=..., tokenize=True)`; where transformers
  refuses the conversation (the template raises: Llama 3.1 with two calls in one turn, Gemma with a system turn),
  kubetron refuses the row in one line naming it; where the published template does not write tool calls at all
  (Gemma, Phi-3), kubetron refuses the row rather than train on a turn without its calls;
* masks: transformers' `return_assistant_tokens_mask` under the family's training template (TRL's, the same text
  with {% generation %} blocks; for Llama 3.1, Mistral and Qwen3, written the same way in tests/chat_templates/), and
  TRL's completion mask for prompt/completion rows. They agree token for token, except that TRL also trains what a
  template writes after the end-of-turn token (Qwen's "\\n" after <|im_end|>, Phi-3's final <|endoftext|>):
  kubetron stops at the end of turn. The table printed at the end counts both.

In-process and pure: the Encoder that the trainer's build runs, no megatron.
"""

from __future__ import annotations

import copy
import json

import pytest
from kubetron.contract.errors import ConfigError
from kubetron.data.tokenizer import tokenizer_from_assets

from tests.chat_tokenizers import FAMILIES
from tests.sft_rows import SHAPES, kubetron_example

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """Per family: (its directory, kubetron's tokenizer, transformers' tokenizer, the mask template)."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("families")
    out = {}
    for name, (build, training) in FAMILIES.items():
        path = build(root / name)
        out[name] = (path, tokenizer_from_assets("HuggingFaceTokenizer", str(path)),
                     AutoTokenizer.from_pretrained(path), training())
    return out


SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system"}


def _messages(row: dict) -> list[dict]:
    """The conversation transformers is given: ShareGPT's turns as messages (TRL's maybe_convert_to_chatml keeps
    the role names human/gpt, so no turn would be an assistant's: kubetron, as most trainers, maps them)."""
    if "conversations" in row:
        return [{"role": SHAREGPT_ROLES[t["from"]], "content": t["value"]} for t in row["conversations"]]
    row = copy.deepcopy(row)
    msgs = row.get("messages") or row["prompt"] + row["completion"]
    return [{**m, "content": "\n".join(p["text"] for p in m["content"])} if isinstance(m.get("content"), list)
            else m for m in msgs]


def _tools(row: dict):
    tools = row.get("tools")
    return json.loads(tools) if isinstance(tools, str) else tools


def oracle(hf, training: str | None, row: dict) -> tuple[list[int], list[int] | None, str]:
    """transformers' ids for the row and the mask TRL would train with (None: its template renders other text)."""
    from trl.data_utils import common_prefix_length

    if "prompt" in row and isinstance(row["prompt"], str):  # TRL: the eos text added, prompt and whole encoded
        prompt = hf(text=row["prompt"])["input_ids"]
        whole = hf(text=row["prompt"] + row["completion"] + hf.eos_token)["input_ids"]
        n = common_prefix_length(prompt, whole)
        return whole, [0] * n + [1] * (len(whole) - n), "TRL completion mask"
    msgs, tools = _messages(row), _tools(row)
    ids = hf.apply_chat_template(msgs, tools=tools, tokenize=True, return_dict=True)["input_ids"]
    if "prompt" in row:  # TRL's conversational prompt/completion: trained from where the prompt's ids stop
        prompt = hf.apply_chat_template(_messages({"messages": row["prompt"]}), tools=tools, tokenize=True,
                                        return_dict=True, add_generation_prompt=True)["input_ids"]
        n = common_prefix_length(prompt, ids)
        return ids, [0] * n + [1] * (len(ids) - n), "TRL completion mask"
    marked = hf.apply_chat_template(msgs, tools=tools, tokenize=True, return_dict=True, chat_template=training,
                                    return_assistant_tokens_mask=True) if training else \
        hf.apply_chat_template(msgs, tools=tools, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    if marked["input_ids"] != ids:
        return ids, None, "training template renders other text"
    return ids, list(marked["assistant_masks"]), "assistant mask"


def compare_masks(hf, ids: list[int], mine: list[int], theirs: list[int], header: set[int]) -> tuple[int, list[int]]:
    """(the tokens only TRL trains at the edge of a turn kubetron trains - whitespace or eos after it, whitespace or
    the generation prompt's own tokens before it - , positions of any other difference)."""
    edge, other = 0, []
    n = len(ids)
    for j, (a, b) in enumerate(zip(mine, theirs, strict=True)):
        if a == b:
            continue
        blank = hf.decode([ids[j]]).strip() == ""
        after = j > 0 and (mine[j - 1] or theirs[j - 1])
        before = next((mine[k] for k in range(j + 1, n) if not (theirs[k] and not mine[k])), 0)
        trailing = after and (blank or ids[j] == hf.eos_token_id)
        if not a and b and (trailing or (before and (blank or ids[j] in header))):
            edge += 1
        else:
            other.append(j)
    return edge, other


TABLE: dict[tuple[str, str], str] = {}


def _outcome(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc)[:60]}"


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_ids_and_masks_equal_transformers_and_trl(families, family, shape):
    path, tok, hf, training = families[family]
    row = SHAPES[shape]
    try:
        theirs, their_mask, how = oracle(hf, training, row)
    except Exception as e:  # the published template refuses the conversation: kubetron refuses the row
        with pytest.raises(ConfigError) as err:
            kubetron_example(tok, row)
        assert str(err.value).startswith("finetuning.data_path: rows.jsonl:1: ") and "\n" not in str(err.value)
        TABLE[family, shape] = f"both refuse ({_outcome(e)})"
        return
    try:
        ids, mask = kubetron_example(tok, row)
    except ConfigError as e:  # only a template that drops the row's tool calls is refused where transformers renders
        assert "tool_calls" in json.dumps(row) and "writes nothing of message" in str(e), str(e)
        assert "tool calls" in str(e)
        TABLE[family, shape] = "kubetron refuses: the template writes no tool calls"
        return
    assert ids == theirs
    assert sum(mask) > 0
    if their_mask is None:
        TABLE[family, shape] = f"ids equal; {how}"
        return
    edge, other = compare_masks(hf, ids, mask, their_mask, header_ids(tok, hf))
    assert other == [], (hf.decode(ids), [(j, hf.decode([ids[j]]), mask[j], their_mask[j]) for j in other])
    TABLE[family, shape] = f"ids equal; {how} equal" + (f" but {edge} edge token(s) TRL also trains" if edge else "")


def header_ids(tok, hf) -> set[int]:
    """The special tokens of the family's generation prompt (<|im_start|>, <｜Assistant｜>, <|assistant|> ...)."""
    from kubetron.data.sft.chat import ChatTemplate

    header = ChatTemplate(tok.chat_templates["default"], tok.template_tokens, tok.special_token_texts,
                          "family").prompt_header
    return {i for i in hf(header, add_special_tokens=False)["input_ids"]
            if hf.convert_ids_to_tokens(i) in tok.special_token_texts}


def test_no_template_trains_its_header(families):
    """The generation prompt (<|assistant|> and the newline Phi-3's token takes with it, <|im_start|>assistant,
    <|start_header_id|>assistant<|end_header_id|>, <start_of_turn>model, <｜Assistant｜>) is never a target: the
    model does not write it."""
    for family, (_, tok, hf, _) in families.items():
        specials = header_ids(tok, hf)
        if family != "mistral-v0.3":  # the one template without a generation prompt
            assert specials, family
        for shape in ("three-turns", "tool-call-content-null"):
            try:
                ids, mask = kubetron_example(tok, SHAPES[shape])
            except ConfigError:
                continue
            assert not [j for j, i in enumerate(ids) if i in specials and mask[j]], (family, shape)


def test_the_table(families, request):
    """Every (family, shape) of the suite ran; the table says how each compared (printed with -s)."""
    ran = {k for k in TABLE}
    expected = {(f, s) for f in FAMILIES for s in SHAPES}
    if ran != expected:
        pytest.skip("run the whole module for the table")
    width = max(len(s) for s in SHAPES)
    for family in FAMILIES:
        print(f"\n{family}")
        for shape in SHAPES:
            print(f"  {shape:<{width}}  {TABLE[family, shape]}")
    assert sum("ids equal" in v for v in TABLE.values()) >= 100
