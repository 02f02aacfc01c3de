"""Pipeline parallelism: the micro-batch schedule for PP > 1 and the shared-embedding setup.

On GPU the schedule is megatron-core's own (`get_forward_backward_func`, 1F1B). On CPU it cannot
be: megatron-core 0.16.1 allocates `torch.zeros([], device="cuda")` in every schedule
(`schedules.py`, `total_num_tokens`) and its `P2PCommunicator` allocates receive buffers on
`torch.cuda.current_device()`, so no way of calling it avoids CUDA. On CPU this module runs an
all-forward-all-backward (GPipe) schedule with plain `torch.distributed.send/recv` over the pipeline
group (gloo). Both schedules follow megatron's loss contract:

- every stage calls `forward_step_func(data_iterator, model)`; a non-first stage first gets the
  previous stage's activations through `model.set_input_tensor(...)`;
- only the last stage calls `loss_func(output)`; the backward loss is
  `loss / num_tokens / num_microbatches` (token-aware pattern) or `loss / num_microbatches`;
- the per-micro-batch loss reports are then broadcast from the last stage to the other stages of
  the pipeline, so every rank holds the same reports (the loop's NaN check, skipped-iteration
  decision and metrics agree on all ranks; the metrics logger writes on the last rank).

Shared embeddings under PP (`share_embeddings_and_output_weights`): the last stage holds a copy of
the word embedding as `output_layer.weight` (marked `shared`). megatron copies it from the first
stage at construction with `weight.data.cuda()` + all-reduce over the embedding group, which fails
on CPU; `build()` skips that step while building and does the same all-reduce on the model's own
device. During training `grads.allreduce_gradients` all-reduces the two copies' gradients over the
embedding group, as megatron's `finalize_model_grads` does, so they stay equal.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from kubetron.compat.megatron_core import portable
from kubetron.training import moe
from kubetron.training.grads import shared_embedding_weight
from kubetron.training.utils import unpack_loss


@dataclass
class _Shapes:
    seq_length: int
    micro_batch_size: int
    hidden_size: int
    dtype: torch.dtype
    sequence_parallel: bool


_SHAPES: _Shapes | None = None


def pp_size() -> int:
    return parallel_state.get_pipeline_model_parallel_world_size()


# --- model construction --------------------------------------------------------------------------

@contextlib.contextmanager
def _skip_cuda_embedding_sync(device: torch.device):
    """On CPU, stop LanguageModule.setup_embeddings_and_output_layer's CUDA copy + all-reduce."""
    if device.type == "cuda" or pp_size() == 1:
        yield
        return
    with portable.embedding_sync_skipped():
        yield


def sync_shared_embeddings(model: list[torch.nn.Module]):
    """First and last stage start from the same word embedding (the last stage's copy is zero)."""
    if pp_size() == 1 or not parallel_state.is_rank_in_embedding_group(ignore_virtual=True):
        return
    weight = shared_embedding_weight(model[0])
    if weight is not None:
        with torch.no_grad():
            dist.all_reduce(weight.data, group=parallel_state.get_embedding_group())


def build(cfg, device: torch.device, build_model) -> list[torch.nn.Module]:
    """`build_model(cfg, device)` made to work for PP > 1 on CPU; records the activation shape."""
    global _SHAPES
    with _skip_cuda_embedding_sync(device):
        model = build_model(cfg, device)
    if device.type != "cuda":
        sync_shared_embeddings(model)
    m = cfg.model
    _SHAPES = _Shapes(seq_length=m.seq_length, micro_batch_size=cfg.train.micro_batch_size,
                      hidden_size=m.hidden_size,
                      dtype=model_dtype(cfg),
                      sequence_parallel=bool(m.sequence_parallel))
    return model


# --- the schedule --------------------------------------------------------------------------------

def _activation_shape() -> tuple[tuple[int, ...], torch.dtype]:
    if _SHAPES is None:
        raise RuntimeError("pipeline.build() was not called: activation shapes are unknown")
    s = _SHAPES
    seq = s.seq_length
    if s.sequence_parallel:
        seq //= parallel_state.get_tensor_model_parallel_world_size()
    return (seq, s.micro_batch_size, s.hidden_size), s.dtype


def runs_schedule(model: list[torch.nn.Module]) -> bool:
    """Whether the loop hands its micro-batches to this module: PP > 1, or a model under megatron's
    DDP (`ddp.impl` megatron, CUDA), whose `no_sync` megatron's schedule wraps the micro-batches in
    (megatron_ddp.py sets it on the model's TransformerConfig)."""
    config = getattr(model[0], "config", None)  # a TransformerConfig on megatron modules
    return pp_size() > 1 or (config is not None and config.no_sync_func is not None)


def model_dtype(cfg) -> torch.dtype:
    """The parameters' (and activations') dtype: mixed_precision.bf16 / fp16, else fp32."""
    mp = cfg.mixed_precision
    return torch.bfloat16 if mp.bf16 else torch.float16 if mp.fp16 else torch.float32


def forward_backward(forward_step_func, data_iterator, model, num_microbatches: int, *, forward_only: bool,
                     loss_scale: float = 1.0, collect_non_loss_data: bool = False):
    """The schedule; returns the per-micro-batch loss reports (the same on every stage). The backward
    pass starts from the loss times `loss_scale` (fp16; megatron's schedule reads config.grad_scale_func).
    With `collect_non_loss_data` (forward only) the last stage returns what `loss_func(output,
    non_loss_data=True)` gave for each micro-batch, the other stages [] (as megatron's schedules)."""
    device = next(model[0].parameters()).device
    if device.type == "cuda":
        reports = _megatron_schedule(forward_step_func, data_iterator, model, num_microbatches, forward_only,
                                     collect_non_loss_data)
    else:
        reports = _gpipe(forward_step_func, data_iterator, model, num_microbatches, forward_only, loss_scale,
                         collect_non_loss_data)
    if collect_non_loss_data or pp_size() == 1:
        return reports
    return broadcast_reports(reports, device)


def _megatron_schedule(forward_step_func, data_iterator, model, num_microbatches, forward_only,
                       collect_non_loss_data=False):
    """megatron-core's schedules (GPU): no pipelining at PP 1, 1F1B above. CI has no GPU: run
    `make gpu-check` on one."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    s = _SHAPES
    if s is None and pp_size() > 1:
        raise RuntimeError("pipeline.build() was not called: activation shapes are unknown")
    seq, mbs = (s.seq_length, s.micro_batch_size) if s is not None else (0, 0)  # unused without pipelining
    return list(get_forward_backward_func()(
        forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
        num_microbatches=num_microbatches, seq_length=seq, micro_batch_size=mbs,
        decoder_seq_length=seq, forward_only=forward_only, collect_non_loss_data=collect_non_loss_data))


def _gpipe(forward_step_func, data_iterator, model, num_microbatches, forward_only, loss_scale=1.0,
           collect_non_loss_data=False):
    """All forwards, then all backwards (micro-batch order), blocking send/recv on the PP group.

    Every send is matched by the neighbour's recv in the same order, so blocking calls cannot
    deadlock; a dead neighbour makes send/recv raise (connection reset) or time out
    (dist.distributed_timeout_minutes).
    """
    chunk = model[0]
    group = parallel_state.get_pipeline_model_parallel_group()
    first = parallel_state.is_pipeline_first_stage()
    last = parallel_state.is_pipeline_last_stage()
    prev_rank = parallel_state.get_pipeline_model_parallel_prev_rank()
    next_rank = parallel_state.get_pipeline_model_parallel_next_rank()
    shape, dtype = _activation_shape()
    device = next(chunk.parameters()).device

    if not forward_only:
        moe.scale_aux_loss(model, loss_scale, num_microbatches)
    inputs: list[torch.Tensor | None] = []  # None on the first stage (it reads the data itself)
    outputs: list[torch.Tensor] = []
    reports: list = []
    for _ in range(num_microbatches):
        input_tensor = None
        if not first:
            input_tensor = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(input_tensor, src=prev_rank, group=group)
            input_tensor.requires_grad_(not forward_only)
        chunk.set_input_tensor(input_tensor)
        output, loss_func = forward_step_func(data_iterator, chunk)
        if last and collect_non_loss_data:
            reports.append(loss_func(output, non_loss_data=True))
        elif last:
            loss, num_tokens, report = unpack_loss(loss_func(output))
            reports.append(report)
            output = loss / num_tokens.clamp(min=1) if num_tokens is not None else loss
            output = output * (loss_scale / num_microbatches)
        else:
            dist.send(output.detach().to(dtype).contiguous(), dst=next_rank, group=group)
        if not forward_only:
            inputs.append(input_tensor)
            outputs.append(output)
    chunk.set_input_tensor(None)
    if forward_only:
        return reports

    for input_tensor, output in zip(inputs, outputs, strict=True):
        if last:
            output.backward()
        else:
            grad = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(grad, src=next_rank, group=group)
            torch.autograd.backward(output, grad_tensors=grad.to(output.dtype))
        if input_tensor is not None:  # (not the first stage) the gradient of what the previous stage sent
            dist.send(cast(torch.Tensor, input_tensor.grad).to(dtype).contiguous(), dst=prev_rank, group=group)
    return reports


_REPORT_KEYS: list[tuple[str, int]] | None = None


def broadcast_reports(reports: list[dict], device: torch.device) -> list[dict]:
    """The last stage's loss reports on every stage of this pipeline (2 small broadcasts a call;
    a third, of the key layout, only when it changes)."""
    global _REPORT_KEYS
    group = parallel_state.get_pipeline_model_parallel_group()
    src = parallel_state.get_pipeline_model_parallel_last_rank()
    last = parallel_state.is_pipeline_last_stage()
    header = torch.zeros(3, dtype=torch.int64, device=device)
    if last:
        keys = [(k, int(v.numel())) for k, v in reports[0].items()] if reports else []
        header[0] = len(reports)
        header[1] = int(keys != _REPORT_KEYS)
        header[2] = sum(n for _, n in keys)
        _REPORT_KEYS = keys
    dist.broadcast(header, src=src, group=group)
    n_mb, changed, width = (int(x) for x in header.tolist())
    if changed:
        box = [_REPORT_KEYS]
        dist.broadcast_object_list(box, src=src, group=group, device=device)
        _REPORT_KEYS = box[0]
    layout = _REPORT_KEYS or []  # set by now on every stage (a first call broadcasts it)
    if last:
        flat = torch.stack([torch.cat([r[k].detach().float().reshape(-1) for k, _ in layout])
                            for r in reports]) if reports else torch.zeros(0, 0, device=device)
        flat = flat.to(device)
    else:
        flat = torch.empty(n_mb, width, dtype=torch.float32, device=device)
    if n_mb:
        dist.broadcast(flat, src=src, group=group)
    if last:
        return reports
    out = []
    for row in flat:
        d, pos = {}, 0
        for k, n in layout:
            d[k] = row[pos:pos + n] if n > 1 else row[pos].reshape(())
            pos += n
        out.append(d)
    return out
