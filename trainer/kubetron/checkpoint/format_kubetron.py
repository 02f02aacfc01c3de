"""ckpt_format kubetron: canonical (unsharded) tensors gathered onto rank 0 into `model.pt` and `optim.pt`;
every rank reads the whole file on load and takes its part (canonical.py's gather and scatter)."""

from __future__ import annotations

import torch

from kubetron.checkpoint import canonical
from kubetron.checkpoint.layout import safe_load

MODEL = "model.pt"
OPTIM = "optim.pt"


def snapshot(model, by_name: dict | None, buffers) -> tuple[dict, dict | None]:
    """(model tensors, optimizer state) in canonical form on host memory (complete on global rank 0 only);
    `by_name`: canonical.optimizer_state_by_name's (None: no optimizer state)."""
    model_sd = canonical.gather_model_state(model, buffers)
    optim_sd = canonical.gather_optimizer_state(model, by_name, buffers) if by_name else None
    return model_sd, optim_sd


def write(txn, model_sd: dict | None, optim_sd: dict | None, after=None):
    """Rank 0: model.pt, then optim.pt (if any) into the transaction; `after(file name)` after each."""
    for key, obj in ((MODEL, model_sd), (OPTIM, optim_sd)):
        if obj is not None:
            with txn.open_write(key) as f:
                torch.save(obj, f)
            if after is not None:
                after(key)


def load(model, store, name: str, *, keep=None, with_optim: bool) -> dict | None:
    """This rank's part of `name`'s model.pt into `model` (`keep(name)`: only some tensors); with_optim:
    the optimizer state by name (canonical.load_optimizer_state_by_name's input) when optim.pt exists."""
    with store.open_read(f"{name}/{MODEL}") as f:
        canonical.load_model_state(model, safe_load(f, f"{name}/{MODEL}"), keep=keep)
    if with_optim and store.exists(f"{name}/{OPTIM}"):
        with store.open_read(f"{name}/{OPTIM}") as f:
            return canonical.scatter_optimizer_state(model, safe_load(f, f"{name}/{OPTIM}"))
    return None
