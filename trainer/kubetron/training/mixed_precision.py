"""fp32 main weights for bf16/fp16 models (the semantics of megatron's Float16OptimizerWithFloat16Params).

A bf16 parameter cannot take an update much smaller than 2^-8 of its value: AdamW stepping the
model's bf16 weights directly loses small updates. `MainParamsOptimizer` keeps an fp32 "main" copy
of every low-precision parameter and runs the real optimizer over those:

    step():  model grads (bf16) -> main grads (fp32, times a pending clip coefficient)
             inner.step() on the fp32 mains (its state, exp_avg/exp_avg_sq, is fp32 too)
             mains -> model params (rounded to bf16)

fp32 parameters (if any) are their own main. Checkpoints: `state` is keyed by the *model*
parameters (so checkpointing stores it by parameter name) and each entry carries the fp32 weight as
`main_param`, param-shaped, so checkpoint/canonical.py gathers and slices it like `exp_avg`. model.pt keeps the
bf16 model weights; optim.pt carries the fp32 mains. After any load of model weights the caller runs
`reload_model_params()` (mains := model weights); a resume then overwrites the mains with the saved
fp32 ones through `set_param_state()`.
"""

from __future__ import annotations

import torch

from kubetron.training.optimizer_base import OptimizerOverCopies


class MainParamsOptimizer(OptimizerOverCopies):
    """A torch optimizer over fp32 copies of the model's parameters; see the module docstring."""

    def __init__(self, groups: list[dict], make_optimizer, grad_sync=None):
        """`groups`: param groups over the model's params; `make_optimizer(groups)` builds the inner
        optimizer (it gets the same groups with the fp32 mains in place of the model params);
        `grad_sync` reduces the gradients (None: no reduction, e.g. one rank)."""
        self.grad_sync = grad_sync
        self.model_params: list[torch.nn.Parameter] = []
        self.main_params: list[torch.nn.Parameter] = []
        main_groups = []
        for g in groups:
            mains = []
            for p in g["params"]:
                main = p if p.dtype == torch.float32 else torch.nn.Parameter(p.detach().float())
                self.model_params.append(p)
                self.main_params.append(main)
                mains.append(main)
            main_groups.append({**g, "params": mains})
        self.inner = make_optimizer(main_groups)
        self.params = self.model_params  # gradients arrive in the model params' .grad
        self._main_of = {p: m for p, m in zip(self.model_params, self.main_params, strict=True)}

    @torch.no_grad()
    def step(self):
        low = [(p, m) for p, m in zip(self.model_params, self.main_params, strict=True) if m is not p]
        for p, m in low:
            m.grad = None if p.grad is None else p.grad.to(torch.float32)
        self._apply_grad_scale([m.grad for m in self.main_params if m.grad is not None])
        self.inner.step()
        if low:
            torch._foreach_copy_([p for p, _ in low], [m for _, m in low])  # fp32 -> bf16, rounded
            for _, m in low:
                m.grad = None  # the fp32 grads live only during step()

    @torch.no_grad()
    def reload_model_params(self):
        """mains := model params (after the model's weights were loaded from elsewhere)."""
        low = [(p, m) for p, m in zip(self.model_params, self.main_params, strict=True) if m is not p]
        if low:
            torch._foreach_copy_([m for _, m in low], [p for p, _ in low])

    # -- checkpoints -------------------------------------------------------------------------------
    @property
    def state(self) -> dict:
        """{model param: inner state of its main + {"main_param": fp32 weight}} (a read-only view:
        restore through set_param_state)."""
        return {p: {**self.inner.state.get(m, {}), "main_param": m}
                for p, m in zip(self.model_params, self.main_params, strict=True)}

    @torch.no_grad()
    def set_param_state(self, model_param: torch.nn.Parameter, state: dict):
        """Restore one parameter's optimizer state; its `main_param` (if saved) becomes the fp32 main."""
        main = self._main_of[model_param]
        state = dict(state)
        saved_main = state.pop("main_param", None)
        if saved_main is not None:
            main.copy_(saved_main)
            if main is not model_param:
                model_param.copy_(main)
        if state:
            self.inner.state[main] = state
        else:
            self.inner.state.pop(main, None)

    def state_dict(self) -> dict:
        """Positional (same-layout) state: the inner optimizer's plus the fp32 mains."""
        return {"inner": self.inner.state_dict(), "main_params": [m.detach() for m in self.main_params]}

    @torch.no_grad()
    def load_state_dict(self, sd: dict):
        if "inner" not in sd:  # a plain optimizer's state dict (saved by an fp32 run)
            self.inner.load_state_dict(sd)
            self.reload_model_params()
            return
        self.inner.load_state_dict(sd["inner"])
        mains = sd["main_params"]
        if len(mains) != len(self.main_params):
            raise ValueError(f"state dict has {len(mains)} main params, this optimizer {len(self.main_params)}")
        for p, m, saved in zip(self.model_params, self.main_params, mains, strict=True):
            m.copy_(saved)
            if m is not p:
                p.copy_(m)


class LossScaler:
    """fp16's loss scale, megatron's DynamicGradScaler (ConstantGradScaler with `mixed_precision.loss_scale`).

    fp16 gradients underflow to zero below 2^-24: the loss is multiplied by `scale` before the backward
    pass and the gradients are divided by it (in fp32, with the main gradients). An overflow (a
    non-finite gradient norm) skips the update; after `hysteresis` overflows the scale is multiplied by
    `backoff_factor` (not below `min_scale`), and after `growth_interval` clean iterations by `growth_factor`.
    `scale` is a host float: the loop already knows on the host whether the step overflowed.
    """

    def __init__(self, initial_scale: float, *, dynamic: bool = True, min_scale: float = 1.0,
                 growth_interval: int = 1000, hysteresis: int = 2, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5):
        self.scale = float(initial_scale)
        self.dynamic, self.min_scale = dynamic, min_scale
        self.growth_interval, self.hysteresis = growth_interval, hysteresis
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self._growth_tracker = 0
        self._hysteresis_tracker = hysteresis

    @classmethod
    def from_config(cls, cfg) -> LossScaler | None:
        mp = cfg.mixed_precision
        if not mp.fp16:
            return None
        if mp.loss_scale is not None:
            return cls(mp.loss_scale, dynamic=False)
        return cls(mp.initial_loss_scale, min_scale=mp.min_loss_scale, growth_interval=mp.loss_scale_window,
                   hysteresis=mp.hysteresis)

    def update(self, found_inf: bool):
        """After each step: back off on overflow (past the hysteresis), grow after a clean window."""
        if not self.dynamic:
            return
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            return
        self._growth_tracker += 1
        if self._growth_tracker == self.growth_interval:
            self._growth_tracker = 0
            self._hysteresis_tracker = self.hysteresis
            self.scale *= self.growth_factor

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self._growth_tracker,
                "hysteresis_tracker": self._hysteresis_tracker}

    def load_state_dict(self, sd: dict):
        self.scale = float(sd["scale"])
        self._growth_tracker = int(sd["growth_tracker"])
        self._hysteresis_tracker = int(sd["hysteresis_tracker"])
