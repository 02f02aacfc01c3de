"""The random generators' states (python, numpy, torch, CUDA), in types a weights_only load reads back."""

from __future__ import annotations

import random
from typing import cast

import numpy as np
import torch

from kubetron.contract.errors import CheckpointError


def get_rng_state() -> dict:
    """python, numpy, torch (and CUDA) generator states, in weights_only-loadable types."""
    py = random.getstate()
    np_state = cast(tuple, np.random.get_state())  # the global MT19937's: a tuple (numpy's stubs: or a dict)
    state = {
        "random": [py[0], list(py[1]), py[2]],
        "np": {"name": np_state[0], "keys": torch.from_numpy(np_state[1].astype(np.int64)),
               "pos": int(np_state[2]), "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict, what: str = "the RNG state"):
    """Restore get_rng_state()'s states; a state of other types or shapes (a checkpoint is hostile input)
    is a CheckpointError naming `what`."""
    try:
        _set(state)
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError, AttributeError) as e:
        raise CheckpointError(f"{what} is not a random generator state: {type(e).__name__}: "
                              f"{str(e).strip()[:200]}") from None


def _set(state: dict):
    py = state["random"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["np"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
