"""Helpers for tests that train in the pytest process: a world of one rank (gloo) with megatron's
parallel_state, the tiny example config, and `pretrain()`/`finetune()` run in-process."""

from __future__ import annotations

from tests.trainer_utils import TINY, free_port


def ensure_world_of_one():
    """A gloo process group of 1 and parallel_state at tp = pp = 1 (idempotent)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)


def in_process_config(*overrides: str):
    """The tiny example config for an in-process run: no saving, no signal handlers in pytest."""
    from kubetron.config import ConfigContainer

    return ConfigContainer.from_yaml(TINY, ["checkpoint.save=null", "validation.eval_interval=null",
                                            "train.exit_signal_handler=false", *overrides])


def run_pretrain(cfg, forward_step_func, mode: str = "pretrain", **non_loss) -> int:
    """`pretrain()` / `finetune()` in this process (the entry point sets parallel_state up itself);
    `non_loss`: process_non_loss_data_func / non_loss_data_func."""
    import torch.distributed as dist
    from kubetron.training import entry
    from megatron.core import parallel_state

    ensure_world_of_one()  # keeps one process group for the whole session
    parallel_state.destroy_model_parallel()  # pretrain() initializes it for its config
    try:
        return (entry.finetune if mode == "finetune" else entry.pretrain)(cfg, forward_step_func, **non_loss)
    finally:
        assert dist.is_initialized()
        ensure_world_of_one()
