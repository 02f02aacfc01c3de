"""The default GPT forward step: batch → model → masked token loss (the reference's gpt_step)."""

from __future__ import annotations

from functools import partial

import torch

from kubetron.training.state import GlobalState


def masked_token_loss(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """(loss_sum, num_tokens, {"lm loss": [loss_sum, num_tokens]}): the token-aware loss pattern."""
    losses = output_tensor.float()  # (b, s) per-token cross entropy from GPTModel
    mask = loss_mask.reshape(-1).float()
    loss_sum = torch.sum(losses.reshape(-1) * mask)
    num_tokens = mask.sum().to(torch.int64)
    report = torch.stack([loss_sum.detach(), num_tokens.to(loss_sum.dtype)])
    return loss_sum, num_tokens, {"lm loss": report}


def get_batch(data_iterator, device: torch.device) -> dict[str, torch.Tensor]:
    batch = next(data_iterator)
    return {k: v.to(device, non_blocking=True) for k, v in batch.items() if isinstance(v, torch.Tensor)}


def forward_step(state: GlobalState, data_iterator, model, return_schedule_plan: bool = False):
    """One micro-batch forward. Returns (output, loss_func) as the forward-step contract says."""
    batch = get_batch(data_iterator, state.device)
    output = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"), labels=batch["labels"])
    return output, partial(masked_token_loss, batch["loss_mask"])
