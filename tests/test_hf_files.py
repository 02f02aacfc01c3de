"""The files of Hugging Face models as users have them, in and out of kubetron.

- today's tokenizer files (transformers >= 4.43 saves the chat template as chat_template.jinja; some models ship
  chat_template.json): fine-tune a Llama-3-style chat model, export it, and transformers' apply_chat_template
  and generate() work on the export; an adapter export carries the tokenizer files as TRL saves them;
- the weights transformers reads (model.safetensors, the shards an index lists, never a Mistral repository's
  consolidated.safetensors), every safetensors header checked against the model before a tensor is read, and
  pytorch_model.bin (a pickle) never opened;
- export-hf writes shards with an index, as save_pretrained does, one shard in memory at a time.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch

from tests.hf_utils import (
    SFT_LINES,
    finetune_args,
    hf_logits,
    imported_model_keys,
    imported_tensors,
    make_tiny_llama,
)
from tests.inprocess import run_command

pytestmark = pytest.mark.trainer

pytest.importorskip("transformers")

SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
# Llama 3's template, shortened (no system-prompt default, no tools): BOS, then header + content + <|eot_id|>
LLAMA3_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>"
                   "\n\n' + m['content'] | trim + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}"
                   "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
CHATS = [[{"role": "user", "content": "What color is snow?"}, {"role": "assistant", "content": "Snow is white."}],
         [{"role": "user", "content": "What color is grass?"}, {"role": "assistant", "content": "Grass is green."}]]


def save_llama3_tokenizer(out: Path, *, template_in_config: bool = False) -> dict[str, int]:
    """A byte-level BPE with Llama 3's special tokens and post-processor (BOS before any text), its chat template,
    saved by transformers' save_pretrained (which writes the template to chat_template.jinja). With
    `template_in_config` the template is also put into tokenizer_config.json, where older kubetron reads it.
    Returns the special ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([m["content"] for chat in CHATS for m in chat] * 20 + ["user assistant"] * 20, trainer)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A $B",
                                                       special_tokens=[("<|begin_of_text|>", bos)])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                            chat_template=LLAMA3_TEMPLATE).save_pretrained(out)
    assert (out / "chat_template.jinja").is_file()  # where today's transformers keeps it
    if template_in_config:
        config = json.loads((out / "tokenizer_config.json").read_text())
        (out / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": LLAMA3_TEMPLATE}))
    return {"bos": bos, "eot": tok.token_to_id("<|eot_id|>")}


def _llama3_chat_model(tmp_path: Path) -> tuple[Path, dict[str, int]]:
    hf = tmp_path / "llama3"
    hf.mkdir()
    ids = save_llama3_tokenizer(hf, template_in_config=True)
    make_tiny_llama(hf, vocab=512, generation_config={"bos_token_id": ids["bos"], "eos_token_id": ids["eot"]})
    return hf, ids


def _tokenizer_args(imported: Path) -> list[str]:
    """The tokenizer section import-hf prints: the HF tokenizer's copy inside the checkpoint."""
    return ["tokenizer.tokenizer_type=HuggingFaceTokenizer",
            f"tokenizer.tokenizer_model={imported / 'iter_0000000' / 'tokenizer'}"]


# --- item 3: the chat template through fine-tune and export --------------------------------------------------------

@pytest.fixture(scope="module")
def chat_export(tmp_path_factory):
    """import-hf -> 60 iterations of finetune on two chats -> export-hf; transformers' greedy answer to the first
    question, prompted by the export's own chat template: (special ids, generated ids, decoded answer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp_path = tmp_path_factory.mktemp("chat")
    hf, ids = _llama3_chat_model(tmp_path)
    p = run_command(["import-hf", str(hf), str(tmp_path / "ckpt")], tmp_path)
    assert p.returncode == 0, p.stderr
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CHATS * 8))
    tokenizer = [*_tokenizer_args(tmp_path / "ckpt"), "optimizer.lr=1e-2", "finetuning.packing=false"]
    p = run_command([*finetune_args(tmp_path, data, tmp_path / "ckpt", imported_model_keys(tmp_path / "ckpt"), 60),
                 *tokenizer], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    p = run_command(["export-hf", str(tmp_path / "run"), str(tmp_path / "out")], tmp_path)
    assert p.returncode == 0, p.stderr
    tok = AutoTokenizer.from_pretrained(tmp_path / "out")  # the export's own template renders the prompt
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    prompt = tok.apply_chat_template(CHATS[0][:1], add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**prompt, max_new_tokens=12, do_sample=False)[0, prompt["input_ids"].shape[1]:]
    print(f"greedy answer: {tok.decode(out)!r}")
    return ids, out.tolist(), tok.decode(out)


def test_chat_finetune_export_keeps_the_template_and_answers(chat_export):
    """import-hf -> finetune on chats -> export-hf: transformers loads the export, apply_chat_template works on it,
    and greedy generate() gives the trained answer and stops at <|eot_id|>."""
    ids, out, answer = chat_export
    assert "Snow is white.<|eot_id|>" in answer and out[-1] == ids["eot"], answer


def test_chat_finetune_export_answers_without_bos(chat_export):
    """... and the answer holds no <|begin_of_text|>: the trained ids were apply_chat_template's."""
    ids, out, answer = chat_export
    assert ids["bos"] not in out and "<|begin_of_text|>" not in answer, answer


def _template_files(d: Path) -> dict[str, bytes]:
    return {str(f.relative_to(d)): f.read_bytes() for f in d.rglob("*") if f.is_file() and "chat_template" in str(f)}


def test_export_writes_every_chat_template_file_the_checkpoint_holds(tmp_path):
    """Named templates as transformers saves them (chat_template.jinja + additional_chat_templates/NAME.jinja) and
    a processor's chat_template.json: import-hf carries them into the checkpoint's tokenizer/, export-hf writes
    them back verbatim, and apply_chat_template renders every named template of the export as the original's."""
    from transformers import AutoTokenizer

    hf = tmp_path / "hf"
    hf.mkdir()
    save_llama3_tokenizer(hf)
    tok = AutoTokenizer.from_pretrained(hf)
    tok.chat_template = {"default": LLAMA3_TEMPLATE, "plain": "{% for m in messages %}{{ m['content'] }}{% endfor %}"}
    tok.save_pretrained(hf)
    (hf / "chat_template.json").write_text(json.dumps({"chat_template": LLAMA3_TEMPLATE}))
    make_tiny_llama(hf, vocab=512)
    assert set(_template_files(hf)) == {"chat_template.jinja", "chat_template.json",
                                        "additional_chat_templates/plain.jinja"}
    for args in (["import-hf", str(hf), str(tmp_path / "ckpt")], ["export-hf", str(tmp_path / "ckpt"),
                                                                   str(tmp_path / "out")]):
        p = run_command(args, tmp_path)
        assert p.returncode == 0, p.stderr
    assert _template_files(tmp_path / "out") == _template_files(hf)
    exported = AutoTokenizer.from_pretrained(tmp_path / "out")
    for name in ("default", "plain"):
        assert exported.apply_chat_template(CHATS[0], chat_template=name) == \
            AutoTokenizer.from_pretrained(hf).apply_chat_template(CHATS[0], chat_template=name)
    assert exported.apply_chat_template(CHATS[0], chat_template="plain", tokenize=False) == \
        "What color is snow?Snow is white."


def test_adapter_export_has_the_tokenizer_files_as_trl_saves_them(tmp_path):
    """export-hf --adapter-only writes, beside adapter_config.json, the tokenizer files the checkpoint holds
    (TRL's SFTTrainer saves the tokenizer with the adapter): AutoTokenizer loads the adapter directory and its
    chat template renders as the base's."""
    from transformers import AutoTokenizer

    hf, _ = _llama3_chat_model(tmp_path)
    p = run_command(["import-hf", str(hf), str(tmp_path / "ckpt")], tmp_path)
    assert p.returncode == 0, p.stderr
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(x) + "\n" for x in SFT_LINES))
    lora = ["peft.scheme=lora", "peft.dim=4", "peft.alpha=8.0", *_tokenizer_args(tmp_path / "ckpt")]
    keys = imported_model_keys(tmp_path / "ckpt")
    p = run_command([*finetune_args(tmp_path, data, tmp_path / "ckpt", keys, 2), *lora], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    p = run_command(["export-hf", "--adapter-only", str(tmp_path / "run"), str(tmp_path / "adapter")], tmp_path)
    assert p.returncode == 0, p.stderr
    names = {f.name for f in (tmp_path / "adapter").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert "generation_config.json" not in names  # the base's, not the adapter's
    tok = AutoTokenizer.from_pretrained(tmp_path / "adapter")
    assert tok.apply_chat_template(CHATS[0]) == AutoTokenizer.from_pretrained(hf).apply_chat_template(CHATS[0])


# --- item 7: the weight files transformers reads --------------------------------------------------------------------

def _sharded_llama(tmp_path: Path, name: str = "sharded") -> Path:
    """A tiny Llama saved by save_pretrained in shards with model.safetensors.index.json."""
    from transformers import AutoModelForCausalLM

    plain = make_tiny_llama(tmp_path / f"{name}-plain")
    out = tmp_path / name
    AutoModelForCausalLM.from_pretrained(plain).save_pretrained(out, max_shard_size="100KB")
    assert (out / "model.safetensors.index.json").is_file() and len(list(out.glob("model-*.safetensors"))) > 2
    return out


def _mistral_consolidated(hf: Path) -> None:
    """Mistral's repositories hold the HF shards and, beside them, the model in Mistral's own naming."""
    from safetensors.torch import save_file

    save_file({"layers.0.attention.wq.weight": torch.zeros(64, 64), "tok_embeddings.weight": torch.zeros(512, 64)},
              str(hf / "consolidated.safetensors"))


@pytest.mark.parametrize("index", [True, False], ids=["index", "model-star"])
def test_a_mistral_repository_layout_imports_the_hf_shards(tmp_path, index):
    """HF shards + consolidated.safetensors: import-hf reads the shards the index lists (or, without an index,
    model*.safetensors), never consolidated.safetensors, and gives transformers' logits."""
    hf = _sharded_llama(tmp_path)
    _mistral_consolidated(hf)
    if not index:
        (hf / "model.safetensors.index.json").unlink()
    p = run_command(["import-hf", str(hf), str(tmp_path / "ckpt")], tmp_path)
    assert p.returncode == 0, p.stderr
    p = run_command(["export-hf", str(tmp_path / "ckpt"), str(tmp_path / "out")], tmp_path)
    assert p.returncode == 0, p.stderr
    assert (hf_logits(tmp_path / "out") - hf_logits(tmp_path / "sharded-plain")).abs().max().item() == 0


def _header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _write(path: Path, header: dict, data: bytes, header_len: int | None = None) -> None:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text) if header_len is None else header_len) + text + data)


def _add_tensor(header: dict, data: bytes, name: str, dtype: str, shape: list[int]) -> tuple[dict, bytes]:
    size = {"F32": 4, "I64": 8}[dtype] * int(torch.tensor(shape).prod())
    return {**header, name: {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + size]}}, \
        data + bytes(size)


def _crafted(hf: Path, how: str) -> str:
    """Edit hf/model.safetensors the way `how` says; returns the tensor the error must name."""
    path = hf / "model.safetensors"
    header, data = _header(path)
    q = "model.layers.0.self_attn.q_proj.weight"
    if how == "unexpected name":
        _write(path, *_add_tensor(header, data, "model.layers.0.mlp.extra.weight", "F32", [4, 4]))
        return "model.layers.0.mlp.extra.weight"
    if how == "wrong shape":
        header[q]["shape"] = [32, 128]  # the same bytes, another shape
    elif how == "wrong dtype":
        del header[q]
        header, data = _add_tensor(header, data, q, "I64", [64, 64])
    elif how == "past the end":
        header[q]["data_offsets"] = [len(data) - 16, len(data) - 16 + 64 * 64 * 4]
    elif how == "absurd header":
        _write(path, header, data, header_len=1 << 60)
        return ""
    _write(path, header, data)
    return q


@pytest.mark.parametrize("how", ["unexpected name", "wrong shape", "wrong dtype", "past the end", "absurd header"])
def test_a_safetensors_entry_that_is_not_the_models_tensor_is_one_line_naming_file_and_tensor(tmp_path, how):
    """import-hf and a fine-tune from the HF directory refuse the file in one line (exit 2) naming the file
    and the tensor; nothing is written."""
    hf = make_tiny_llama(tmp_path / "hf")
    tensor = _crafted(hf, how)
    p = run_command(["import-hf", str(hf), str(tmp_path / "ckpt")], tmp_path)
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    line = p.stderr.strip()
    assert "\n" not in line and "model.safetensors" in line and tensor in line, line
    assert not (tmp_path / "ckpt" / "iter_0000000").exists()
    args = finetune_args(tmp_path, tmp_path / "sft.jsonl", hf, _model_keys(hf), 1)
    (tmp_path / "sft.jsonl").write_text(json.dumps(SFT_LINES[0]) + "\n")
    p = run_command(args, tmp_path)
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    assert "model.safetensors" in p.stderr and tensor in p.stderr.strip().splitlines()[-1], p.stderr[-2000:]


def _model_keys(hf: Path) -> dict:
    """The model section import-hf would print for `hf` (read from config.json only)."""
    from kubetron.hf.config_map import model_section, read_hf_config

    return model_section(read_hf_config(str(hf)))


def test_pytorch_model_bin_is_never_unpickled(tmp_path):
    """An HF directory with only pytorch_model.bin: import-hf and a fine-tune from it refuse it in one line
    (exit 2) saying why; the pickle's payload never runs."""
    hf = make_tiny_llama(tmp_path / "hf")
    (hf / "model.safetensors").unlink()
    marker = tmp_path / "payload-ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save({"model.embed_tokens.weight": Payload()}, hf / "pytorch_model.bin")
    p = run_command(["import-hf", str(hf), str(tmp_path / "ckpt")], tmp_path)
    assert p.returncode == 2 and "\n" not in p.stderr.strip() and "pytorch_model" in p.stderr, p.stderr[-2000:]
    (tmp_path / "sft.jsonl").write_text(json.dumps(SFT_LINES[0]) + "\n")
    p = run_command(finetune_args(tmp_path, tmp_path / "sft.jsonl", hf, _model_keys(hf), 1), tmp_path)
    assert p.returncode == 2 and "pytorch_model" in p.stderr.strip().splitlines()[-1], p.stderr[-2000:]
    assert not marker.exists()


# --- item 8: export in shards ------------------------------------------------------------------------------------

def test_export_writes_shards_with_an_index_that_transformers_loads(tmp_path):
    """export-hf --max-shard-size 100KB: model-0000i-of-0000n.safetensors + model.safetensors.index.json (as
    save_pretrained writes them), a progress line per shard; transformers loads it with the same logits, and
    import-hf reads the sharded export back bit-exactly."""
    hf = make_tiny_llama(tmp_path / "hf")
    p = run_command(["import-hf", str(hf), str(tmp_path / "ckpt")], tmp_path)
    assert p.returncode == 0, p.stderr
    p = run_command(["export-hf", "--max-shard-size", "100KB", str(tmp_path / "ckpt"), str(tmp_path / "out")], tmp_path)
    assert p.returncode == 0, p.stderr
    shards = sorted((tmp_path / "out").glob("model-*.safetensors"))
    assert len(shards) >= 3 and not (tmp_path / "out" / "model.safetensors").exists()
    assert [s.name for s in shards] == [f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                                        for i in range(1, len(shards) + 1)]
    assert all(s.stat().st_size <= 100_000 or len(_header(s)[0]) <= 2 for s in shards)  # one big tensor alone
    assert sum("export-hf: wrote model-" in line for line in p.stderr.splitlines()) == len(shards), p.stderr
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {s.name for s in shards}
    assert (hf_logits(tmp_path / "out") - hf_logits(hf)).abs().max().item() == 0
    p = run_command(["import-hf", str(tmp_path / "out"), str(tmp_path / "again")], tmp_path)
    assert p.returncode == 0, p.stderr
    first, again = imported_tensors(tmp_path / "ckpt"), imported_tensors(tmp_path / "again")
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)


@pytest.mark.parametrize("size", ["5XB", "0", "-1GB", "GB"])
def test_a_bad_max_shard_size_is_one_line(tmp_path, capsys, size):
    from kubetron.cli import main

    assert main(["export-hf", "--max-shard-size", size, str(tmp_path / "none"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--max-shard-size" in err, err
    assert not (tmp_path / "out").exists()
