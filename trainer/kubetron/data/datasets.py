"""GPT datasets: every sample is a dict of numpy arrays of length ``seq_length``.

``tokens`` (int64), ``labels`` (int64, ``tokens`` shifted by one), ``loss_mask`` (float32, 0 where the
label is the pad id) and ``position_ids`` (int64, ``0..seq_length-1``; positions are not reset at
document boundaries, as in Megatron's default). Causal attention is implied: there is no mask.

Every dataset here is indexed by a *global sample index* ``0, 1, 2, ...`` with no upper bound: an
index past the end of an epoch wraps into the next epoch, which (for data on disk) is reshuffled
deterministically. ``len(ds)`` is the number of samples in one epoch. Sample ``i`` is a pure
function of ``(seed, i)`` and the data, so the order never depends on the data-parallel size.

* :class:`MockGPTDataset` - synthetic, generated on demand, learnable (arithmetic progressions).
* :class:`IndexedGPTDataset` - one split of one Megatron ``.bin/.idx`` prefix.
* :class:`BlendedDataset` - a weighted mix of several datasets.

:func:`build_gpt_datasets` turns ``data_path`` + ``split`` into train/valid/test datasets.

Splitting (like Megatron): the ``split`` weights (e.g. ``"969,30,1"``) divide the *documents* of each
prefix into three contiguous ranges: train, valid, test. Within a split, an epoch is: shuffle the
documents (numpy ``Generator`` seeded from the seed, the prefix's position in ``data_path``, the
split and the epoch), concatenate them as stored, cut the stream into windows of ``seq_length + 1``
tokens that overlap by one token (window ``k`` starts at token ``k * seq_length``; the last partial
window is dropped) and shuffle the windows. Documents are concatenated *as stored*: ``kubetron
preprocess`` appends the ``eod`` token to every document (its default), which is what separates
documents in a sample. Nothing is cached on disk; per epoch the dataset keeps two permutations in
memory (one int64 per document and one per sample).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from kubetron.config import parse_data_path as config_parse_data_path
from kubetron.config import parse_split as config_parse_split
from kubetron.errors import ConfigError

SPLIT_NAMES = ("train", "valid", "test")

_M64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64 finalizer: a cheap, well-mixed hash of a 64-bit integer."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def make_sample(window: np.ndarray, pad_id: int | None = None) -> dict[str, np.ndarray]:
    """A sample from ``seq_length + 1`` consecutive tokens."""
    window = np.asarray(window, dtype=np.int64)
    tokens = window[:-1]
    labels = window[1:]
    if pad_id is None:
        loss_mask = np.ones(tokens.shape, dtype=np.float32)
    else:
        loss_mask = (labels != pad_id).astype(np.float32)
    return {
        "tokens": tokens,
        "labels": labels,
        "loss_mask": loss_mask,
        "position_ids": np.arange(tokens.shape[0], dtype=np.int64),
    }


class MockGPTDataset:
    """Synthetic data with a rule a small GPT learns within tens of iterations.

    Sample ``i`` is an arithmetic progression ``tokens[j] = (start + stride * j) % num_tokens`` with
    ``start`` uniform in ``[0, num_tokens)`` and ``stride`` uniform in ``1..max_stride``, both drawn
    from a hash of ``(seed, salt, i)``. The next token follows from the current one up to the
    stride (a bigram model gets to ``ln(max_stride)``), and exactly from the previous two.
    Generated on demand in O(seq_length) numpy work; there is no precomputation and no end.

    ``num_tokens`` is how many ids are used (``0..num_tokens-1``): pass the tokenizer's ``eod`` so
    the special ids never appear. ``len()`` is a nominal epoch size (``epoch_samples``).
    """

    def __init__(
        self,
        seq_length: int,
        num_tokens: int,
        seed: int = 1234,
        salt: int = 0,
        max_stride: int = 4,
        epoch_samples: int = 1 << 40,
    ):
        if seq_length < 1:
            raise ConfigError("model.seq_length", f"must be >= 1, got {seq_length}")
        if num_tokens < 2:
            raise ConfigError("model.vocab_size", f"mock data needs at least 2 token ids, got {num_tokens}")
        self.seq_length = int(seq_length)
        self.num_tokens = int(num_tokens)
        self.max_stride = max(1, min(int(max_stride), self.num_tokens - 1))
        self.epoch_samples = int(epoch_samples)
        self._key = _mix64(_mix64(int(seed) & _M64) ^ (int(salt) & _M64))
        self._steps = np.arange(self.seq_length + 1, dtype=np.int64)

    def __len__(self) -> int:
        return self.epoch_samples

    def window(self, index: int) -> np.ndarray:
        if index < 0:
            raise IndexError(index)
        h = _mix64(self._key ^ int(index))
        start = h % self.num_tokens
        stride = 1 + (h >> 40) % self.max_stride
        return (self._steps * stride + start) % self.num_tokens

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        return make_sample(self.window(index))


class IndexedGPTDataset:
    """One split (a contiguous range of documents) of one megatron-core ``IndexedDataset``.

    ``indexed`` is an opened ``megatron.core.datasets.indexed_dataset.IndexedDataset``; documents
    ``[doc_begin, doc_end)`` (Megatron documents, via ``document_indices``) form this split. See the
    module docstring for how samples are cut and shuffled.
    """

    def __init__(
        self,
        indexed,
        doc_begin: int,
        doc_end: int,
        seq_length: int,
        seed: int,
        salt: Sequence[int] = (),
        pad_id: int | None = None,
        name: str = "",
    ):
        self.indexed = indexed
        self.seq_length = int(seq_length)
        self.seed = int(seed)
        self.salt = tuple(int(s) for s in salt)
        self.pad_id = pad_id
        self.name = name
        doc_index = np.asarray(indexed.document_indices)
        self.seq_begin = int(doc_index[doc_begin])
        self.seq_end = int(doc_index[doc_end])
        self.lengths = np.asarray(indexed.sequence_lengths[self.seq_begin : self.seq_end], dtype=np.int64)
        self.num_tokens = int(self.lengths.sum())
        # windows of seq_length + 1 tokens overlapping by one token
        self.samples_per_epoch = max(0, (self.num_tokens - 1) // self.seq_length)
        self._epochs: OrderedDict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = OrderedDict()

    def __len__(self) -> int:
        return self.samples_per_epoch

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        cached = self._epochs.get(epoch)
        if cached is not None:
            self._epochs.move_to_end(epoch)
            return cached
        rng = np.random.default_rng([self.seed & 0xFFFFFFFF, self.seed >> 32, *self.salt, epoch])
        doc_order = rng.permutation(self.lengths.shape[0])
        doc_ends = np.cumsum(self.lengths[doc_order])
        sample_order = rng.permutation(self.samples_per_epoch)
        cached = (doc_order, doc_ends, sample_order)
        self._epochs[epoch] = cached
        while len(self._epochs) > 2:
            self._epochs.popitem(last=False)
        return cached

    def window(self, index: int) -> np.ndarray:
        if self.samples_per_epoch == 0:
            raise IndexError(
                f"{self.name or 'dataset'} has no complete sample of {self.seq_length + 1} tokens"
            )
        if index < 0:
            raise IndexError(index)
        epoch, within = divmod(int(index), self.samples_per_epoch)
        doc_order, doc_ends, sample_order = self._epoch(epoch)
        pos = int(sample_order[within]) * self.seq_length
        need = self.seq_length + 1
        i = int(np.searchsorted(doc_ends, pos, side="right"))
        pieces = []
        while need > 0:
            doc_start = int(doc_ends[i]) - int(self.lengths[doc_order[i]])
            offset = pos - doc_start
            take = min(need, int(doc_ends[i]) - pos)
            if take > 0:
                seq = self.seq_begin + int(doc_order[i])
                pieces.append(self.indexed.get(seq, offset=offset, length=take))
                need -= take
                pos += take
            i += 1
        return np.concatenate(pieces).astype(np.int64) if len(pieces) > 1 else pieces[0].astype(np.int64)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        return make_sample(self.window(index), self.pad_id)


class BlendedDataset:
    """Mix datasets by weight. Global sample ``i`` goes to one child, deterministically.

    The assignment is Megatron's greedy rule (pick the dataset furthest below its target share)
    computed once for a block of ``block`` samples and repeated: in every block each dataset gets
    the same count, so sample ``i`` maps to ``(dataset, k * count + rank within block)`` in O(1).
    Shares are exact to ``1 / block``. Children wrap into their next epoch independently.
    """

    def __init__(self, datasets: Sequence, weights: Sequence[float], block: int = 10_000):
        if len(datasets) != len(weights) or not datasets:
            raise ValueError("BlendedDataset needs one weight per dataset")
        w = np.asarray(weights, dtype=np.float64)
        w = w / w.sum()
        self.datasets = list(datasets)
        self.weights = w
        counts = np.zeros(len(datasets), dtype=np.int64)
        self._which = np.empty(block, dtype=np.int64)
        self._rank = np.empty(block, dtype=np.int64)
        for i in range(block):
            d = int(np.argmax(w * (i + 1) - counts))
            self._which[i] = d
            self._rank[i] = counts[d]
            counts[d] += 1
        self._per_block = counts
        self.block = block

    def __len__(self) -> int:
        return sum(len(d) for d in self.datasets)

    def locate(self, index: int) -> tuple[int, int]:
        """``(dataset number, sample index in that dataset)`` of global sample ``index``."""
        k, b = divmod(int(index), self.block)
        d = int(self._which[b])
        return d, k * int(self._per_block[d]) + int(self._rank[b])

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        d, i = self.locate(index)
        return self.datasets[d][i]


# ---------------------------------------------------------------------------------------------
# data_path / split parsing and building


def parse_split(split: str | Sequence[float] | None) -> list[float]:
    """``"969,30,1"`` (or a list of numbers) -> 3 normalized weights; the syntax is config's."""
    if split is None or split == "":
        return [1.0, 0.0, 0.0]
    return config_parse_split(split if isinstance(split, str) else ",".join(str(x) for x in split))


def split_ranges(num_docs: int, weights: Sequence[float]) -> list[tuple[int, int]]:
    """Megatron's ``get_split_indices``: contiguous document ranges, rounding fixed on the last."""
    idx = [0]
    for w in weights:
        idx.append(idx[-1] + round(w * float(num_docs)))
    diff = idx[-1] - num_docs
    for i in range(1, len(idx)):
        idx[i] -= diff
    idx = [max(0, min(num_docs, v)) for v in idx]
    for i in range(1, len(idx)):
        idx[i] = max(idx[i], idx[i - 1])
    return [(idx[i], idx[i + 1]) for i in range(len(weights))]


def parse_data_path(data_path: str | Sequence[str] | None) -> list[tuple[float, str]]:
    """``["0.7", "a", "0.3", "b"]`` or ``["a", "b"]`` (equal weights) -> ``[(weight, prefix)]``.

    The syntax is config's (`kubetron.config.parse_data_path`); a single string is split on whitespace.
    Weights are normalized to sum to 1. Empty -> ``[]``.
    """
    if data_path is None:
        return []
    items = data_path.split() if isinstance(data_path, str) else [str(x) for x in data_path if str(x) != ""]
    if not items:
        return []
    pairs = config_parse_data_path(items)
    total = sum(w for w, _ in pairs)
    return [(w / total, p) for w, p in pairs]


def _strip_suffix(prefix: str) -> str:
    for suffix in (".bin", ".idx"):
        if prefix.endswith(suffix):
            return prefix[: -len(suffix)]
    return prefix


def open_indexed(prefix: str):
    """Open a megatron-core ``IndexedDataset`` (mmap), or raise ConfigError naming data_path."""
    prefix = _strip_suffix(prefix)
    missing = [p for p in (prefix + ".bin", prefix + ".idx") if not os.path.isfile(p)]
    if missing:
        raise ConfigError(
            "dataset.data_path", f"no indexed dataset at {prefix!r}: missing {', '.join(missing)}"
        )
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    try:
        return IndexedDataset(prefix, mmap=True)
    except Exception as exc:  # a truncated or foreign file
        raise ConfigError("dataset.data_path", f"cannot read indexed dataset {prefix!r}: {exc}") from exc


def build_gpt_datasets(
    data_path,
    split,
    seq_length: int,
    seed: int,
    tokenizer,
    mock_seed: int | None = None,
) -> dict[str, object | None]:
    """``{"train": ds, "valid": ds|None, "test": ds|None}``.

    No ``data_path`` -> mock data for all three splits (different streams per split, from
    ``mock_seed`` or else ``seed``). With a ``data_path``, a split whose weight is 0 or which has no
    complete sample in any prefix is None; prefixes too small for a split are dropped from that
    split's blend (the remaining weights are renormalized).
    """
    blend = parse_data_path(data_path)
    if not blend:
        s = seed if mock_seed is None else mock_seed
        return {
            name: MockGPTDataset(seq_length, tokenizer.eod, seed=s, salt=i)
            for i, name in enumerate(SPLIT_NAMES)
        }
    weights = parse_split(split)
    pad = getattr(tokenizer, "pad", None)
    pad_id = pad if pad is not None and pad != tokenizer.eod else None
    parts: dict[str, list[tuple[float, IndexedGPTDataset]]] = {n: [] for n in SPLIT_NAMES}
    for p_i, (w, prefix) in enumerate(blend):
        indexed = open_indexed(prefix)
        num_docs = len(indexed.document_indices) - 1
        for s_i, ((begin, end), name) in enumerate(zip(split_ranges(num_docs, weights), SPLIT_NAMES)):
            if weights[s_i] == 0 or end <= begin:
                continue
            ds = IndexedGPTDataset(
                indexed,
                begin,
                end,
                seq_length,
                seed,
                salt=(p_i, s_i),
                pad_id=pad_id,
                name=f"{_strip_suffix(prefix)}[{name}]",
            )
            if len(ds) > 0:
                parts[name].append((w, ds))
    out: dict[str, object | None] = {}
    for name in SPLIT_NAMES:
        entries = parts[name]
        if not entries:
            out[name] = None
        elif len(entries) == 1:
            out[name] = entries[0][1]
        else:
            out[name] = BlendedDataset([d for _, d in entries], [w for w, _ in entries])
    if out["train"] is None:
        raise ConfigError(
            "dataset.data_path",
            f"the train split has no complete sample of {seq_length + 1} tokens "
            f"(data_path={data_path!r}, split={split!r})",
        )
    return out
