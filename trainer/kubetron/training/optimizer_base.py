"""The one optimizer interface the loop and the checkpointer use.

Every optimizer kubetron builds (optim.build_optimizer) is a `TrainingOptimizer`:

    zero_grad()            before the forward/backward passes of an iteration
    finish_grad_sync()     after them: DP mean (+ TP / tied-embedding sums); gradients are final
    clip_grad_norm(max)    the global grad norm (a device tensor); gradients scaled down to `max`
                           (built on grad_norm_squared(), this rank's share summed over DP where
                           sharded, and scale_grads(coeff))
    step()                 the update
    finish_param_sync()    wait for overlapped parameter all-gathers before reading all weights
    reload_model_params()  the model's weights were loaded from elsewhere: refresh any copies
    state / set_param_state(p, state)    canonical state keyed by model parameter (checkpoints)
    owned_ranges() / owned_state() / set_owned_state(p, lo, hi, state)
                           optimizers that shard state over DP: the flat range of each parameter this
                           rank owns, and its state (sharded checkpoints write and read only those);
                           None for the others
    state_dict() / load_state_dict(sd)   positional state (same-layout, node-local checkpoints)
    param_groups / defaults              as torch optimizers (the LR scheduler sets "lr")

Implementations: `PlainOptimizer` (fp32 params, the torch optimizer steps them), mixed_precision.
MainParamsOptimizer (fp32 main copies of bf16/fp16 params), ddp.DistributedOptimizer (ZeRO-1 over
kubetron's buffers) and megatron_ddp.MegatronOptimizer (megatron-core's, CUDA). How gradients are
reduced is a separate small object, `grad_sync` (grads.FlatGradSync or ddp.GradBuffers).
"""

from __future__ import annotations

from typing import Protocol

import torch

from kubetron.training.grads import model_parallel_sum, norm_squared


class GradSync(Protocol):
    """How the gradients of an iteration are reduced (grads.FlatGradSync, ddp.GradBuffers)."""

    def zero(self) -> None: ...

    def finish(self) -> None: ...


class LossScale(Protocol):
    """fp16's loss scale (mixed_precision.LossScaler), as the optimizers and the checkpointer use it."""

    scale: float

    def update(self, found_inf: bool) -> None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, sd: dict) -> None: ...


class TrainingOptimizer:
    """Base: gradients end up in `param.grad` of `self.params` after `finish_grad_sync`, and the
    inner torch optimizer `self.inner` steps the parameters (subclasses change what differs)."""

    inner: torch.optim.Optimizer
    grad_sync: GradSync | None = None  # None: the gradients need no reduction
    params: list[torch.nn.Parameter]
    loss_scaler: LossScale | None = None  # mixed_precision.LossScaler with fp16 (the optimizers over fp32 copies)

    @property
    def loss_scale(self) -> float:
        """The factor the backward pass multiplied the loss by (1.0 without fp16)."""
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    def update_loss_scale(self, found_inf: bool):
        """After each iteration (found_inf: its update was skipped for non-finite gradients)."""
        if self.loss_scaler is not None:
            self.loss_scaler.update(found_inf)

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @property
    def defaults(self) -> dict:
        return self.inner.defaults

    def zero_grad(self):
        for p in self.params:
            p.grad = None
        if self.grad_sync is not None:
            self.grad_sync.zero()

    def finish_grad_sync(self):
        if self.grad_sync is not None:
            self.grad_sync.finish()

    def grad_norm_squared(self) -> torch.Tensor:
        return norm_squared(self.params, lambda p: p.grad)

    def scale_grads(self, coeff: torch.Tensor):
        grads = [p.grad for p in self.params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, coeff.to(grads[0].device, grads[0].dtype))

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """The global grad L2 norm (fp32 device tensor, no host sync); gradients scaled down to
        `max_norm` when above it (0: no clipping). With fp16 the norm and the gradients are divided by
        the loss scale (an overflow leaves the norm non-finite: the loop skips the update)."""
        total = model_parallel_sum(self.grad_norm_squared()).sqrt().squeeze(0)
        if self.loss_scale != 1.0:
            unscale = torch.tensor(1.0 / self.loss_scale, dtype=torch.float32, device=total.device)
            total = total * unscale
            self.scale_grads(unscale)  # pending, applied in fp32 by the optimizers over copies
        if max_norm > 0:
            self.scale_grads(torch.clamp(max_norm / (total + 1e-6), max=1.0))
        return total

    def step(self):
        self.inner.step()

    def finish_param_sync(self):
        """Nothing is in flight unless the optimizer all-gathers parameters asynchronously."""

    def reload_model_params(self):
        """Nothing to refresh unless the optimizer keeps copies of the parameters."""

    @property
    def state(self) -> dict:
        return self.inner.state

    @torch.no_grad()
    def set_param_state(self, model_param: torch.nn.Parameter, state: dict):
        """Restore one parameter; a saved fp32 `main_param` (a bf16 run's) becomes the weight itself."""
        state, _ = take_main_param(model_param, state)
        if state:
            self.inner.state[model_param] = state
        else:
            self.inner.state.pop(model_param, None)

    def owned_ranges(self) -> list[tuple[torch.nn.Parameter, int, int]] | None:
        """[(model param, lo, hi)]: the flat ranges whose state this rank alone holds (None: the state
        is per whole parameter, `state`)."""
        return None

    def owned_state(self) -> list[tuple[torch.nn.Parameter, int, int, dict]] | None:
        """[(model param, lo, hi, {state key: flat tensor, "step": 0-d, "main_param": fp32 flat where the
        parameter is not fp32 itself})] for owned_ranges(); live tensors (the checkpointer copies them)."""
        return None

    def set_owned_state(self, model_param: torch.nn.Parameter, lo: int, hi: int, state: dict):
        raise NotImplementedError(f"{type(self).__name__} keeps state per whole parameter (set_param_state)")

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, sd: dict):
        self.inner.load_state_dict(sd)


class PlainOptimizer(TrainingOptimizer):
    """A torch optimizer over the model's own (fp32) parameters."""

    def __init__(self, inner: torch.optim.Optimizer, grad_sync=None):
        self.inner, self.grad_sync = inner, grad_sync
        self.params = [p for g in inner.param_groups for p in g["params"]]


class OptimizerOverCopies(TrainingOptimizer):
    """What optimizers that step fp32 copies of the parameters share (mixed_precision's and ddp.py's
    distributed one): a pending clip coefficient that step() applies to the fp32 gradients, instead
    of rounding the bf16 model gradients once more."""

    _grad_scale: torch.Tensor | None = None

    def zero_grad(self):
        self._grad_scale = None
        super().zero_grad()

    def scale_grads(self, coeff: torch.Tensor):
        """Multiply the gradients by `coeff` in fp32, as they become main grads (grad clipping)."""
        self._grad_scale = coeff if self._grad_scale is None else self._grad_scale * coeff

    def _apply_grad_scale(self, grads: list[torch.Tensor]):
        if self._grad_scale is not None and grads:
            torch._foreach_mul_(grads, self._grad_scale.to(grads[0].device, torch.float32))
        self._grad_scale = None


@torch.no_grad()
def take_main_param(model_param: torch.nn.Parameter, state: dict) -> tuple[dict, torch.Tensor | None]:
    """(state without "main_param", the saved fp32 main or None); a saved main becomes the model's
    weight (rounded to its dtype): more precise than the weight saved with the model."""
    state = dict(state)
    main = state.pop("main_param", None)
    if main is not None:
        model_param.copy_(main.to(model_param.device, model_param.dtype))
    return state, main
