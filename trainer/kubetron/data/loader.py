"""Sampling and loading: Megatron's pretraining-sampler order, with a prefetching thread.

Order. The datasets (:mod:`kubetron.data.datasets`) define a global sample order ``0, 1, 2, ...``
that depends only on the seed and the data. The training run consumes that order front to back:
a global batch is ``global_batch_size`` consecutive samples starting at ``consumed_samples``; it is
cut into ``num_microbatches`` micro-batches of ``micro_batch_size * dp_size`` consecutive samples
and data-parallel rank ``r`` takes samples ``[r * mbs, (r + 1) * mbs)`` of each micro-batch.
Every rank advances ``consumed_samples`` by ``mbs * dp_size`` per micro-batch, so all ranks agree on
it, and a run resumed at a different data-parallel size trains the same global batches. Past the
samples planned for the run (megatron-core builds as many epochs as they need) the order starts
again from sample 0, so an iterator never ends.

Prefetch. With ``prefetch > 0`` a daemon thread prepares up to ``prefetch`` micro-batches ahead
(reads, numpy collation, torch conversion, pinning). It never changes what is returned: each
prepared batch carries the position it was made for, ``consumed_samples`` only moves when a batch is
handed out, and ``load_state_dict``/``skip_microbatches`` stop the thread and restart it at the new
position. A checkpoint saved after any number of ``next()`` calls therefore resumes with exactly
the next micro-batch.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kubetron.contract.errors import ConfigError
from kubetron.data.datasets import build_gpt_datasets
from kubetron.data.tokenizer import build_tokenizer

BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


def rank_sample_indices(consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int) -> range:
    """Global sample indices of the micro-batch that starts at ``consumed_samples``, for one rank."""
    start = consumed_samples + dp_rank * micro_batch_size
    return range(start, start + micro_batch_size)


def collate(
    samples: Sequence[dict[str, np.ndarray]], pin_memory: bool = False
) -> dict[str, torch.Tensor | None]:
    """Stack samples into ``(mbs, T)`` tensors. ``attention_mask`` is None (causal is implied) unless
    the dataset resets it per document: then ``(mbs, 1, T, T)`` bool, True = masked (megatron-core's)."""
    batch: dict[str, torch.Tensor | None] = {}
    for key in BATCH_KEYS:
        dtype = np.float32 if key == "loss_mask" else np.int64
        t = torch.from_numpy(np.stack([s[key] for s in samples]).astype(dtype, copy=False))
        batch[key] = t.pin_memory() if pin_memory else t
    if "segment_ids" in samples[0]:  # packed fine-tuning examples (data/finetuning.py)
        t = torch.from_numpy(np.stack([s["segment_ids"] for s in samples]))
        batch["segment_ids"] = t.pin_memory() if pin_memory else t
    mask = None
    if "attention_mask" in samples[0]:
        mask = torch.from_numpy(np.stack([s["attention_mask"] for s in samples]))
        mask = mask.pin_memory() if pin_memory else mask
    batch["attention_mask"] = mask
    return batch


def _make_batch(dataset, consumed: int, mbs: int, dp_rank: int, dp_size: int, pin: bool):
    return collate([dataset[i] for i in rank_sample_indices(consumed, mbs, dp_rank, dp_size)], pin)


_STOP_POLL_S = 0.1


def _producer(
    dataset, q: queue.Queue, stop: threading.Event, start: int, step: int, mbs, dp_rank, dp_size, pin
):
    """Thread body. Holds no reference to the DataIterator, so an unused iterator can be collected."""
    pos = start
    while not stop.is_set():
        item: tuple[int, Any, BaseException | None]  # (position, batch, what making it raised)
        try:
            item = (pos, _make_batch(dataset, pos, mbs, dp_rank, dp_size, pin), None)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            item = (pos, None, exc)
        while not stop.is_set():
            try:
                q.put(item, timeout=_STOP_POLL_S)
                break
            except queue.Full:
                continue
        if item[2] is not None:
            return
        pos += step


class DataIterator:
    """Endless iterator of this rank's micro-batches (see the module docstring for the order).

    ``next(it)`` -> ``{"tokens", "labels", "position_ids": int64 (mbs, T), "loss_mask": float32
    (mbs, T), "attention_mask": None}``. ``it.consumed_samples`` is the global number of samples
    handed out so far (all ranks), ``state_dict()``/``load_state_dict()`` save and restore it.
    """

    def __init__(
        self,
        dataset,
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        consumed_samples: int = 0,
        prefetch: int = 2,
        pin_memory: bool = False,
        name: str = "train",
    ):
        if micro_batch_size < 1:
            raise ConfigError("train.micro_batch_size", f"must be >= 1, got {micro_batch_size}")
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"bad data-parallel rank {dp_rank} of {dp_size}")
        if consumed_samples < 0:
            raise ValueError(f"consumed_samples must be >= 0, got {consumed_samples}")
        self.dataset = dataset
        self.micro_batch_size = int(micro_batch_size)
        self.dp_rank = int(dp_rank)
        self.dp_size = int(dp_size)
        self.step = self.micro_batch_size * self.dp_size
        self.prefetch = max(0, int(prefetch or 0))
        self.pin_memory = bool(pin_memory) and torch.cuda.is_available()
        self.name = name
        self._consumed = int(consumed_samples)
        self._thread: threading.Thread | None = None
        self._queue: queue.Queue | None = None
        self._stop: threading.Event | None = None
        self._closed = False

    # -- position ---------------------------------------------------------------------------
    @property
    def consumed_samples(self) -> int:
        """Global samples handed out so far (the same number on every data-parallel rank)."""
        return self._consumed

    def state_dict(self) -> dict:
        return {"consumed_samples": self._consumed}

    def load_state_dict(self, state: dict) -> None:
        consumed = int(state["consumed_samples"])
        if consumed < 0:
            raise ValueError(f"consumed_samples must be >= 0, got {consumed}")
        self._stop_thread()
        self._consumed = consumed

    def skip_microbatches(self, n: int) -> None:
        """Advance by ``n`` micro-batches without reading or producing anything."""
        if n < 0:
            raise ValueError(f"cannot skip {n} micro-batches")
        if n:
            self._stop_thread()
            self._consumed += n * self.step

    def sample_indices(self) -> range:
        """Global sample indices this rank's next micro-batch will hold."""
        return rank_sample_indices(self._consumed, self.micro_batch_size, self.dp_rank, self.dp_size)

    # -- iteration --------------------------------------------------------------------------
    def __iter__(self) -> DataIterator:
        return self

    def __next__(self) -> dict[str, torch.Tensor | None]:
        if self._closed:
            raise RuntimeError(f"{self.name} data iterator is closed")
        if self.prefetch == 0:
            batch = _make_batch(
                self.dataset,
                self._consumed,
                self.micro_batch_size,
                self.dp_rank,
                self.dp_size,
                self.pin_memory,
            )
        else:
            thread, q = self._prefetching()
            while True:
                try:
                    pos, batch, exc = q.get(timeout=1.0)
                    break
                except queue.Empty:
                    if not thread.is_alive():
                        raise RuntimeError(f"{self.name} data prefetch thread died") from None
            if exc is not None:
                self._stop_thread()
                raise exc
            if pos != self._consumed:  # cannot happen: the thread restarts on every reposition
                raise RuntimeError(f"prefetched batch at {pos}, expected {self._consumed}")
        self._consumed += self.step
        return batch

    def _prefetching(self) -> tuple[threading.Thread, queue.Queue]:
        """The prefetch thread and its queue, started first when none runs."""
        if self._thread is not None and self._queue is not None:
            return self._thread, self._queue
        q: queue.Queue = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()
        thread = threading.Thread(
            target=_producer,
            args=(
                self.dataset,
                q,
                stop,
                self._consumed,
                self.step,
                self.micro_batch_size,
                self.dp_rank,
                self.dp_size,
                self.pin_memory,
            ),
            name=f"kubetron-{self.name}-prefetch",
            daemon=True,
        )
        self._thread, self._queue, self._stop = thread, q, stop
        thread.start()
        return thread, q

    def _stop_thread(self) -> None:
        thread, q, stop = self._thread, self._queue, self._stop
        self._thread = self._queue = self._stop = None
        if thread is None or q is None or stop is None:  # (none runs: the three are set together)
            return
        stop.set()
        while thread.is_alive():
            try:  # free a slot so a blocked put() sees the stop flag
                while True:
                    q.get_nowait()
            except queue.Empty:
                pass
            thread.join(timeout=_STOP_POLL_S)

    def close(self) -> None:
        """Stop the prefetch thread; the iterator cannot be used afterwards."""
        self._stop_thread()
        self._closed = True

    def __del__(self) -> None:
        if self._thread is not None:
            self._stop_thread()

    def __repr__(self) -> str:
        return (
            f"DataIterator({self.name}, consumed_samples={self._consumed}, mbs={self.micro_batch_size}, "
            f"dp={self.dp_rank}/{self.dp_size}, prefetch={self.prefetch})"
        )


# -------------------------------------------------------------------------------------------------


def build_tokenizer_from_config(cfg):
    """The run's tokenizer (the checkpoint's files on a resume, see ``TokenizerConfig.adopt_assets``)."""
    tok_cfg = cfg.tokenizer
    if getattr(tok_cfg, "tokenizer_type", "byte") in ("byte", "null"):
        return build_tokenizer(tok_cfg.tokenizer_type, getattr(tok_cfg, "vocab_size", None) or cfg.model.vocab_size)
    return build_tokenizer(tok_cfg)


def split_sizes(cfg) -> list[int]:
    """Megatron's samples per split: train_iters * gbs; for validation (train_iters // eval_interval + 1) *
    eval_iters * gbs, every periodic evaluation and the one after training (eval_iters * gbs without
    eval_interval); eval_iters * gbs for test (one evaluation after training). eval_iters 0: none."""
    gbs = int(cfg.train.global_batch_size)
    iters = int(getattr(cfg.train, "train_iters", None) or 1)
    eval_iters = int(cfg.validation.eval_iters)
    interval = cfg.validation.eval_interval
    evaluations = (iters // interval if interval else 0) + 1
    return [iters * gbs, evaluations * eval_iters * gbs, eval_iters * gbs]


def build_datasets(cfg) -> dict:
    """``{"train", "valid", "test"}`` datasets for a ConfigContainer (mock when no data path)."""
    tokenizer = build_tokenizer_from_config(cfg)
    padded = getattr(cfg.model, "vocab_size", None)
    if padded is not None and tokenizer.vocab_size > padded:
        raise ConfigError(
            "model.vocab_size",
            f"{padded} is smaller than the tokenizer's vocabulary ({tokenizer.vocab_size})",
        )
    if getattr(getattr(cfg, "finetuning", None), "data_path", None):  # SFT examples instead of a corpus
        from kubetron.data.finetuning import build_finetuning_datasets

        return build_finetuning_datasets(cfg, tokenizer)
    required = (True, bool(cfg.validation.eval_interval), False)  # the others: evaluated if they hold data
    return build_gpt_datasets(cfg.dataset, cfg.model.seq_length, cfg.rng.seed, tokenizer, split_sizes(cfg), required)


def build_data_iterators(
    cfg,
    dp_rank: int,
    dp_size: int,
    train_consumed_samples: int = 0,
    valid_consumed_samples: int = 0,
) -> tuple[DataIterator | None, DataIterator | None]:
    """Train and validation iterators for this data-parallel rank (see build_train_valid_test_data_iterators)."""
    train, valid, test = build_train_valid_test_data_iterators(cfg, dp_rank, dp_size, train_consumed_samples,
                                                               valid_consumed_samples)
    if test is not None:
        test.close()
    return train, valid


def build_train_valid_test_data_iterators(
    cfg,
    dp_rank: int,
    dp_size: int,
    train_consumed_samples: int = 0,
    valid_consumed_samples: int = 0,
) -> tuple[DataIterator | None, DataIterator | None, DataIterator | None]:
    """Train, validation and test iterators for this data-parallel rank (the reference's name).

    Validation and test are None when their split holds no data or ``validation.eval_iters`` is 0; the
    test iterator always starts at the split's first sample (it is read once, after training).
    """
    mbs = int(cfg.train.micro_batch_size)
    gbs = int(cfg.train.global_batch_size)
    if gbs % (mbs * dp_size) != 0:
        raise ConfigError(
            "train.global_batch_size",
            f"{gbs} is not a multiple of micro_batch_size * data-parallel size = {mbs} * {dp_size}",
        )
    nmb = getattr(cfg.train, "num_microbatches", None)
    if nmb is not None and int(nmb) * mbs * dp_size != gbs:
        raise ConfigError("train.num_microbatches", f"{nmb} * {mbs} * {dp_size} != global_batch_size {gbs}")
    datasets = build_datasets(cfg)
    eval_interval = cfg.validation.eval_interval
    if eval_interval and datasets["valid"] is None:
        raise ConfigError(
            "dataset.split",
            f"validation is on (validation.eval_interval={eval_interval}) but split {cfg.dataset.split!r} "
            "leaves no validation data; give it weight or set validation.eval_interval to null",
        )
    prefetch = getattr(cfg.dataset, "prefetch", 2)
    pin = bool(getattr(cfg.dataset, "pin_memory", False))
    evaluated = cfg.validation.eval_iters > 0

    def iterator(name: str, consumed: int) -> DataIterator | None:
        if datasets[name] is None or (name != "train" and not evaluated):
            return None
        return DataIterator(datasets[name], mbs, dp_rank, dp_size, consumed, prefetch, pin, name=name)

    return (iterator("train", train_consumed_samples), iterator("valid", valid_consumed_samples),
            iterator("test", 0))
