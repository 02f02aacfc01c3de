"""Supervised fine-tuning data (kubetron.data.finetuning): the loss is taken on answer tokens only, and a
packed sequence gives every example exactly the logits it has alone (no attention across examples)."""

from __future__ import annotations

import json

import pytest
import torch
from kubetron.contract.errors import ConfigError
from kubetron.data.finetuning import FinetuningDataset
from kubetron.data.tokenizer import ByteTokenizer

pytestmark = pytest.mark.trainer

EXAMPLES = [{"input": "Translate: cat", "output": " -> chat"}, {"input": "2+2=", "output": "4"},
            {"input": "Capital of France? ", "output": "Paris, of course."}]


def _jsonl(tmp_path, rows) -> str:
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_loss_only_on_answer_tokens(tmp_path):
    ds = FinetuningDataset(_jsonl(tmp_path, [{"input": "ab", "output": "cd"}]), ByteTokenizer(), 8,
                           packing=False, seed=0)
    s = ds[0]
    # ids a b c d <eod>: positions predict b, c, d, <eod>; b is prompt, the rest is the answer.
    assert s["tokens"][:4].tolist() == [97, 98, 99, 100]
    assert s["labels"][:4].tolist() == [98, 99, 100, 256]
    assert s["loss_mask"].tolist() == [0, 1, 1, 1, 0, 0, 0, 0]
    # The loss the step computes ignores whatever the model predicts on prompt (and padding) positions.
    from kubetron.training.gpt_step import masked_token_loss

    per_token = torch.tensor([[5.0, 1.0, 2.0, 3.0, 9.0, 9.0, 9.0, 9.0]])
    changed = per_token.clone()
    changed[0, 0] = 1000.0
    mask = torch.from_numpy(s["loss_mask"])[None]
    assert masked_token_loss(mask, per_token)[0] == masked_token_loss(mask, changed)[0] == 6.0
    assert masked_token_loss(mask, per_token)[1] == 3


def test_packing_puts_several_examples_in_a_sequence_with_positions_reset(tmp_path):
    ds = FinetuningDataset(_jsonl(tmp_path, EXAMPLES), ByteTokenizer(), 64, packing=True, seed=0, shuffle=False)
    assert len(ds) == 1
    s = ds[0]
    lengths = [len(e["input"].encode()) + len(e["output"].encode()) for e in EXAMPLES]  # +eod -1 = same
    assert s["segment_ids"].tolist()[:sum(lengths)] == sum(([i + 1] * n for i, n in enumerate(lengths)), [])
    starts = [0, lengths[0], lengths[0] + lengths[1]]
    assert [s["position_ids"][p] for p in starts] == [0, 0, 0]
    padded = FinetuningDataset(_jsonl(tmp_path, EXAMPLES), ByteTokenizer(), 64, packing=False, seed=0)
    assert len(padded) == 3 and "segment_ids" not in padded[0]


def test_jsonl_errors_name_file_line_and_key(tmp_path):
    path = _jsonl(tmp_path, [EXAMPLES[0], {"input": "x"}])
    with pytest.raises(ConfigError, match=r"sft.jsonl:2: has no 'output' key"):
        FinetuningDataset(path, ByteTokenizer(), 64, packing=True, seed=0)


def test_packed_logits_equal_each_example_alone(tmp_path):
    from kubetron.training.gpt_step import document_mask
    from kubetron.training.model import build_model

    from tests.hf_utils import config_for, kubetron_logits
    from tests.inprocess import ensure_world_of_one

    ensure_world_of_one()
    torch.manual_seed(0)
    cfg = config_for({"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2,
                      "seq_length": 64, "normalization": "RMSNorm", "activation": "swiglu",
                      "add_bias_linear": False, "init_method_std": 0.1})
    model = build_model(cfg, torch.device("cpu"))[0]
    ds = FinetuningDataset(_jsonl(tmp_path, EXAMPLES), ByteTokenizer(), 64, packing=True, seed=0, shuffle=False)
    s = {k: torch.from_numpy(v)[None] for k, v in ds[0].items()}
    packed = kubetron_logits(model, s["tokens"], document_mask(s["segment_ids"]), s["position_ids"])
    leaked = kubetron_logits(model, s["tokens"], None, s["position_ids"])  # plain causal: attends across
    worst, leak = 0.0, 0.0
    for seg in (1, 2, 3):
        where = (s["segment_ids"][0] == seg).nonzero().flatten()
        alone = kubetron_logits(model, s["tokens"][:, where])
        worst = max(worst, (packed[0, where] - alone[0]).abs().max().item())
        leak = max(leak, (leaked[0, where] - alone[0]).abs().max().item())
    print(f"packed vs alone: max abs logit diff {worst:.3g} (without the document mask: {leak:.3g})")
    assert worst <= 1e-5
    assert leak > 1e-2  # the check can fail: without the mask the later examples differ


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_chat_messages_rendered_with_the_template_loss_on_assistant_turns_only(tmp_path):
    from kubetron.data.tokenizer import HuggingFaceTokenizer
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["What is the capital of France? Paris. And Germany? Berlin."] * 20,
                            trainers.BpeTrainer(vocab_size=280, special_tokens=["<unk>", "<|im_start|>",
                                                                                "<|im_end|>"]))
    files = {"tokenizer.json": tok.to_str().encode(),
             "tokenizer_config.json": json.dumps({"eos_token": "<|im_end|>", "chat_template": CHATML}).encode()}
    hf_tok = HuggingFaceTokenizer(files, "test")
    chat = [{"role": "user", "content": "What is the capital of France?"}, {"role": "assistant", "content": "Paris."},
            {"role": "user", "content": "And Germany?"}, {"role": "assistant", "content": "Berlin."}]
    s = FinetuningDataset(_jsonl(tmp_path, [{"messages": chat}]), hf_tok, 64, packing=True, seed=0)[0]
    labels = s["labels"][s["loss_mask"] > 0].tolist()
    rendered = hf_tok.decode(labels)
    assert "Paris." in rendered and "Berlin." in rendered
    assert "capital" not in rendered and "Germany" not in rendered and "user" not in rendered
    # Without a chat template: one line naming the file and example.
    plain = HuggingFaceTokenizer({"tokenizer.json": files["tokenizer.json"],
                                  "tokenizer_config.json": b'{"eos_token": "<|im_end|>"}'}, "test")
    with pytest.raises(ConfigError, match="chat messages need a tokenizer with a chat template"):
        FinetuningDataset(_jsonl(tmp_path, [{"messages": chat}]), plain, 64, packing=True, seed=0)
