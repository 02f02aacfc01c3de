"""Chat fine-tuning trains on what transformers would (exact tokens and masks): for tokenizers built like Llama 3's,
Qwen3's and Mistral v0.3's and saved by `save_pretrained`, the ids of every example equal
`apply_chat_template(messages, tokenize=True)`, the loss covers exactly the assistant turns with their end-of-turn
token, single- and multi-turn; prompt/answer rows get one BOS; templates are read wherever transformers reads them."""

from __future__ import annotations

import json

import pytest
from kubetron.contract.errors import ConfigError
from kubetron.data.finetuning import FinetuningDataset
from kubetron.data.tokenizer import tokenizer_from_assets

from tests.chat_tokenizers import BUILDERS, CHATS, QWEN3_TEMPLATE, hf_chat_ids, write_jsonl

pytestmark = pytest.mark.unit

REASONING = [  # Qwen3: reasoning in the content (last turn: kept in <think>; earlier turns: dropped by the template)
    [{"role": "user", "content": "7+3?"}, {"role": "assistant", "content": "<think>\nSmall sums.\n</think>\n\n10"},
     {"role": "user", "content": "12*12?"},
     {"role": "assistant", "content": "<think>\nLet me think step by step.\n</think>\n\n144"}],
    [{"role": "user", "content": "Is snow white?"},
     {"role": "assistant", "content": "Yes.", "reasoning_content": "Snow is white."}],
]


def _end_of_turn(name: str) -> str:
    return {"llama3": "<|eot_id|>", "qwen3": "<|im_end|>", "mistral": "</s>"}[name]


def _expected_turns(name: str, chat: list[dict]) -> list[str]:
    """The text of each assistant turn a model of this family is trained to produce (what follows the generation
    prompt, through the end-of-turn token), written out per template."""
    assistants = [i for i, m in enumerate(chat) if m["role"] == "assistant"]
    last_user = max(i for i, m in enumerate(chat) if m["role"] == "user")
    out = []
    for i in assistants:
        content = chat[i]["content"]
        if name == "llama3":
            out.append(content.strip() + "<|eot_id|>")
        elif name == "mistral":
            out.append(" " + content.strip() + "</s>")  # the space is inside the answer's first token ("▁Snow")
        else:
            think, _, answer = content.rpartition("</think>")
            think = chat[i].get("reasoning_content") or think.split("<think>")[-1].strip("\n")
            answer = answer.lstrip("\n") if think else content
            after = i > last_user and (i == assistants[-1] or think)
            out.append((f"<think>\n{think}\n</think>\n\n" if after else "") + answer + "<|im_end|>")
    return out


def _trained_texts(tok_dir, chat: list[dict], labels, loss_mask) -> list[str]:
    """The rendered text covered by each run of trained tokens (transformers' own rendering and offsets)."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tok_dir)
    text = hf.apply_chat_template(chat, tokenize=False)
    enc = hf(text, add_special_tokens=False, return_offsets_mapping=True)
    assert enc["input_ids"][1:] == [int(t) for t in labels]  # labels are the ids shifted by one
    runs, start = [], None
    for pos, m in enumerate(list(loss_mask) + [0]):
        if m and start is None:
            start = pos
        elif not m and start is not None:
            runs.append(text[enc["offset_mapping"][start + 1][0]:enc["offset_mapping"][pos][1]])
            start = None
    return runs


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    return {name: build(root / name) for name, build in BUILDERS.items()}


@pytest.fixture(scope="module")
def legacy_tokenizers(tmp_path_factory):
    """The same tokenizers saved as transformers < 4.4x saved them: the template in tokenizer_config.json."""
    root = tmp_path_factory.mktemp("legacy")
    return {name: build(root / name, legacy=True) for name, build in BUILDERS.items()}


def _example(tmp_path, tok, rows: list[dict], seq: int = 512, **kw) -> dict:
    """tokens/labels/loss_mask of the first row's example (the first segment of the first packed sequence)."""
    ds = FinetuningDataset(str(write_jsonl(tmp_path / "sft.jsonl", rows)), tok, seq, packing=True, seed=0,
                           shuffle=False, **kw)
    s = ds[0]
    first = s["segment_ids"] == 1
    return {k: s[k][first] for k in ("tokens", "labels", "loss_mask")}


@pytest.mark.parametrize("layout", ["chat_template.jinja", "tokenizer_config.json"])
@pytest.mark.parametrize("name", list(BUILDERS))
@pytest.mark.parametrize("chat", CHATS + REASONING, ids=["one-turn", "system-two-turns", "three-turns",
                                                         "reasoning-two-turns", "reasoning-field"])
def test_chat_ids_equal_apply_chat_template_and_only_assistant_turns_train(tokenizers, legacy_tokenizers, tmp_path,
                                                                           name, chat, layout):
    tok_dir = (tokenizers if layout == "chat_template.jinja" else legacy_tokenizers)[name]
    tok = tokenizer_from_assets("HuggingFaceTokenizer", str(tok_dir))
    ex = _example(tmp_path, tok, [{"messages": chat}])
    ids = [int(t) for t in ex["tokens"]] + [int(ex["labels"][-1])]
    want = hf_chat_ids(tok_dir, chat)
    assert ids == want
    if name in ("llama3", "mistral"):  # exactly one BOS, the one the template writes
        assert ids.count(tok.bos) == 1 and ids[0] == tok.bos
    turns = _trained_texts(tok_dir, chat, ex["labels"], ex["loss_mask"])
    assert turns == _expected_turns(name, chat)


GENERATION_CHATML = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n{% generation %}"
    "{{ m['content'] }}<|im_end|>{% endgeneration %}\n{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_generation_markers_give_transformers_assistant_mask(tmp_path):
    """A template with {% generation %} blocks: the loss covers exactly transformers' return_assistant_tokens_mask."""
    from transformers import AutoTokenizer

    tok_dir = BUILDERS["qwen3"](tmp_path / "tok", GENERATION_CHATML)
    tok = tokenizer_from_assets("HuggingFaceTokenizer", str(tok_dir))
    hf = AutoTokenizer.from_pretrained(tok_dir)
    for n, chat in enumerate(CHATS):
        ex = _example(tmp_path, tok, [{"messages": chat}])
        out = hf.apply_chat_template(chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert [int(t) for t in ex["labels"]] == out["input_ids"][1:], n
        assert [int(m) for m in ex["loss_mask"]] == out["assistant_masks"][1:], n
        assert sum(out["assistant_masks"]) > 0


@pytest.mark.parametrize("name", list(BUILDERS))
def test_prompt_answer_rows_are_encoded_as_trl_encodes_them(tokenizers, tmp_path, name):
    """{"input", "output"} and TRL's {"prompt", "completion"}: prompt + answer encoded together (one BOS when the
    tokenizer adds one, no token invented at the boundary: "A:" + "Paris" is "A:Paris", never "A: Paris" on a
    SentencePiece tokenizer), eod after; the loss from where the prompt's own ids stop."""
    from transformers import AutoTokenizer
    from trl.data_utils import common_prefix_length

    tok = tokenizer_from_assets("HuggingFaceTokenizer", str(tokenizers[name]))
    hf = AutoTokenizer.from_pretrained(tokenizers[name])
    for row in ({"input": "What color is snow? A:", "output": "Snow"}, {"prompt": "7+3=", "completion": "10"}):
        prompt, answer = list(row.values())
        ex = _example(tmp_path, tok, [row])
        ids = [int(t) for t in ex["tokens"]] + [int(ex["labels"][-1])]
        whole = hf(prompt + answer + hf.eos_token)["input_ids"]
        assert ids == whole
        assert tok.bos is None or ids.count(tok.bos) == 1
        n = common_prefix_length(hf(prompt)["input_ids"], whole)  # TRL's rule
        trained = [int(t) for t, m in zip(ex["labels"], ex["loss_mask"], strict=True) if m]
        assert trained == whole[n:] and trained[-1] == tok.eod


def test_a_model_saved_today_is_read_with_its_template(tokenizers, tmp_path):
    """save_pretrained writes chat_template.jinja and leaves tokenizer_config.json without one: it is read."""
    tok_dir = tokenizers["llama3"]
    assert "chat_template" not in json.loads((tok_dir / "tokenizer_config.json").read_text())
    tok = tokenizer_from_assets("HuggingFaceTokenizer", str(tok_dir))
    ex = _example(tmp_path, tok, [{"messages": CHATS[0]}])
    assert [int(t) for t in ex["tokens"]] + [int(ex["labels"][-1])] == hf_chat_ids(tok_dir, CHATS[0])


def _files_of(tok_dir) -> dict[str, bytes]:
    return {p.relative_to(tok_dir).as_posix(): p.read_bytes() for p in sorted(tok_dir.rglob("*")) if p.is_file()}


def test_templates_are_read_where_transformers_reads_them(tokenizers, tmp_path):
    """chat_template.jinja + additional_chat_templates/NAME.jinja (named templates saved today), tokenizer_config.json
    (a string, or a list of named templates), chat_template.json; the jinja files win, as in transformers."""
    from kubetron.data.tokenizer import chat_templates
    from transformers import AutoTokenizer

    named = {"default": QWEN3_TEMPLATE, "tool_use": QWEN3_TEMPLATE.replace("# Tools", "# Tool use")}
    saved = BUILDERS["qwen3"](tmp_path / "named", named)
    assert (saved / "additional_chat_templates" / "tool_use.jinja").is_file()
    tok = tokenizer_from_assets("HuggingFaceTokenizer", str(saved))
    assert tok.chat_templates == AutoTokenizer.from_pretrained(saved).chat_template == named
    base = _files_of(tokenizers["qwen3"])
    config = json.loads(base["tokenizer_config.json"])
    legacy = {"tokenizer.json": base["tokenizer.json"],
              "tokenizer_config.json": json.dumps({**config, "chat_template": "A"}).encode()}
    assert chat_templates(legacy) == {"default": "A"}
    listed = json.dumps({**config, "chat_template": [{"name": "default", "template": "B"},
                                                     {"name": "rag", "template": "C"}]}).encode()
    assert chat_templates({**legacy, "tokenizer_config.json": listed}) == {"default": "B", "rag": "C"}
    assert chat_templates({**legacy, "chat_template.jinja": b"D"}) == {"default": "D"}  # the file wins
    processor = {"tokenizer.json": base["tokenizer.json"], "chat_template.json": b'{"chat_template": "E"}'}
    assert chat_templates(processor) == {"default": "E"}
    bad = {**legacy, "tokenizer_config.json": json.dumps({**config, "chat_template": 3}).encode()}
    with pytest.raises(ConfigError, match="tokenizer_config.json: chat_template is neither a string nor a list"):
        chat_templates(bad, "tok")


def test_a_named_template_is_chosen_by_finetuning_chat_template(tmp_path):
    """finetuning.chat_template picks one of the named templates; 'tool_use' is taken for rows with tools as
    transformers does; an unknown name or no 'default' among several is one line naming the key."""
    from transformers import AutoTokenizer

    plain = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tools = "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}" + plain
    saved = BUILDERS["qwen3"](tmp_path / "named", {"default": QWEN3_TEMPLATE, "chatml": plain, "tool_use": tools})
    tok = tokenizer_from_assets("HuggingFaceTokenizer", str(saved))
    hf = AutoTokenizer.from_pretrained(saved)
    chat = CHATS[1]
    for name in ("default", "chatml"):
        ex = _example(tmp_path, tok, [{"messages": chat}], chat_template=name)
        want = hf.apply_chat_template(chat, tokenize=True, return_dict=False, chat_template=name)
        assert [int(t) for t in ex["tokens"]] + [int(ex["labels"][-1])] == want, name
    spec = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
    ex = _example(tmp_path, tok, [{"messages": chat, "tools": spec}])
    assert [int(t) for t in ex["tokens"]] + [int(ex["labels"][-1])] == hf.apply_chat_template(
        chat, tools=spec, tokenize=True, return_dict=False)
    with pytest.raises(ConfigError, match=r"finetuning.chat_template: 'nope': the tokenizer has no chat template of "
                                          r"that name \(it has chatml, default, tool_use\)"):
        _example(tmp_path, tok, [{"messages": chat}], chat_template="nope")
    two = BUILDERS["qwen3"](tmp_path / "two", {"chatml": plain, "tool_use": tools})
    with pytest.raises(ConfigError, match="none named 'default': choose one"):
        _example(tmp_path, tokenizer_from_assets("HuggingFaceTokenizer", str(two)), [{"messages": chat}])


def test_a_template_that_cannot_be_traced_is_refused_naming_the_row(tokenizers, tmp_path):
    """A template that slices an assistant's text (its content is not rendered as given) is refused with the row
    named, rather than training on spans that were guessed."""
    cut = "{% for m in messages %}{{ m['content'][:20] }}<|im_end|>{% endfor %}"  # answers over 20 characters
    tok = tokenizer_from_assets("HuggingFaceTokenizer", str(BUILDERS["qwen3"](tmp_path / "t", cut)))
    with pytest.raises(ConfigError, match=r"sft.jsonl:2: the chat template changes an assistant message's text"):
        _example(tmp_path, tok, [{"messages": CHATS[0]}, {"messages": CHATS[2]}])
    plain = tokenizer_from_assets("HuggingFaceTokenizer", {n: d for n, d in _files_of(tokenizers["qwen3"]).items()
                                                           if n != "chat_template.jinja"})
    with pytest.raises(ConfigError, match=r"sft.jsonl:1: chat messages need a tokenizer with a chat template"):
        _example(tmp_path, plain, [{"messages": CHATS[0]}])
