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


def document_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """(b, 1, s, s) attention mask, megatron's convention (True = masked out): causal, and a token sees
    only tokens of its own packed example (segment)."""
    s = segment_ids.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=segment_ids.device).tril()
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    return ~(same & causal)[:, None]


def forward_step(state: GlobalState, data_iterator, model, return_schedule_plan: bool = False):
    """One micro-batch forward. Returns (output, loss_func) as the forward-step contract says."""
    batch = get_batch(data_iterator, next(model.parameters()).device)
    # Packed fine-tuning examples bring segment ids; dataset.reset_attention_mask brings a mask.
    mask = document_mask(batch["segment_ids"]) if "segment_ids" in batch else batch.get("attention_mask")
    output = model(batch["tokens"], batch["position_ids"], mask, labels=batch["labels"])
    return output, partial(masked_token_loss, batch["loss_mask"])
