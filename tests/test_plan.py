"""`kubetron plan`: the memory estimate against bytes measured on CPU, the recipes at their stated sizes,
and the command as a user runs it."""

from __future__ import annotations

import gc
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kubetron.contract.config import GPTModelConfig
from kubetron.contract.errors import ConfigError
from kubetron.plan import GIB, Shape, make_plan, parse_memory

from tests.inprocess import ensure_world_of_one, in_process_config

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parent.parent
RECIPES = sorted((REPO / "recipes").glob("*.yaml"))
PLAN_LINE = re.compile(r"^# plan: (.+)$", re.M)
QWEN3_KEYS = ("kv_channels", "qk_layernorm")
QWEN3_READY = all(k in GPTModelConfig.model_fields for k in QWEN3_KEYS)  # the trainer's Qwen3 support
TOLERANCE = 0.05  # the issue asks for 15 %; the terms are modeled on the layer spec, measured within 2.5 %


# --- measured on CPU ----------------------------------------------------------------------------------

def _live_tensor_bytes() -> dict[int, int]:
    """{storage pointer: bytes} of every tensor Python can reach (parameters, grads, optimizer state)."""
    out = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            st = obj.untyped_storage()
            out[st.data_ptr()] = st.nbytes()
    return out


class _Held:
    """What the graph keeps for one saved tensor: releases its bytes from the count when dropped."""

    def __init__(self, count: _SavedBytes, ptr: int, t: torch.Tensor):
        self.count, self.ptr, self.t = count, ptr, t

    def __del__(self):
        self.count.release(self.ptr)


class _SavedBytes:
    """Peak of the unique storage bytes the autograd graph holds for backward (parameters excluded),
    over the forward and the backward pass (where recomputed layers save theirs again)."""

    def __init__(self, model):
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.live: dict[int, list[int]] = {}  # storage pointer -> [holders, bytes]
        self.current = self.peak = 0

    def pack(self, t):
        ptr = t.untyped_storage().data_ptr()
        if ptr in self.params:
            return t
        entry = self.live.setdefault(ptr, [0, t.untyped_storage().nbytes()])
        if entry[0] == 0:
            self.current += entry[1]
            self.peak = max(self.peak, self.current)
        entry[0] += 1
        return _Held(self, ptr, t)

    def release(self, ptr: int):
        entry = self.live[ptr]
        entry[0] -= 1
        if entry[0] == 0:
            self.current -= entry[1]
            del self.live[ptr]

    @staticmethod
    def unpack(held):
        return held.t if isinstance(held, _Held) else held


def measure(*overrides: str, world_size: int = 1) -> tuple[dict[str, int], object]:
    """Train a tiny fp32 model for two steps on CPU; return this rank's measured bytes and the config.
    `world_size` > 1: under torchrun, model parallel as the config says.

    static: every tensor alive after the steps, minus those alive before the model was built.
    activations: the peak of the bytes held for backward during the last step.
    """
    from kubetron.training.entry import set_seeds
    from kubetron.training.model import build_model
    from kubetron.training.optim import build_optimizer

    cfg = in_process_config("train.micro_batch_size=2", f"train.global_batch_size={2 * world_size}", *overrides)
    cfg.finalize(world_size=world_size)
    if world_size == 1:
        ensure_world_of_one()
    else:
        import torch.distributed as dist
        from megatron.core import parallel_state

        dist.init_process_group("gloo")
        parallel_state.initialize_model_parallel(cfg.model.tensor_model_parallel_size,
                                                 cfg.model.pipeline_model_parallel_size,
                                                 expert_model_parallel_size=cfg.model.expert_model_parallel_size)
    set_seeds(cfg)
    gc.collect()
    before = _live_tensor_bytes()
    model = build_model(cfg, torch.device("cpu"))
    opt = build_optimizer(cfg, model)
    b, s = cfg.train.micro_batch_size, cfg.model.seq_length
    tokens = torch.randint(0, 258, (b, s), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(s).expand(b, s)
    for _ in range(2):
        saved = _SavedBytes(model[0])
        opt.zero_grad()
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            loss = model[0](tokens, pos, None, labels=tokens.roll(-1, 1)).mean()
            loss.backward()
        opt.finish_grad_sync()
        opt.step()
    assert saved.current == 0  # every saved tensor was released by the backward pass
    del loss
    gc.collect()
    static = sum(n for ptr, n in _live_tensor_bytes().items() if ptr not in before)
    return {"static": static, "activations": saved.peak,
            "params": sum(p.numel() for p in model[0].parameters()),
            "expert_params": sum(p.numel() for n, p in model[0].named_parameters() if ".experts." in n)}, cfg


SHAPES = {
    "gpt-layernorm-gelu": ["model.num_layers=4", "model.hidden_size=128", "model.num_attention_heads=4",
                           "model.seq_length=128"],
    "llama-gqa-swiglu": ["model.num_layers=4", "model.hidden_size=128", "model.num_attention_heads=8",
                         "model.num_query_groups=2", "model.ffn_hidden_size=352", "model.seq_length=128",
                         "model.normalization=RMSNorm", "model.activation=swiglu", "model.add_bias_linear=false",
                         "model.share_embeddings_and_output_weights=false"],
}
if QWEN3_READY:  # a head size other than hidden / heads, q/k norms
    SHAPES["qwen3-headdim-qknorm"] = [*SHAPES["llama-gqa-swiglu"], "model.kv_channels=24", "model.qk_layernorm=true"]
LORA = ["peft.scheme=lora", "peft.dim=8", f"checkpoint.pretrained_checkpoint={REPO}"]  # the path is not read here
RECOMPUTE = {
    "off": [],
    "selective": ["model.recompute_granularity=selective"],
    "full-uniform-2": ["model.recompute_granularity=full", "model.recompute_method=uniform",
                       "model.recompute_num_layers=2"],
    "full-block-1": ["model.recompute_granularity=full", "model.recompute_method=block",
                     "model.recompute_num_layers=1"],
}


@pytest.mark.parametrize("recompute", list(RECOMPUTE))
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.trainer
def test_estimate_matches_the_bytes_measured_on_cpu(shape, recompute):
    measured, cfg = measure(*SHAPES[shape], *RECOMPUTE[recompute])
    _assert_estimate_matches(measured, cfg)


def _assert_estimate_matches(measured: dict[str, int], cfg, world_size: int = 1):
    plan = make_plan(cfg, world_size=world_size)
    st = plan.stage
    if world_size == 1 and cfg.peft.scheme is None:
        assert plan.parameters["total"] == measured["params"]  # exact, not estimated
    assert st.params == measured["params"] and st.expert_params == measured["expert_params"]
    static = st.weights + st.gradients + st.optimizer
    assert static == pytest.approx(measured["static"], rel=TOLERANCE), (static, measured)
    assert st.activations == pytest.approx(measured["activations"], rel=TOLERANCE), (st.activations, measured)
    assert st.total == pytest.approx(measured["static"] + measured["activations"], rel=TOLERANCE)
    return plan


# Tiny mixtures of experts on the Llama shape: megatron-core's top-k router, all-to-all dispatcher and
# SequentialMLP experts (the local spec), with their load-balancing losses.
MOE = {
    "top2-aux-loss": ["model.num_moe_experts=4", "model.moe_router_topk=2", "model.moe_ffn_hidden_size=96",
                      "model.moe_aux_loss_coeff=0.01"],
    "every-2nd-layer-shared-expert": ["model.num_moe_experts=4", "model.moe_router_topk=2",
                                      "model.moe_ffn_hidden_size=64", "model.moe_layer_freq=[1,0,1,0]",
                                      "model.moe_shared_expert_intermediate_size=64",
                                      "model.moe_router_load_balancing_type=seq_aux_loss",
                                      "model.moe_aux_loss_coeff=0.01"],
}


@pytest.mark.parametrize("moe, extra", [
    ("top2-aux-loss", []),
    ("every-2nd-layer-shared-expert", RECOMPUTE["full-block-1"]),  # the recomputed layer is an MoE layer
    ("top2-aux-loss", [*LORA, "peft.target_modules=[linear_qkv,linear_proj,linear_fc1,linear_fc2]"]),
], ids=["top2-aux-loss", "every-2nd-layer-shared-expert-block-recompute", "lora-on-every-expert"])
@pytest.mark.trainer
def test_moe_estimate_matches_the_bytes_measured_on_cpu(moe, extra):
    """Parameters exact (router, E experts, shared expert, per-expert LoRA adapters); the router's and
    dispatcher's tensors and the experts' activations for top-k copies of each token, measured."""
    measured, cfg = measure(*SHAPES["llama-gqa-swiglu"], *MOE[moe], *extra)
    plan = _assert_estimate_matches(measured, cfg)
    p = plan.parameters
    moe_layers = sum(Shape.of(cfg).moe.pattern)
    per_expert = p["experts"] // (moe_layers * 4)
    assert p["active"] == p["total"] - moe_layers * 2 * per_expert  # top 2 of 4 experts: two idle per layer


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.trainer
def test_dropout_masks_are_counted(shape, monkeypatch):
    """Hidden dropout keeps a mask per dropout (embedding, after attention, after the MLP). CUDA keeps it as
    bool (plan's 1 byte), torch on CPU in the compute dtype: the measurement here counts 4 bytes."""
    import kubetron.plan

    monkeypatch.setattr(kubetron.plan, "DROPOUT_MASK_BYTES", 4)
    without, cfg = measure(*SHAPES[shape])
    estimate_without = make_plan(cfg, world_size=1).stage.activations
    with_dropout, cfg = measure(*SHAPES[shape], "model.hidden_dropout=0.1")
    masks = make_plan(cfg, world_size=1).stage.activations - estimate_without
    assert masks == pytest.approx(with_dropout["activations"] - without["activations"], rel=TOLERANCE)


@pytest.mark.parametrize("targets", ["[linear_qkv,linear_proj,linear_fc1,linear_fc2]", "[linear_qkv]"])
@pytest.mark.trainer
def test_lora_estimate_matches_the_bytes_measured_on_cpu(targets):
    """Frozen base weights (no gradient, no optimizer state, fewer saved activations) and trained adapters."""
    measured, cfg = measure(*SHAPES["llama-gqa-swiglu"], *LORA, f"peft.target_modules={targets}")
    plan = make_plan(cfg, world_size=1)
    st = plan.stage
    assert st.params == measured["params"] and plan.trainable_parameters < st.params // 5
    assert st.weights + st.gradients + st.optimizer == pytest.approx(measured["static"], rel=TOLERANCE)
    assert st.activations == pytest.approx(measured["activations"], rel=TOLERANCE)


# --- the recipes --------------------------------------------------------------------------------------

PUBLISHED_PARAMETERS = {  # the models' Hugging Face cards / safetensors index totals
    "llama3.1-8b": 8_030_261_248, "llama3.1-70b": 70_553_706_496,
    "qwen3-8b": 8_190_735_360, "qwen3-32b": 32_762_123_264,
    "qwen3-30b-a3b": 30_532_122_624, "mixtral-8x7b": 46_702_792_704,
}
PUBLISHED_ACTIVE = {"qwen3-30b-a3b": 3.3, "mixtral-8x7b": 12.9}  # billions per token, as the model cards round them


def _stated(path: Path) -> list[str]:
    """The recipe's `# plan: --nodes N --gpus-per-node G --gpu-memory M` line, as arguments."""
    m = PLAN_LINE.search(path.read_text())
    assert m, f"{path.name}: no '# plan: ...' line stating its GPU count"
    return m.group(1).split()


def _size(args: list[str]) -> tuple[int, int]:
    opts = dict(zip(args[0::2], args[1::2]))
    return int(opts["--nodes"]) * int(opts["--gpus-per-node"]), parse_memory(opts["--gpu-memory"])


def test_every_published_model_has_pretrain_and_lora_recipes():
    names = {p.stem for p in RECIPES}
    for model in PUBLISHED_PARAMETERS:
        assert f"{model}-pretrain" in names and f"{model}-lora" in names
    assert "llama3.1-8b-sft" in names


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_recipe_loads_at_its_stated_size_and_fits(path):
    from kubetron.config import ConfigContainer

    world_size, gpu_memory = _size(_stated(path))
    if "qwen3" in path.stem and not QWEN3_READY:
        with pytest.raises(ConfigError) as e:  # refused by name until the trainer has the Qwen3 keys
            ConfigContainer.from_yaml(str(path), check_paths=False)
        assert e.value.field in {f"model.{k}" for k in QWEN3_KEYS}
        pytest.skip("model.kv_channels / model.qk_layernorm are not in this trainer yet")
    cfg = ConfigContainer.from_yaml(str(path), check_paths=False)
    cfg.derive(world_size)  # the trainer's own derivation at the stated world size
    plan = make_plan(cfg, world_size, gpu_memory)
    assert plan.fits, f"{path.name}: {plan.stage.total / GIB:.1f} GiB > {gpu_memory / GIB:.0f} GiB"
    model = path.stem.rsplit("-", 1)[0]
    assert plan.parameters["total"] == PUBLISHED_PARAMETERS[model]
    if model in PUBLISHED_ACTIVE:
        assert abs(plan.parameters["active"] / 1e9 - PUBLISHED_ACTIVE[model]) < 0.1
    assert plan.stage.total > 0.3 * gpu_memory  # a layout that uses the GPUs it states, not a far larger count


def test_qwen3_recipes_count_the_published_parameters():
    """Qwen3's head size (kv_channels 128, not hidden/heads for 32B) and q/k norms, counted by plan's
    shape math even before the trainer's config has the keys."""
    import dataclasses

    import yaml
    from kubetron.config import ConfigContainer
    from kubetron.plan import Shape, total_params

    for model in ("qwen3-8b", "qwen3-32b"):
        data = yaml.safe_load((REPO / "recipes" / f"{model}-pretrain.yaml").read_text())
        extra = {k: data["model"].pop(k) for k in QWEN3_KEYS}
        cfg = ConfigContainer.from_dict(data).derive(_size(_stated(REPO / "recipes" / f"{model}-pretrain.yaml"))[0])
        shape = dataclasses.replace(Shape.of(cfg), head_dim=extra["kv_channels"], qk_norm=extra["qk_layernorm"])
        assert total_params(shape)["total"] == PUBLISHED_PARAMETERS[model]


def test_expert_parallelism_splits_the_experts_and_their_optimizer_state_over_expert_dp():
    """Qwen3-30B-A3B on 16 GPUs at EP 8 and EP 4: the GPU holds twice the experts at EP 4, but with the
    distributed optimizer their fp32 state is sharded over expert DP (2 vs 4 ranks), so it stays the
    same per GPU; the dense parameters and their state do not change."""
    from kubetron.config import ConfigContainer

    path = str(REPO / "recipes" / "qwen3-30b-a3b-pretrain.yaml")
    ep8, ep4 = (make_plan(ConfigContainer.from_yaml(path, [f"model.expert_model_parallel_size={ep}"],
                                                    check_paths=False), 16) for ep in (8, 4))
    assert (ep8.layout.edp, ep4.layout.edp) == (2, 4)
    assert ep4.stage.expert_params == 2 * ep8.stage.expert_params
    assert ep4.stage.params - ep4.stage.expert_params == ep8.stage.params - ep8.stage.expert_params
    assert ep4.stage.weights > ep8.stage.weights and ep4.stage.optimizer == pytest.approx(ep8.stage.optimizer)
    plain = make_plan(ConfigContainer.from_yaml(path, ["optimizer.use_distributed_optimizer=false",
                                                      "ddp.overlap_param_gather=false"],
                                                check_paths=False), 16)
    assert plain.stage.optimizer == 12 * plain.stage.params  # unsharded: fp32 main weights and two moments


# --- the command --------------------------------------------------------------------------------------

def _plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kubetron", "plan", *args], capture_output=True, text=True,
                          timeout=120, cwd=REPO)


@pytest.mark.process
def test_plan_command_prints_the_table_and_json():
    path = str(REPO / "recipes" / "llama3.1-8b-pretrain.yaml")
    out = _plan(path, *_stated(REPO / "recipes" / "llama3.1-8b-pretrain.yaml"))
    assert out.returncode == 0, out.stderr
    for row in ("weights", "gradients", "optimizer state", "activations (recompute off)", "total",
                "activations without recompute", "activations with full recompute"):
        assert re.search(rf"^  {re.escape(row)}\s+\d+\.\d\d", out.stdout, re.M), row
    assert "8.03 B" in out.stdout and "fits in 80 GiB" in out.stdout
    js = _plan(path, "--nodes", "1", "--gpus-per-node", "8", "--json")
    data = json.loads(js.stdout)
    assert data["parameters"]["total"] == 8_030_261_248 and data["layout"]["tp"] == 2 and data["fits"]
    # fewer GPUs: the same model does not fit one 80 GiB GPU (exit 1); overrides apply
    one = _plan(path, "--nodes", "1", "--gpus-per-node", "1", "model.tensor_model_parallel_size=1",
                "model.sequence_parallel=false", "--json")
    assert one.returncode == 1 and not json.loads(one.stdout)["fits"]
    full = _plan(path, "--nodes", "1", "--gpus-per-node", "8", "--json", "model.recompute_granularity=full",
                 "model.recompute_method=uniform", "model.recompute_num_layers=1")
    per_gpu = json.loads(full.stdout)["per_gpu_bytes"]
    assert per_gpu["activations"] == per_gpu["activations_full_recompute"] < data["per_gpu_bytes"]["activations"]
    usage = _plan("--help")
    assert usage.returncode == 0 and "--gpu-memory" in usage.stdout


@pytest.mark.process
def test_plan_command_on_a_mixture_of_experts():
    path = REPO / "recipes" / "mixtral-8x7b-pretrain.yaml"
    out = _plan(str(path), *_stated(path))
    assert out.returncode == 0, out.stderr
    assert re.search(r"^layout +TP 1, PP 2, DP 8, EP 8,", out.stdout, re.M), out.stdout
    assert "8 per MoE layer in 32 of 32 layers, top-2" in out.stdout and "active per token 12.88 B" in out.stdout
    assert "1 per MoE layer)" in out.stdout and "experts' over expert DP 1" in out.stdout
    few = _plan(str(path), "--nodes", "1", "--gpus-per-node", "8")  # PP 2 leaves DP 4: EP 8 does not fit in it
    assert few.returncode == 2 and few.stderr.startswith("kubetron: error: model.expert_model_parallel_size")


@pytest.mark.parametrize("args, field", [
    (["--nodes", "1", "--gpus-per-node", "8", "--gpu-memory", "lots"], "--gpu-memory"),
    (["--nodes", "0", "--gpus-per-node", "8"], "--nodes"),
    (["--nodes", "1", "--gpus-per-node", "3"], "model.tensor_model_parallel_size"),  # TP 2 does not divide 3
    (["--nodes", "1", "--gpus-per-node", "8", "model.num_layer=2"], "model.num_layer"),
])
@pytest.mark.process
def test_plan_command_errors_are_one_line(args, field):
    out = _plan(str(REPO / "recipes" / "llama3.1-8b-pretrain.yaml"), *args)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and out.stderr.startswith(f"kubetron: error: {field}"), out.stderr


def test_parse_memory_units():
    assert parse_memory("80GiB") == 80 * GIB and parse_memory("141GB") == 141 * 10**9 and parse_memory("24") == 24 * GIB


@pytest.mark.process
def test_plan_runs_without_torch():
    """The command imports the config models only: it runs where torch is not installed (a laptop, CI)."""
    code = ("import sys; from kubetron.cli import main; "
            f"rc = main(['plan', {str(REPO / 'recipes' / 'llama3.1-70b-pretrain.yaml')!r}, '--nodes', '8', "
            "'--gpus-per-node', '8', '--json']); "
            "assert rc == 0, rc; bad = [m for m in ('torch', 'megatron', 'numpy') if m in sys.modules]; "
            "assert not bad, bad")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_docs_table_lists_every_recipe_with_its_current_estimate():
    from kubetron.config import ConfigContainer

    readme = (REPO / "README.md").read_text()
    assert all(f"`{p.stem}`" in readme for p in RECIPES)

    rows = re.findall(r"^\| `([\w.-]+)\.yaml` \|.*\| (\d+) GiB \|$", (REPO / "docs" / "recipes.md").read_text(), re.M)
    assert {name for name, _ in rows} == {p.stem for p in RECIPES}
    for name, gib in rows:
        if "qwen3" in name and not QWEN3_READY:
            continue
        path = REPO / "recipes" / f"{name}.yaml"
        world_size, gpu_memory = _size(_stated(path))
        plan = make_plan(ConfigContainer.from_yaml(str(path), check_paths=False), world_size, gpu_memory)
        assert round(plan.stage.total / GIB) == int(gib), name


TWO_RANKS = {
    # TP 2: each rank holds half the linears, embedding and output layer and keeps half the attention/MLP
    # activations (the h-sized ones whole: no sequence parallelism on CPU)
    "tp2": ["model.tensor_model_parallel_size=2", *SHAPES["llama-gqa-swiglu"]],
    # EP 2 (DP 2): each rank holds 2 of the 4 experts and receives its tokens' copies for them by all-to-all
    # (the distributed optimizer with EP needs megatron-core's, CUDA: its sharding over expert DP is not measured)
    "ep2": ["model.expert_model_parallel_size=2", *SHAPES["llama-gqa-swiglu"], *MOE["top2-aux-loss"]],
}


@pytest.mark.parametrize("layout", list(TWO_RANKS))
@pytest.mark.process
def test_model_parallel_estimate_matches_the_bytes_measured_on_two_ranks(layout):
    """Under torchrun (gloo), rank 0's parameters, static bytes and activations."""
    from tests.multirank.runner import free_port

    torchrun = str(Path(sys.executable).with_name("torchrun"))
    out = subprocess.run([torchrun, "--nproc-per-node", "2", "--master-port", str(free_port()), "-m", "tests.test_plan",
                          *TWO_RANKS[layout]],
                         capture_output=True, text=True, timeout=300, cwd=REPO,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    cfg = in_process_config("train.micro_batch_size=2", "train.global_batch_size=4", *TWO_RANKS[layout])
    _assert_estimate_matches(measured, cfg, world_size=2)


if __name__ == "__main__":  # one rank of the test above: prints its measurement as JSON (rank 0)
    result, _ = measure(*sys.argv[1:], world_size=int(os.environ["WORLD_SIZE"]))
    if os.environ["RANK"] == "0":
        print(json.dumps(result))


@pytest.mark.process
def test_plan_search_prints_the_smallest_layout_that_fits():
    """`plan --search`: the fewest GPUs (then no recompute before selective before full, then fewest TP x PP) at
    which the estimate fits; every smaller GPU count has no layout that fits, and the layout printed is what
    `plan` itself says fits."""
    from kubetron.config import ConfigContainer
    from kubetron.plan import gpu_counts, search

    path = str(REPO / "recipes" / "llama3.1-70b-pretrain.yaml")
    out = _plan(path, "--nodes", "8", "--gpus-per-node", "8", "--search")
    assert out.returncode == 0, out.stderr
    m = re.search(r"smallest layout that fits 80 GiB per GPU: (\d+) GPU\(s\) \((\d+) node\(s\) x (\d+)\), TP (\d+), "
                  r"PP (\d+), DP (\d+), recompute (\w+)", out.stdout)
    assert m, out.stdout
    world, nodes, per_node, tp, pp, dp, recompute = m.groups()
    assert int(world) == int(nodes) * int(per_node) == int(tp) * int(pp) * int(dp)
    overrides = re.search(r"^overrides: (.+)$", out.stdout, re.M).group(1).split()
    again = _plan(path, "--nodes", nodes, "--gpus-per-node", per_node, *overrides, "--json")
    assert again.returncode == 0 and json.loads(again.stdout)["fits"], again.stdout
    fewer = [(n, g) for n, g in gpu_counts(8, 8) if n * g < int(world)]
    assert len(fewer) >= 3  # 1, 2, 4 GPUs at least: a 70B model fits none of them
    load = lambda extra: ConfigContainer.from_yaml(path, list(extra), check_paths=False)  # noqa: E731
    for count in fewer:  # no layout at a smaller count fits
        assert search(load, [count], 80 * GIB) is None, count
    nothing = _plan(path, "--nodes", "1", "--gpus-per-node", "2", "--search")
    assert nothing.returncode == 1 and "no layout fits 80 GiB" in nothing.stdout
