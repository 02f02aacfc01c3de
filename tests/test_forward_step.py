"""The forward-step contract (kubetron.training.utils, schedule.forward_backward), checked in-process.

GlobalState injection (annotation, else a first parameter named state/global_state), functors that
keep their own state, the two loss patterns reduced over micro-batches, and a custom forward step
trained through the Python API `kubetron.training.entry.pretrain(cfg, forward_step)`.
"""

import math
from functools import partial

import pytest
import torch
from kubetron.training.state import GlobalState

from tests.inprocess import ensure_world_of_one, in_process_config, run_pretrain
from tests.trainer_utils import tb_scalars

pytestmark = pytest.mark.trainer

# --------------------------------------------------------------------------------------------------
# A world of one rank (gloo) with megatron's parallel_state, shared by every in-process test
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def world():
    ensure_world_of_one()


# --------------------------------------------------------------------------------------------------
# needs_global_state_injection / prepare_forward_step_func
# --------------------------------------------------------------------------------------------------


def by_annotation(s: GlobalState, data_iterator, model):
    return s, data_iterator, model


def by_annotation_not_first(data_iterator, model, gs: GlobalState = None):
    return gs, data_iterator, model


def by_string_annotation(s: "GlobalState", data_iterator, model):
    return s, data_iterator, model


def by_name_state(state, data_iterator, model, return_schedule_plan=False):
    return state, data_iterator, model


def by_name_global_state(global_state, data_iterator, model):
    return global_state, data_iterator, model


def plain(data_iterator, model):
    return None, data_iterator, model


def plain_with_plan(data_iterator, model, return_schedule_plan=False):
    return None, data_iterator, model


def state_not_first(data_iterator, model, state=None):
    return state, data_iterator, model


class Holder:
    def method_with_state(self, state, data_iterator, model):
        return state, data_iterator, model

    def method_plain(self, data_iterator, model):
        return None, data_iterator, model


@pytest.mark.parametrize("fn, expected", [
    (by_annotation, True),
    (by_annotation_not_first, True),
    (by_string_annotation, True),
    (by_name_state, True),
    (by_name_global_state, True),
    (plain, False),
    (plain_with_plan, False),
    (state_not_first, False),
    (Holder().method_with_state, True),  # bound method: `self` is not the first parameter
    (Holder().method_plain, False),
    (partial(by_name_state, "already bound"), False),  # what prepare_forward_step_func returns
    (lambda state, data_iterator, model: None, True),
    (lambda data_iterator, model: None, False),
])
def test_needs_global_state_injection(fn, expected):
    from kubetron.training.utils import needs_global_state_injection

    assert needs_global_state_injection(fn) is expected


@pytest.mark.parametrize("fn", [by_annotation, by_string_annotation, by_name_state, by_name_global_state])
def test_prepare_injects_state_once(fn):
    from kubetron.training.utils import maybe_inject_state, prepare_forward_step_func

    state = GlobalState(cfg=None)
    wrapped = prepare_forward_step_func(fn, state)
    got_state, it, model = wrapped("it", "model")
    assert got_state is state and (it, model) == ("it", "model")
    state.train_state.step = 7  # the partial holds a reference: later changes are visible
    assert wrapped("it", "model")[0].train_state.step == 7
    assert maybe_inject_state(fn, state, needs_injection=False) is fn


@pytest.mark.parametrize("fn", [plain, plain_with_plan])
def test_prepare_leaves_plain_functions_alone(fn):
    from kubetron.training.utils import prepare_forward_step_func

    assert prepare_forward_step_func(fn, GlobalState(cfg=None)) is fn


class CountingStep:
    """A functor: the contract says its own state (the counter) survives the wrapping."""

    def __init__(self):
        self.calls = 0
        self.states = set()

    def __call__(self, state: GlobalState, data_iterator, model):
        self.calls += 1
        self.states.add(id(state))
        return self.calls


class PlainFunctor:
    def __init__(self):
        self.calls = 0

    def __call__(self, data_iterator, model):
        self.calls += 1
        return self.calls


def test_functors_keep_their_own_state():
    from kubetron.training.utils import needs_global_state_injection, prepare_forward_step_func

    state = GlobalState(cfg=None)
    step = CountingStep()
    assert needs_global_state_injection(step)
    wrapped = prepare_forward_step_func(step, state)
    assert [wrapped("it", "model") for _ in range(3)] == [1, 2, 3]
    assert step.calls == 3 and step.states == {id(state)}

    other = PlainFunctor()
    assert not needs_global_state_injection(other)
    wrapped = prepare_forward_step_func(other, state)
    assert wrapped is other
    wrapped("it", "model")
    wrapped("it", "model")
    assert other.calls == 2


# --------------------------------------------------------------------------------------------------
# Loss patterns: (loss, dict) and (loss, num_tokens, dict), reduced over micro-batches
# --------------------------------------------------------------------------------------------------


def test_unpack_loss_patterns():
    from kubetron.training.utils import unpack_loss

    loss, n, d = torch.tensor(2.0), torch.tensor(5), {"a": torch.tensor(1.0)}
    assert unpack_loss((loss, d)) == (loss, None, d)
    assert unpack_loss((loss, n, d)) == (loss, n, d)
    with pytest.raises(TypeError, match=r"\(loss, dict\) or \(loss, num_tokens, dict\)"):
        unpack_loss(loss)


def test_reduce_losses_scalar_reports_are_averaged_over_microbatches(world):
    from kubetron.training.utils import reduce_losses

    out = reduce_losses([{"lm loss": torch.tensor(1.0), "aux": torch.tensor(10.0)},
                         {"lm loss": torch.tensor(3.0), "aux": torch.tensor(20.0)}])
    assert out["lm loss"].item() == pytest.approx(2.0)
    assert out["aux"].item() == pytest.approx(15.0)
    assert reduce_losses([]) == {}


def test_reduce_losses_token_reports_are_pooled_not_mean_of_means(world):
    from kubetron.training.utils import reduce_losses

    # micro-batch 1: 3 tokens, loss sum 3 (mean 1); micro-batch 2: 1 token, loss sum 5 (mean 5)
    out = reduce_losses([{"lm loss": torch.tensor([3.0, 3.0])}, {"lm loss": torch.tensor([5.0, 1.0])}])
    assert out["lm loss"].item() == pytest.approx(8.0 / 4.0)  # not (1 + 5) / 2


class _Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))

    def forward(self, x):
        return (self.w * x).sum(-1)  # one "token loss" per row


def _toy_batches():
    # rows are tokens; mask drops some tokens -> different token counts per micro-batch
    return iter([
        {"x": torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]), "mask": torch.tensor([1.0, 1.0, 1.0])},
        {"x": torch.tensor([[2.0, 0.0], [0.0, 3.0], [5.0, 5.0]]), "mask": torch.tensor([1.0, 0.0, 0.0])},
    ])


def _token_step(data_iterator, model):
    b = next(data_iterator)
    out = model(b["x"])

    def loss_func(output):
        s = (output * b["mask"]).sum()
        n = b["mask"].sum().to(torch.int64)
        return s, n, {"lm loss": torch.stack([s.detach(), n.float()])}

    return out, loss_func


def _mean_step(data_iterator, model):
    b = next(data_iterator)
    out = model(b["x"])

    def loss_func(output):
        loss = (output * b["mask"]).sum() / b["mask"].sum()
        return loss, {"lm loss": loss.detach()}

    return out, loss_func


def test_forward_backward_token_pattern(world):
    """(loss, num_tokens, dict): backward uses the per-token mean of each micro-batch / num_microbatches;
    the reported loss pools sums and token counts over micro-batches."""
    from kubetron.training.schedule import forward_backward
    from kubetron.training.utils import reduce_losses

    model = _Toy()
    reports = forward_backward(_token_step, _toy_batches(), [model], 2, forward_only=False)
    # mb1: tokens (1,0),(0,1),(1,1) -> sum 1+2+3 = 6 over 3 tokens; mb2: (2,0) -> 2 over 1 token
    assert reduce_losses(reports)["lm loss"].item() == pytest.approx((6 + 2) / 4)
    # d/dw: mb1 sum of x rows / 3 = (2, 2)/3; mb2 (2, 0)/1; averaged over the 2 micro-batches
    expected = (torch.tensor([2.0, 2.0]) / 3 + torch.tensor([2.0, 0.0])) / 2
    assert torch.allclose(model.w.grad, expected)


def test_forward_backward_mean_pattern(world):
    """(loss, dict): backward and report are the plain mean over micro-batches."""
    from kubetron.training.schedule import forward_backward
    from kubetron.training.utils import reduce_losses

    model = _Toy()
    reports = forward_backward(_mean_step, _toy_batches(), [model], 2, forward_only=False)
    assert reduce_losses(reports)["lm loss"].item() == pytest.approx((6 / 3 + 2 / 1) / 2)
    expected = (torch.tensor([2.0, 2.0]) / 3 + torch.tensor([2.0, 0.0])) / 2
    assert torch.allclose(model.w.grad, expected)

    model.w.grad = None
    forward_backward(_mean_step, _toy_batches(), [model], 2, forward_only=True)
    assert model.w.grad is None  # forward_only: no backward


# --------------------------------------------------------------------------------------------------
# A custom forward step through the Python API
# --------------------------------------------------------------------------------------------------


class MyForwardStep:
    """A functor with state injection by annotation, returning the (loss, dict) pattern."""

    def __init__(self):
        self.calls = 0
        self.state = None

    def __call__(self, state: GlobalState, data_iterator, model):
        self.calls += 1
        self.state = state
        batch = {k: v for k, v in next(data_iterator).items() if isinstance(v, torch.Tensor)}
        output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        mask = batch["loss_mask"]

        def loss_func(out):
            loss = (out.float() * mask).sum() / mask.sum()
            return loss, {"my loss": loss.detach(), "twice": 2 * loss.detach()}

        return output, loss_func


def test_custom_forward_step_trains_through_python_api(tmp_path, capsys):
    from kubetron.contract import exitcodes

    step = MyForwardStep()
    cfg = in_process_config("train.train_iters=30", "logger.log_interval=5", "scheduler.lr_warmup_iters=2",
                            f"logger.tensorboard_dir={tmp_path / 'tb'}")
    assert run_pretrain(cfg, step) == exitcodes.COMPLETED
    # 2 micro-batches per iteration, then validation and test after training (eval_iters 5 each, as the
    # reference on mock data); the functor kept its counter
    assert step.calls == 30 * 2 + 2 * 5 * 2
    assert isinstance(step.state, GlobalState) and step.state.train_state.step == 30
    assert step.state.train_state.consumed_train_samples == 30 * 8
    loss = tb_scalars(tmp_path / "tb", "my loss")
    twice = tb_scalars(tmp_path / "tb", "twice")
    assert sorted(loss) == list(range(1, 31))
    assert all(math.isfinite(v) for v in loss.values())
    assert loss[30] < loss[1] - 0.5, f"loss did not fall: {loss[1]} -> {loss[30]}"
    assert twice[30] == pytest.approx(2 * loss[30], rel=1e-6)
    assert set(tb_scalars(tmp_path / "tb", "my loss validation")) == {30}  # after training: validation
    assert set(tb_scalars(tmp_path / "tb", "my loss test")) == {30}  # and test
    out = capsys.readouterr().out
    assert "| my loss: " in out and "| twice: " in out and "iteration       30/      30" in out


# --------------------------------------------------------------------------------------------------
# What Bridge forward steps use from GlobalState; the inference (non-loss data) pattern
# --------------------------------------------------------------------------------------------------


class BridgeStyleStep:
    """Written for Megatron Bridge: `straggler_timer` around the batch fetch and the forward, the
    tokenizer's ids, its own scalar on `tensorboard_logger`, `wandb_logger` when configured."""

    def __init__(self):
        self.seen = []

    def __call__(self, state: GlobalState, data_iterator, model):
        with state.straggler_timer(bdata=True):
            batch = {k: v for k, v in next(data_iterator).items() if isinstance(v, torch.Tensor)}
        tok = state.tokenizer
        self.seen.append((tok.vocab_size, tok.eod, state.wandb_logger, int(batch["tokens"].max())))
        with state.straggler_timer:
            output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        if state.tensorboard_logger is not None:
            state.tensorboard_logger.add_scalar("custom/max token", float(batch["tokens"].max()),
                                                state.train_state.step)
        mask = batch["loss_mask"]

        def loss_func(out):
            loss = (out.float() * mask).sum() / mask.sum()
            return loss, {"lm loss": loss.detach()}

        return output, loss_func


def test_bridge_forward_step_uses_tokenizer_loggers_and_straggler_timer(tmp_path):
    from pathlib import Path

    from kubetron.contract import exitcodes

    step = BridgeStyleStep()
    cfg = in_process_config("train.train_iters=4", "logger.log_interval=2", "scheduler.lr_warmup_iters=0",
                            "straggler.log_straggler=true", "straggler.report_interval=2",
                            "validation.eval_iters=1", f"logger.tensorboard_dir={tmp_path / 'tb'}")
    assert run_pretrain(cfg, step) == exitcodes.COMPLETED
    assert {(v, e, w) for v, e, w, _ in step.seen} == {(258, 256, None)}  # byte tokenizer; no wandb configured
    assert max(m for *_, m in step.seen) < 256  # mock data never holds the eod id the tokenizer names
    custom = tb_scalars(tmp_path / "tb", "custom/max token")
    assert sorted(custom) == [0, 1, 2, 3, 4]  # 4 training steps, then the evaluations at step 4
    assert sorted(tb_scalars(tmp_path / "tb")) == [1, 2, 3, 4]  # the loop's own scalars
    assert len(list(Path(tmp_path / "tb").rglob("events.out.tfevents.*"))) == 1  # the loop and the step share it


def _predicting_step(data_iterator, model):
    """(loss, dict) in training and evaluation; with non_loss_data=True the per-row outputs (inference)."""
    b = next(data_iterator)
    out = model(b["x"])

    def loss_func(output, non_loss_data=False):
        if non_loss_data:
            return {"rows": output.detach().clone(), "mask": b["mask"]}
        loss = (output * b["mask"]).sum() / b["mask"].sum()
        return loss, {"lm loss": loss.detach()}

    return out, loss_func


def test_collect_non_loss_data_returns_what_the_loss_function_returns(world):
    """The inference pattern (megatron's schedule contract): forward_only + collect_non_loss_data hands back
    whatever loss_func(output, non_loss_data=True) returns, one item per micro-batch, no loss reduction."""
    from kubetron.training.schedule import forward_backward

    model = _Toy()
    data = forward_backward(_predicting_step, _toy_batches(), [model], 2, forward_only=True,
                            collect_non_loss_data=True)
    assert [sorted(d) for d in data] == [["mask", "rows"], ["mask", "rows"]]
    assert data[0]["rows"].tolist() == [1.0, 2.0, 3.0] and data[1]["rows"].tolist() == [2.0, 6.0, 15.0]
    assert model.w.grad is None
    with pytest.raises(ValueError, match="forward_only"):
        forward_backward(_predicting_step, _toy_batches(), [model], 2, forward_only=False, collect_non_loss_data=True)


class GPTPredictions(MyForwardStep):
    """MyForwardStep whose loss function also serves the inference pattern: the predicted token ids."""

    def __call__(self, state: GlobalState, data_iterator, model):
        output, loss_func = super().__call__(state, data_iterator, model)

        def with_predictions(out, non_loss_data=False):
            return {"per-token loss": out.detach().float()} if non_loss_data else loss_func(out)

        return output, with_predictions


def test_process_non_loss_data_func_at_every_evaluation(tmp_path):
    """pretrain(..., process_non_loss_data_func=f): at each evaluation one more global batch goes through
    the schedule with collect_non_loss_data=True and f(data, iteration, writer) gets the loss function's
    arbitrary returns; with non_loss_data_func(model) f gets what that returns instead."""
    from kubetron.contract import exitcodes

    calls = []

    def process(data, iteration, writer):
        calls.append((iteration, data))
        writer.add_scalar("non-loss/mean token loss", float(torch.cat([d["per-token loss"] for d in data]).mean()),
                          iteration)

    cfg = in_process_config("train.train_iters=4", "logger.log_interval=2", "scheduler.lr_warmup_iters=0",
                            "validation.eval_interval=2", "validation.eval_iters=1",
                            f"logger.tensorboard_dir={tmp_path / 'tb'}")
    assert run_pretrain(cfg, GPTPredictions(), process_non_loss_data_func=process) == exitcodes.COMPLETED
    # at 2 and 4 in the loop, then after training on validation and on test; 2 micro-batches of (4, 64) each
    assert [it for it, _ in calls] == [2, 4, 4, 4]
    assert all(len(d) == 2 and d[0]["per-token loss"].shape == (4, 64) for _, d in calls)
    assert set(tb_scalars(tmp_path / "tb", "non-loss/mean token loss")) == {2, 4}

    calls.clear()
    cfg = in_process_config("train.train_iters=2", "scheduler.lr_warmup_iters=0", "validation.eval_iters=1",
                            f"logger.tensorboard_dir={tmp_path / 'tb2'}")
    code = run_pretrain(cfg, MyForwardStep(), process_non_loss_data_func=lambda d, it, w: calls.append((it, d)),
                        non_loss_data_func=lambda model: ("params", sum(p.numel() for p in model[0].parameters())))
    assert code == exitcodes.COMPLETED
    assert [(it, d[0]) for it, d in calls] == [(2, "params"), (2, "params")] and calls[0][1][1] > 1000
