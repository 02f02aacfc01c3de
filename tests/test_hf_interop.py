"""Hugging Face interop: a tiny random `transformers` Llama (GQA, untied, Llama-3 rope scaling) through
`kubetron import-hf`, the trainer's model at TP=1 and TP=2, `kubetron finetune` on packed SFT data and
`kubetron export-hf` back to `transformers`; Qwen2, Qwen3 (head_dim != hidden/heads, q/k norms) and
Mistral round trips; bad inputs are one line and exit 2 with nothing written.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.hf_utils import (
    SFT_LINES,
    TOKENS,
    config_for,
    finetune_args,
    hf_logits,
    import_finetune_export,
    imported_model_keys,
    imported_tensors,
    kubetron_logits,
    make_tiny_llama,
    make_tiny_qwen3,
    )
from tests.inprocess import ensure_world_of_one, run_command

pytestmark = pytest.mark.trainer

pytest.importorskip("transformers")
REPO = Path(__file__).resolve().parent.parent
TOL = 1e-5  # fp32; measured: 0.0 (the same operations in the same order)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    hf = make_tiny_llama(root / "llama")
    return SimpleNamespace(root=root, hf=hf, logits=hf_logits(hf))


@pytest.fixture(scope="module")
def imported(tiny):
    from kubetron.cli import main

    out = tiny.root / "ckpt"
    assert main(["import-hf", str(tiny.hf), str(out)]) == 0
    return out


def test_import_gives_transformers_logits_at_tp1(tiny, imported):
    from kubetron.checkpoint import canonical
    from kubetron.hf.io import load_hf_into_model
    from kubetron.training.model import build_model

    ensure_world_of_one()
    keys = imported_model_keys(imported)
    assert (keys["num_query_groups"], keys["rope_scaling"], keys["share_embeddings_and_output_weights"]) == (2, True,
                                                                                                             False)
    cfg = config_for(keys)
    model = build_model(cfg, torch.device("cpu"))
    canonical.load_model_state(model, imported_tensors(imported))
    diff = (kubetron_logits(model[0]) - tiny.logits).abs().max().item()
    print(f"TP=1 import-hf checkpoint vs transformers: max abs logit diff {diff:.3g}")
    assert diff <= TOL
    model = build_model(cfg, torch.device("cpu"))
    load_hf_into_model(model, cfg, str(tiny.hf))  # pretrained_checkpoint = the HF directory itself
    assert (kubetron_logits(model[0]) - tiny.logits).abs().max().item() <= TOL
    # The rope scaling is not a no-op at this size: without it the logits are far off.
    model = build_model(config_for(keys, "model.rope_scaling=false"), torch.device("cpu"))
    canonical.load_model_state(model, imported_tensors(imported))
    assert (kubetron_logits(model[0]) - tiny.logits).abs().max().item() > 0.1


def test_llama3_rope_scaling_equals_transformers_in_all_three_bands(tmp_path):
    """Llama 3.1/3.2 `rope_type: llama3`: with rope_theta 10000 the head's frequencies fall in all three
    bands of transformers' _compute_llama3_parameters (kept, divided by factor, interpolated between);
    the model's inv_freq equals transformers' and so do the logits."""
    from kubetron.hf.io import import_hf
    from kubetron.training.model import build_model
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = make_tiny_llama(tmp_path / "llama", rope_theta=10000.0)
    keys = import_hf(str(hf), str(tmp_path / "ckpt"))
    ensure_world_of_one()
    model = build_model(config_for(keys), torch.device("cpu"))
    got = model[0].rotary_pos_emb.inv_freq
    want = ROPE_INIT_FUNCTIONS["llama3"](AutoConfig.from_pretrained(hf), "cpu")[0]
    assert torch.equal(got, want), (got, want)
    plain = 1.0 / 10000.0 ** (torch.arange(0, 16, 2).float() / 16)
    kept, divided = torch.isclose(got, plain), torch.isclose(got, plain / 4)
    assert kept.any() and divided.any() and (~kept & ~divided).any(), got / plain
    _load_canonical(model, tmp_path / "ckpt")
    assert (kubetron_logits(model[0]) - hf_logits(hf)).abs().max().item() <= TOL


def test_import_then_export_is_bit_exact_and_transformers_loads_it(tiny, imported, capsys):
    from kubetron.cli import main
    from safetensors.torch import load_file

    out = tiny.root / "exported"
    assert main(["export-hf", str(imported), str(out)]) == 0
    assert "LlamaForCausalLM" in capsys.readouterr().out
    original = {k: v for f in tiny.hf.glob("*.safetensors") for k, v in load_file(f).items()}
    exported = load_file(out / "model.safetensors")
    assert sorted(exported) == sorted(original)
    assert all(torch.equal(exported[k], original[k]) for k in original)
    diff = (hf_logits(out) - tiny.logits).abs().max().item()
    print(f"export-hf -> transformers: max abs logit diff {diff:.3g}")
    assert diff <= TOL


@pytest.mark.process
def test_tp2_gives_transformers_logits(tiny, imported, tmp_path):
    from tests.multirank.runner import environment, free_port

    out = tmp_path / "logits.pt"
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    p = subprocess.run([torchrun, "--nproc-per-node", "2", "--master-port", str(free_port()), "-m",
                        "tests.multirank.hf_logits", str(imported), str(tiny.hf), str(out)],
                       cwd=REPO, env=environment(tmp_path), capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stderr[-3000:]
    got = torch.load(out, weights_only=True)
    assert got["local_qkv_rows"] == (4 + 2 * 2) * 16 // 2  # really split over 2 TP ranks
    for key in ("from_checkpoint", "from_hf_dir"):
        diff = (got[key] - tiny.logits).abs().max().item()
        print(f"TP=2 {key} vs transformers: max abs logit diff {diff:.3g}")
        assert diff <= TOL


def test_unsupported_architecture_is_one_line_exit_2_nothing_written(tiny, tmp_path):
    bad = tmp_path / "gpt2"
    bad.mkdir()
    cfg = json.loads((tiny.hf / "config.json").read_text())
    cfg.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (bad / "config.json").write_text(json.dumps(cfg))
    (bad / "model.safetensors").write_bytes((tiny.hf / "model.safetensors").read_bytes())
    p = run_command(["import-hf", str(bad), str(tmp_path / "out")], tmp_path)
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().count("\n") == 0 and "architectures" in p.stderr and "GPT2LMHeadModel" in p.stderr
    assert not (tmp_path / "out").exists()


def test_finetune_packed_from_import_then_export_generates(tiny, imported, tmp_path):
    """The user's path: import-hf -> finetune (packed SFT) -> export-hf -> transformers generate."""
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(x) + "\n" for x in SFT_LINES))
    p = run_command(finetune_args(tmp_path, data, imported, imported_model_keys(imported), 6), tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "packed" in p.stderr + p.stdout
    p = run_command(["export-hf", str(tmp_path / "run"), str(tmp_path / "hf-out")], tmp_path)
    assert p.returncode == 0, p.stderr
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    tuned = load_file(tmp_path / "hf-out" / "model.safetensors")
    start = load_file(tiny.hf / "model.safetensors")
    assert not torch.equal(tuned["model.layers.0.mlp.up_proj.weight"], start["model.layers.0.mlp.up_proj.weight"])
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf-out").eval()
    # The exported model computes what the trained checkpoint computes (read by the trainer's own reader)...
    from kubetron.checkpoint import canonical
    from kubetron.hf.io import read_checkpoint
    from kubetron.training.model import build_model

    ensure_world_of_one()
    keys, tensors, _, _ = read_checkpoint(str(tmp_path / "run"))
    trained = build_model(config_for(keys), torch.device("cpu"))
    canonical.load_model_state(trained, tensors)
    diff = (kubetron_logits(trained[0]) - hf_logits(tmp_path / "hf-out")).abs().max().item()
    assert diff <= TOL, diff
    # ... and it learned: transformers' loss on a training example fell.
    text = torch.tensor([list((SFT_LINES[3]["input"] + SFT_LINES[3]["output"]).encode())])
    with torch.no_grad():
        before = AutoModelForCausalLM.from_pretrained(tiny.hf)(text, labels=text).loss.item()
        after = model(text, labels=text).loss.item()
    assert after < before, (before, after)
    prompt = torch.tensor([list(b"Q3: what is 3 plus 3? ")])
    new = model.generate(prompt, max_new_tokens=4, do_sample=False)[0, prompt.shape[1]:].tolist()
    assert 1 <= len(new) <= 4 and 256 not in new[:-1] and (len(new) == 4 or new[-1] == 256)  # eod (256) stops it


INSTRUCT_GENERATION = {"bos_token_id": 258, "eos_token_id": [256, 300], "pad_token_id": 257}  # Llama-3-Instruct-like


def test_generate_stops_at_the_base_stop_ids_after_import_finetune_export(tmp_path):
    """import-hf -> finetune -> export-hf keeps the base's special ids and its generation_config.json (two
    stop ids): transformers' generate(), given no eos, stops at the second one, which the model emits."""
    from transformers import AutoModelForCausalLM

    hf = make_tiny_llama(tmp_path / "llama", argmax=300, generation_config=INSTRUCT_GENERATION)
    import_finetune_export(tmp_path, hf, 2)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["eos_token_id"], config["pad_token_id"]) == (256, 257)  # config.json's, as the base had them
    assert json.loads((tmp_path / "out" / "generation_config.json").read_text()) == INSTRUCT_GENERATION
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    prompt = torch.tensor([list(b"Q3: what is 3 plus 3? ")])
    out = model.generate(prompt, max_new_tokens=8, do_sample=False)[0, prompt.shape[1]:].tolist()
    assert out == [300], out  # stopped at the stop id, well before max_new_tokens


def test_export_of_a_model_trained_from_scratch_takes_the_ids_from_its_tokenizer(tmp_path):
    """No HF base: the byte tokenizer's eod (256) is eos, its pad (257) pad, in config.json and in
    generation_config.json, so transformers' generate() stops at eod."""
    from transformers import AutoModelForCausalLM

    llama = ["model.normalization=RMSNorm", "model.activation=swiglu", "model.add_bias_linear=false",
             "model.share_embeddings_and_output_weights=false", "train.train_iters=1", "scheduler.lr_warmup_iters=0",
             "validation.eval_interval=null",
             f"checkpoint.save={tmp_path / 'run'}", "checkpoint.save_interval=1"]
    p = run_command(["train", "--config", str(REPO / "examples" / "tiny-gpt.yaml"), *llama], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    p = run_command(["export-hf", str(tmp_path / "run"), str(tmp_path / "out")], tmp_path)
    assert p.returncode == 0, p.stderr
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["eos_token_id"], config["pad_token_id"], config.get("bos_token_id")) == (256, 257, None)
    gen = AutoModelForCausalLM.from_pretrained(tmp_path / "out").generation_config
    assert (gen.eos_token_id, gen.pad_token_id) == (256, 257)


def test_lora_on_an_import_exports_an_adapter_that_peft_loads_onto_the_hf_base(tiny, imported, tmp_path):
    """LoRA on import-hf's checkpoint -> export-hf --adapter-only: the adapter names the HF directory the
    import read, so PEFT's AutoPeftModelForCausalLM loads it, and computes the merged export's logits."""
    peft = pytest.importorskip("peft")
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(x) + "\n" for x in SFT_LINES))
    lora = ["peft.scheme=lora", "peft.dim=4", "peft.alpha=8.0", "optimizer.lr=2e-2"]
    p = run_command([*finetune_args(tmp_path, data, imported, imported_model_keys(imported), 4), *lora], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    for args in (["--adapter-only", str(tmp_path / "adapter")], [str(tmp_path / "merged")]):
        p = run_command(["export-hf", str(tmp_path / "run"), *args], tmp_path)
        assert p.returncode == 0, p.stderr
    conf = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert conf["base_model_name_or_path"] == str(tiny.hf.resolve())
    model = peft.AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapter").eval()
    with torch.no_grad():
        adapted = model(TOKENS).logits
    diff = (adapted - hf_logits(tmp_path / "merged")).abs().max().item()
    print(f"PEFT (HF base + exported adapter) vs merged export: max abs logit diff {diff:.3g}")
    assert diff <= 1e-4
    assert (adapted - tiny.logits).abs().max().item() > 1e-2  # the adapter changes the model
    # adapters on a trained kubetron checkpoint (no import-hf output): no HF base to name, refused
    import shutil

    from kubetron.contract.errors import ConfigError
    from kubetron.hf.io import peft_base_name

    trained = tmp_path / "trained"
    shutil.copytree(imported, trained)
    common = torch.load(trained / "iter_0000000" / "common.pt", weights_only=True)
    del common["source"]
    torch.save(common, trained / "iter_0000000" / "common.pt")
    with pytest.raises(ConfigError, match="--adapter-only"):
        peft_base_name(str(trained))


def test_jsonl_line_without_the_key_is_one_line_exit_2_nothing_written(imported, tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps(SFT_LINES[0]) + "\n" + json.dumps({"input": "no answer"}) + "\n")
    p = run_command(finetune_args(tmp_path, data, imported, imported_model_keys(imported), 2), tmp_path)
    assert p.returncode == 2, p.stderr[-3000:]
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("kubetron: error: finetuning.data_path:") and f"{data}:2" in last and "'output'" in last
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


def test_qwen2_tied_with_qkv_bias_round_trips_with_equal_logits(tmp_path):
    """Qwen2: biases on q/k/v only, tied embeddings (no lm_head in the checkpoint)."""
    from kubetron.checkpoint import canonical
    from kubetron.hf.io import export_hf, import_hf
    from kubetron.training.model import build_model
    from safetensors.torch import load_file
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1)
    cfg = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=True, rope_theta=1000000.0, initializer_range=0.1)
    hf = Qwen2ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)  # zero-initialized otherwise: a dropped bias would not show
    hf.save_pretrained(tmp_path / "qwen")
    _write_tokenizer(tmp_path / "qwen")
    keys = import_hf(str(tmp_path / "qwen"), str(tmp_path / "ckpt"))
    assert keys["add_qkv_bias"] and keys["share_embeddings_and_output_weights"]
    ensure_world_of_one()
    model = build_model(config_for(keys), torch.device("cpu"))
    canonical.load_model_state(model, imported_tensors(tmp_path / "ckpt"))
    with torch.no_grad():
        want = hf(TOKENS).logits
    assert (kubetron_logits(model[0]) - want).abs().max().item() <= TOL
    export_hf(str(tmp_path / "ckpt"), str(tmp_path / "out"))
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    for f in ("tokenizer.json", "tokenizer_config.json"):  # carried through the checkpoint unchanged
        assert (tmp_path / "out" / f).read_bytes() == (tmp_path / "qwen" / f).read_bytes()
    original = load_file(tmp_path / "qwen" / "model.safetensors")
    exported = load_file(tmp_path / "out" / "model.safetensors")
    original.pop("lm_head.weight", None)
    assert sorted(exported) == sorted(original) and all(torch.equal(exported[k], original[k]) for k in original)
    assert (hf_logits(tmp_path / "out") - want).abs().max().item() <= TOL


def test_mistral_sliding_window_round_trips_with_equal_logits_beyond_the_window(tmp_path):
    """Mistral with an 8-token window on 48-token sequences: kubetron's model applies the window (alone and
    in packed sequences) and export-hf writes MistralForCausalLM with it; logits equal at every position."""
    from kubetron.checkpoint import canonical
    from kubetron.hf.io import export_hf, import_hf
    from kubetron.training.model import build_model
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(2)
    cfg = MistralConfig(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                        sliding_window=8, initializer_range=0.1)
    MistralForCausalLM(cfg).float().eval().save_pretrained(tmp_path / "mistral")
    want = hf_logits(tmp_path / "mistral")
    keys = import_hf(str(tmp_path / "mistral"), str(tmp_path / "ckpt"))
    assert keys["sliding_window"] == 8
    ensure_world_of_one()
    model = build_model(config_for(keys), torch.device("cpu"))
    canonical.load_model_state(model, imported_tensors(tmp_path / "ckpt"))
    diff = (kubetron_logits(model[0]) - want).abs().max().item()
    print(f"Mistral, window 8, 48 tokens: max abs logit diff to transformers {diff:.3g}")
    assert diff <= TOL
    # two packed documents (20 + 28 tokens): the window inside each, as transformers on each alone
    s, cut = TOKENS.shape[1], 20
    doc = torch.arange(s) >= cut
    mask = ~((doc[:, None] == doc[None, :]) & torch.ones(s, s, dtype=torch.bool).tril())
    positions = torch.cat([torch.arange(cut), torch.arange(s - cut)]).expand_as(TOKENS)
    packed = kubetron_logits(model[0], attention_mask=mask.expand(TOKENS.shape[0], 1, s, s), position_ids=positions)
    alone = torch.cat([hf_logits(tmp_path / "mistral", part) for part in (TOKENS[:, :cut], TOKENS[:, cut:])], dim=1)
    assert (packed - alone).abs().max().item() <= TOL
    export_hf(str(tmp_path / "ckpt"), str(tmp_path / "out"))
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (exported["architectures"], exported["sliding_window"]) == (["MistralForCausalLM"], 8)
    assert (hf_logits(tmp_path / "out") - want).abs().max().item() <= TOL
    # the window is not a no-op here: without it the logits past the window are far off
    full = build_model(config_for(keys, "model.sliding_window=null"), torch.device("cpu"))
    canonical.load_model_state(full, imported_tensors(tmp_path / "ckpt"))
    assert (kubetron_logits(full[0]) - want)[:, 8:].abs().max().item() > 0.1
    # ... so a run that leaves the window out of its model section may not start from the import
    from kubetron.checkpoint.layout import check_architecture
    from kubetron.contract.errors import ConfigError

    common = torch.load(tmp_path / "ckpt" / "iter_0000000" / "common.pt", weights_only=True)
    with pytest.raises(ConfigError, match="model.sliding_window: checkpoint 8, this run None"):
        check_architecture(common["model_config"], config_for(keys, "model.sliding_window=null"), "iter_0000000")


def _load_canonical(model, ckpt: Path, drop: tuple[str, ...] = ()):
    from kubetron.checkpoint import canonical

    tensors = imported_tensors(ckpt)
    canonical.load_model_state(model, {k: v for k, v in tensors.items() if not any(d in k for d in drop)})


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_qwen3_head_dim_and_qk_norm_round_trip_with_equal_logits(tmp_path, tied):
    """Qwen3: head_dim 24 with 4 heads on hidden 64 (model.kv_channels), per-head q/k RMSNorm
    (model.qk_layernorm), GQA, tied or untied: import-hf gives transformers' logits, export-hf writes
    Qwen3ForCausalLM with the same tensors bit for bit."""
    from kubetron.hf.io import export_hf, import_hf
    from kubetron.training.model import build_model
    from safetensors.torch import load_file

    hf = make_tiny_qwen3(tmp_path / "qwen3", tied=tied)
    want = hf_logits(hf)
    keys = import_hf(str(hf), str(tmp_path / "ckpt"))
    assert (keys["kv_channels"], keys["qk_layernorm"], keys["num_query_groups"],
            keys["share_embeddings_and_output_weights"]) == (24, True, 2, tied)
    ensure_world_of_one()
    model = build_model(config_for(keys), torch.device("cpu"))
    _load_canonical(model, tmp_path / "ckpt")
    assert model[0].decoder.layers[0].self_attention.linear_qkv.weight.shape == ((4 + 2 * 2) * 24, 64)
    diff = (kubetron_logits(model[0]) - want).abs().max().item()
    print(f"Qwen3 ({'tied' if tied else 'untied'}): max abs logit diff to transformers {diff:.3g}")
    assert diff <= TOL
    # the q/k norms are not a no-op: the same weights without them give other logits
    plain = build_model(config_for(keys, "model.qk_layernorm=false"), torch.device("cpu"))
    _load_canonical(plain, tmp_path / "ckpt", drop=(".q_layernorm.", ".k_layernorm."))
    assert (kubetron_logits(plain[0]) - want).abs().max().item() > 0.1

    export_hf(str(tmp_path / "ckpt"), str(tmp_path / "out"))
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["architectures"], config["head_dim"], config["tie_word_embeddings"]) == (["Qwen3ForCausalLM"], 24,
                                                                                            tied)
    original = load_file(hf / "model.safetensors")
    exported = load_file(tmp_path / "out" / "model.safetensors")
    if tied:
        original.pop("lm_head.weight", None)
    assert sorted(exported) == sorted(original) and all(torch.equal(exported[k], original[k]) for k in original)
    assert (hf_logits(tmp_path / "out") - want).abs().max().item() <= TOL


def test_qwen3_import_finetune_export_through_the_cli(tmp_path):
    """The user's path for Qwen3: import-hf -> finetune from the import (its printed model section) ->
    export-hf; transformers computes what the trained checkpoint computes, and the q/k norms trained."""
    from kubetron.checkpoint import canonical
    from kubetron.hf.io import read_checkpoint
    from kubetron.training.model import build_model
    from safetensors.torch import load_file

    hf = make_tiny_qwen3(tmp_path / "qwen3", tied=True)
    out = import_finetune_export(tmp_path, hf, 3)
    assert "kv_channels: 24" in out and "qk_layernorm: true" in out, out
    tuned, start = load_file(tmp_path / "out" / "model.safetensors"), load_file(hf / "model.safetensors")
    q_norm = "model.layers.0.self_attn.q_norm.weight"
    assert not torch.equal(tuned[q_norm], start[q_norm])
    ensure_world_of_one()
    keys, tensors, _, _ = read_checkpoint(str(tmp_path / "run"))
    trained = build_model(config_for(keys), torch.device("cpu"))
    canonical.load_model_state(trained, tensors)
    assert (kubetron_logits(trained[0]) - hf_logits(tmp_path / "out")).abs().max().item() <= TOL


@pytest.mark.process
def test_qwen3_at_tp2_gives_transformers_logits(tmp_path):
    """The q/k norms are replicated over TP ranks that each hold half of the heads (24 channels each)."""
    from kubetron.hf.io import import_hf

    from tests.multirank.runner import environment, free_port

    hf = make_tiny_qwen3(tmp_path / "qwen3", tied=False)
    import_hf(str(hf), str(tmp_path / "ckpt"))
    out = tmp_path / "logits.pt"
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    p = subprocess.run([torchrun, "--nproc-per-node", "2", "--master-port", str(free_port()), "-m",
                        "tests.multirank.hf_logits", str(tmp_path / "ckpt"), str(hf), str(out)],
                       cwd=REPO, env=environment(tmp_path), capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stderr[-3000:]
    got = torch.load(out, weights_only=True)
    assert got["local_qkv_rows"] == (4 + 2 * 2) * 24 // 2
    want = hf_logits(hf)
    for key in ("from_checkpoint", "from_hf_dir"):
        diff = (got[key] - want).abs().max().item()
        print(f"Qwen3 TP=2 {key} vs transformers: max abs logit diff {diff:.3g}")
        assert diff <= TOL


def test_checkpoint_records_qk_layernorm_and_head_size(tmp_path):
    """A run whose model lacks the q/k norms or has another head size may not start from a Qwen3 import;
    kv_channels null and kv_channels = hidden/heads are the same model."""
    from kubetron.checkpoint.layout import check_architecture
    from kubetron.contract.errors import ConfigError
    from kubetron.hf.io import import_hf

    keys = import_hf(str(make_tiny_qwen3(tmp_path / "qwen3", tied=True)), str(tmp_path / "ckpt"))
    saved = torch.load(tmp_path / "ckpt" / "iter_0000000" / "common.pt", weights_only=True)["model_config"]
    assert (saved["qk_layernorm"], saved["kv_channels"]) == (True, 24)
    check_architecture(saved, config_for(keys), "iter_0000000")
    with pytest.raises(ConfigError, match="model.qk_layernorm: checkpoint True, this run False"):
        check_architecture(saved, config_for(keys, "model.qk_layernorm=false"), "iter_0000000")
    with pytest.raises(ConfigError, match="model.kv_channels: checkpoint 24, this run 16"):
        check_architecture(saved, config_for(keys, "model.kv_channels=null"), "iter_0000000")
    llama = {**saved, "qk_layernorm": False, "kv_channels": 16}
    check_architecture(llama, config_for(keys, "model.qk_layernorm=false", "model.kv_channels=null"), "x")
    check_architecture(llama, config_for(keys, "model.qk_layernorm=false", "model.kv_channels=16"), "x")


@pytest.mark.parametrize("field,value", [("use_sliding_window", True), ("layer_types", ["full_attention",
                                                                                      "sliding_attention"]),
                                         ("attention_bias", True)])
def test_qwen3_sliding_window_and_attention_bias_are_one_line_exit_2(tmp_path, field, value):
    """Qwen3's per-layer sliding window and its attention biases (o_proj's too) are refused, not dropped."""
    hf = make_tiny_qwen3(tmp_path / "qwen3", tied=False)
    cfg = json.loads((hf / "config.json").read_text())
    cfg[field] = value
    if field == "use_sliding_window":
        cfg.update(sliding_window=8, max_window_layers=1)
    (hf / "config.json").write_text(json.dumps(cfg))
    p = run_command(["import-hf", str(hf), str(tmp_path / "out")], tmp_path)
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().count("\n") == 0 and f"config.json: {field}" in p.stderr, p.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("both,named", [(("qk_layernorm", "add_qkv_bias"), "model.add_qkv_bias"),
                                        (("add_qkv_bias", "sliding_window"), "model.sliding_window"),
                                        (("qk_layernorm", "sliding_window"), "model.sliding_window")])
def test_export_refuses_attention_no_hf_architecture_has(both, named):
    """Qwen3 has q/k norms, Qwen2 q/k/v biases, Mistral a window: a model with two of them has no HF class."""
    from kubetron.contract.config import GPTModelConfig
    from kubetron.contract.errors import ConfigError
    from kubetron.hf.config_map import hf_config

    llama = {"normalization": "RMSNorm", "activation": "swiglu", "add_bias_linear": False, "vocab_size": 512}
    m = GPTModelConfig(**llama, **{k: 8 if k == "sliding_window" else True for k in both}).model_dump()
    with pytest.raises(ConfigError, match=f"{named}: export-hf has no architecture with both"):
        hf_config(m)
    assert hf_config({**m, both[1]: None if both[1] == "sliding_window" else False})["architectures"] != [
        "LlamaForCausalLM"]


def test_qwen2_sliding_window_is_refused_naming_the_field():
    """Qwen2's window covers only the layers from max_window_layers on: refused, not dropped."""
    from kubetron.contract.errors import ConfigError
    from kubetron.hf.config_map import model_section
    from transformers import Qwen2Config

    cfg = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      use_sliding_window=True, sliding_window=8, max_window_layers=1).to_dict()
    with pytest.raises(ConfigError, match="use_sliding_window"):
        model_section({**cfg, "architectures": ["Qwen2ForCausalLM"]})


def _write_tokenizer(hf_dir: Path):
    """A small BPE trained here with `tokenizers` (no download), eos declared as HF does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<|endoftext|>"])
    tok.train_from_iterator([x["input"] + x["output"] for x in SFT_LINES] * 5, trainer)
    tok.save(str(hf_dir / "tokenizer.json"))
    (hf_dir / "tokenizer_config.json").write_text('{"eos_token": "<|endoftext|>", "model_max_length": 128}')


def test_import_prints_a_tokenizer_section_that_sft_data_uses(tmp_path, capsys):
    """The printed config works as printed: its tokenizer reads the copy inside the checkpoint."""
    import yaml
    from kubetron.cli import main
    from kubetron.config import ConfigContainer
    from kubetron.data.finetuning import FinetuningDataset
    from kubetron.data.loader import build_tokenizer_from_config

    hf = make_tiny_llama(tmp_path / "llama")
    _write_tokenizer(hf)
    assert main(["import-hf", str(hf), str(tmp_path / "ckpt")]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["tokenizer"]["tokenizer_type"] == "HuggingFaceTokenizer"
    cfg = ConfigContainer.from_dict({**printed, "train": {"train_iters": 1}})
    tok = build_tokenizer_from_config(cfg)
    data = tmp_path / "sft.jsonl"
    data.write_text(json.dumps(SFT_LINES[5]) + "\n")
    s = FinetuningDataset(str(data), tok, 64, packing=True, seed=0)[0]
    answer = [int(t) for t, m in zip(s["labels"], s["loss_mask"], strict=True) if m]
    # prompt + answer are encoded together (TRL's rule): the prompt's trailing space merges into the answer's token
    assert answer[-1] == tok.eod and tok.decode(answer[:-1]).strip() == SFT_LINES[5]["output"]


def _losses(stdout: str) -> dict[int, str]:
    import re

    return {int(m.group(1)): m.group(2) for m in re.finditer(r"iteration\s+(\d+)/.*?lm loss: ([0-9.E+-]+)", stdout)}


SIGNALLED_ITERS = 12


def test_packed_sft_resumes_after_sigterm_with_the_same_losses(imported, tmp_path):
    """The fine-tuning data position is restored exactly: a run stopped by SIGTERM and resumed logs the
    losses of an uninterrupted run (packing on, several epochs of a small JSONL, shuffled per epoch)."""
    from tests.inprocess import Driver, console, drive_argv

    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(x) + "\n" for x in SFT_LINES))
    keys = imported_model_keys(imported)
    printed = {}
    for name, args, driver in (
            ("straight", finetune_args(tmp_path / "a", data, imported, keys, SIGNALLED_ITERS), None),
            ("signalled", [*finetune_args(tmp_path / "b", data, imported, keys, SIGNALLED_ITERS),
                           "train.exit_signal_handler=true", f"checkpoint.load={tmp_path / 'b' / 'run'}"],
             Driver().signal_at(3)),
            ("resumed", [*finetune_args(tmp_path / "b", data, imported, keys, SIGNALLED_ITERS),
                         "train.exit_signal_handler=true", f"checkpoint.load={tmp_path / 'b' / 'run'}"], None)):
        with console() as out:
            code = drive_argv(tmp_path, args, driver=driver).code
        assert code == (75 if driver else 0), name
        printed[name] = out.getvalue()
    first, second, want = _losses(printed["signalled"]), _losses(printed["resumed"]), _losses(printed["straight"])
    assert min(second) == max(first) + 1 and sorted({**first, **second}) == list(range(1, SIGNALLED_ITERS + 1))
    assert {**first, **second} == want
