"""Under torchrun (gloo): logits of an imported checkpoint and of an HF directory, split over the ranks by
tensor parallelism (a mixture of experts, with `ep`: by expert parallelism, each rank its share of experts).

    torchrun --nproc-per-node 2 -m tests.multirank.hf_logits CKPT HF_DIR OUT.pt [ep]

Rank 0 saves {"from_checkpoint": logits, "from_hf_dir": logits} (full vocabulary) to OUT.pt, and the
rows of its layer 0's linear_qkv and its number of local experts.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import yaml


def main(ckpt: str, hf_dir: str, out: str, split: str = "tp") -> int:
    from kubetron.compat import megatron_core

    megatron_core.install()  # as `kubetron train` does, before the trainer imports megatron-core
    from kubetron.checkpoint import format_sharded
    from kubetron.hf.io import load_hf_into_model
    from kubetron.storage import open_store
    from kubetron.training.model import build_model
    from megatron.core import parallel_state

    from tests.hf_utils import config_for, kubetron_logits

    world = int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    tp, ep = (world, 1) if split == "tp" else (1, world)
    parallel_state.initialize_model_parallel(tp, 1, expert_model_parallel_size=ep)
    name = "iter_0000000"
    model_keys = yaml.safe_load(open(f"{ckpt}/{name}/run_config.yaml"))["model"]
    layout = [f"model.tensor_model_parallel_size={tp}"] + ([f"model.expert_model_parallel_size={ep}"] if ep > 1 else [])
    cfg = config_for(model_keys, *layout, world_size=world)
    model = build_model(cfg, torch.device("cpu"))
    # as a fine-tune starting from the import reads it: each rank only the byte ranges of its own part
    format_sharded.load_model(model, format_sharded.ShardReader(open_store(ckpt), name, 1))
    a = kubetron_logits(model[0])
    model = build_model(cfg, torch.device("cpu"))
    load_hf_into_model(model, cfg, hf_dir)
    b = kubetron_logits(model[0])
    layer = model[0].decoder.layers[0]
    experts = getattr(getattr(layer.mlp, "experts", None), "local_experts", [])
    if dist.get_rank() == 0:
        torch.save({"from_checkpoint": a, "from_hf_dir": b, "local_qkv_rows": layer.self_attention.linear_qkv.weight
                    .shape[0], "local_experts": len(experts)}, out)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:]))
