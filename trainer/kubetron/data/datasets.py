"""GPT datasets: every sample is a dict of ``tokens``, ``labels`` (``tokens`` shifted by one),
``loss_mask`` and ``position_ids`` of length ``seq_length`` (plus ``attention_mask`` with
``dataset.reset_attention_mask``).

Data on disk (Megatron ``.bin/.idx`` prefixes) is built by megatron-core itself:
``BlendedMegatronDatasetBuilder`` with ``GPTDataset`` and ``BlendedDataset`` (they run on CPU; the
wheel ships the compiled ``helpers_cpp``), so the sample order is Megatron's for the same
``data_path``/``split`` (or per-split paths), seed, sequence length and sample counts, and
``reset_position_ids``, ``reset_attention_mask`` and ``eod_mask_loss`` are megatron-core's. The sample
counts are Megatron's: ``train_iters * global_batch_size`` for train,
``(train_iters // eval_interval + 1) * eval_iters * global_batch_size`` for validation (every periodic
evaluation and the one after training; ``eval_iters * global_batch_size`` without eval_interval),
``eval_iters * global_batch_size`` for test; a split of size 0 (``validation.eval_iters`` 0) is not
built, which leaves the other splits' documents and order as Megatron's. A validation split that only
the evaluation after training reads, or a test split, whose share of a prefix's documents holds no
tokens is left out (logged); a validation split that ``validation.eval_interval`` needs is an error.
An unweighted list of prefixes is weighted by size, as in Megatron. The shuffle indices are built in
memory on every rank (no cache files next to the data, which may be on a read-only volume).

A prefix ``s3://bucket/key`` goes through megatron-core's object-storage reader: the ``.idx`` is
copied to a local cache (``S3_INDEX_CACHE``), the ``.bin`` is read by ranged GETs; boto3 takes the
endpoint and credentials from the standard AWS environment.

Every dataset here is indexed by a *global sample index* ``0, 1, 2, ...``: the order never depends
on the data-parallel size. Past the planned number of samples the order starts again from sample 0.

No data path -> :class:`MockGPTDataset`: synthetic, generated on demand, learnable.

Which tokenizer made a prefix: ``kubetron preprocess`` writes ``<prefix>.tokenizer.json`` beside the
``.bin/.idx`` (megatron-core's ``.idx`` has no room for it): the tokenizer's type, vocabulary size, eod and a
fingerprint of the files that decide its ids. :func:`check_data_tokenizer` refuses, at start and in one line
naming both, a prefix made by another tokenizer than the run's (byte-level data read by an HF tokenizer trains
on meaningless ids); a prefix without the record (an older preprocess, megatron's own tools) is read as
before, with a log line.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Sequence

import numpy as np

from kubetron.contract.config import parse_data_path as config_parse_data_path
from kubetron.contract.config import parse_split as config_parse_split
from kubetron.contract.errors import ConfigError

log = logging.getLogger("kubetron")

SPLIT_NAMES = ("train", "valid", "test")
# Local cache of the .idx of s3:// prefixes (megatron-core's object_storage_cache_path).
S3_INDEX_CACHE = os.path.join(tempfile.gettempdir(), "kubetron-s3-index")
# Bytes of .bin per ranged GET for s3:// prefixes. megatron-core's default (256 MiB) would fetch
# 256 MiB per shuffled sample read; a few MiB keeps a cache miss cheap and still amortises requests.
S3_BIN_CHUNK_BYTES = 4 * 1024 * 1024

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


class EndlessDataset:
    """A megatron-core dataset indexed past its end: sample ``i`` is ``dataset[i % len(dataset)]``.

    Samples come back as numpy arrays (megatron-core returns tensors) so mock and indexed data collate alike.
    """

    def __init__(self, dataset, name: str = ""):
        self.dataset = dataset
        self.name = name
        self._len = len(dataset)

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        if index < 0:
            raise IndexError(index)
        sample = self.dataset[int(index) % self._len]
        return {k: v.numpy() if hasattr(v, "numpy") else v for k, v in sample.items() if k != "dataset_id"}

    def __repr__(self) -> str:
        return f"EndlessDataset({self.name}, {self._len} samples per pass)"


class McoreTokenizer:
    """What megatron-core's GPTDataset reads from a tokenizer: eod, pad (-1: none) and the vocabulary size."""

    def __init__(self, tokenizer):
        self.eod = int(tokenizer.eod)
        pad = getattr(tokenizer, "pad", None)
        self.pad = -1 if pad is None or pad == self.eod else int(pad)
        self.vocab_size = int(tokenizer.vocab_size)
        # part of megatron-core's dataset description (it names cache files; it does not change the order)
        self.unique_identifiers = {"class": type(tokenizer).__name__, "eod": self.eod, "pad": self.pad,
                                   "vocab_size": self.vocab_size}


# ---------------------------------------------------------------------------------------------
# data_path / split parsing and building


def parse_split(split: str | Sequence[float] | None) -> list[float]:
    """``"969,30,1"`` (or a list of numbers) -> 3 normalized weights; the syntax is config's."""
    if split is None or split == "":
        return [1.0, 0.0, 0.0]
    return config_parse_split(split if isinstance(split, str) else ",".join(str(x) for x in split))


def split_ranges(num_docs: int, weights: Sequence[float]) -> list[tuple[int, int] | None]:
    """megatron-core's document ranges per split (its split matrix and rounding); None: weight 0."""
    from megatron.core.datasets.blended_megatron_dataset_config import convert_split_vector_to_split_matrix

    matrix = convert_split_vector_to_split_matrix(list(weights))
    return [None if m is None else (int(round(m[0] * float(num_docs))), int(round(m[1] * float(num_docs))))
            for m in matrix]


def parse_data_path(data_path: str | Sequence[str] | None, field: str = "dataset.data_path"):
    """``["0.7", "a", "0.3", "b"]``, ``"0.7 a 0.3 b"`` or ``["a", "b"]`` -> ``[(weight, prefix)]``.

    Weights are normalized to sum to 1 (the unweighted form gives equal weights here; the builder
    passes no weights to megatron-core, which then weighs prefixes by size). Empty -> ``[]``.
    """
    items = _words(data_path)
    if not items:
        return []
    pairs = config_parse_data_path(items, field)
    total = sum(w for w, _ in pairs)
    return [(w / total, p) for w, p in pairs]


def _words(data_path) -> list[str]:
    if data_path is None:
        return []
    if isinstance(data_path, str):
        return data_path.split()
    return [w for x in data_path for w in str(x).split()]


def megatron_blend(data_path, field: str = "dataset.data_path") -> tuple[list[str], list[float] | None]:
    """megatron-core's blend: (prefixes, weights), weights None for the unweighted form."""
    items = _words(data_path)
    pairs = parse_data_path(items, field)
    weighted = len(items) > 1 and _is_number(items[0])
    prefixes = [_strip_suffix(p) for _, p in pairs]
    for prefix in prefixes:
        open_indexed(prefix, field)  # a missing or foreign file is a config error, not an mcore assert
    return prefixes, ([w for w, _ in pairs] if weighted else None)


def _is_number(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return True


def _strip_suffix(prefix: str) -> str:
    for suffix in (".bin", ".idx"):
        if prefix.endswith(suffix):
            return prefix[: -len(suffix)]
    return prefix


def open_indexed(prefix: str, field: str = "dataset.data_path"):
    """Open a megatron-core ``IndexedDataset`` (mmap), or raise ConfigError naming the field.
    For ``s3://`` the index is fetched to the local cache and only it is opened (its
    ``sequence_lengths`` are all the checks here need; the .bin is read when sampling)."""
    prefix = _strip_suffix(prefix)
    if prefix.startswith("s3://"):
        return _open_s3_index(prefix, field)
    missing = [p for p in (prefix + ".bin", prefix + ".idx") if not os.path.isfile(p)]
    if missing:
        raise ConfigError(field, f"no indexed dataset at {prefix!r}: missing {', '.join(missing)}")
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    try:
        return IndexedDataset(prefix, mmap=True)
    except Exception as exc:  # a truncated or foreign file
        raise ConfigError(field, f"cannot read indexed dataset {prefix!r}: {exc}") from exc


def _s3_cache_path(prefix: str) -> str:
    """Where megatron-core keeps the local copy of ``prefix``.idx (its ``get_index_cache_path``)."""
    return os.path.join(S3_INDEX_CACHE, prefix.removeprefix("s3://") + ".idx")


def _open_s3_index(prefix: str, field: str):
    """Fetch ``prefix``.idx into megatron-core's cache on *this* rank and open it.

    Why on every rank: megatron-core downloads the index on global rank 0 only and the other ranks
    merely assert that the file exists, which fails on every node but rank 0's (the cache is local).
    The download goes to a temporary name and is renamed, so local ranks racing here are harmless.
    Endpoint and credentials: boto3's standard environment (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...),
    as megatron-core's own ``boto3.client("s3")`` reads them."""
    import boto3
    import botocore.exceptions as bce
    from megatron.core.datasets.indexed_dataset import _IndexReader

    bucket, _, key = prefix.removeprefix("s3://").partition("/")
    local = _s3_cache_path(prefix)
    try:
        client = boto3.client("s3")
        client.head_object(Bucket=bucket, Key=key + ".bin")
        os.makedirs(os.path.dirname(local), exist_ok=True)
        client.download_file(bucket, key + ".idx", local)
    except (bce.BotoCoreError, bce.ClientError, ValueError) as exc:
        raise ConfigError(field, f"cannot read indexed dataset {prefix!r} (.bin/.idx): {exc}") from exc
    try:
        return _IndexReader(local, multimodal=False)
    except Exception as exc:  # a truncated or foreign file
        raise ConfigError(field, f"cannot read indexed dataset {prefix!r}: {exc}") from exc


TOKENIZER_RECORD = ".tokenizer.json"  # <prefix>.tokenizer.json: which tokenizer made <prefix>.bin/.idx
_ID_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt")  # the files that decide the ids
_RECORD_KEYS = ("tokenizer_type", "vocab_size", "eod", "fingerprint")
_MAX_RECORD_BYTES = 1 << 20


def tokenizer_record(tokenizer) -> dict:
    """What preprocess records beside its output: type, vocabulary size, eod and a fingerprint of the files that
    decide the ids (JSON by content, so a file saved again with other formatting is the same tokenizer)."""
    digest = hashlib.sha256(tokenizer.tokenizer_type.encode())
    assets = tokenizer.assets()
    for name in sorted(n for n in assets if n in _ID_FILES):
        data = assets[name]
        if name.endswith(".json"):
            data = json.dumps(json.loads(data), sort_keys=True, separators=(",", ":")).encode()
        digest.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
    return {"tokenizer_type": tokenizer.tokenizer_type, "vocab_size": int(tokenizer.vocab_size),
            "eod": int(tokenizer.eod), "fingerprint": digest.hexdigest()[:16]}


def _describe(record: dict) -> str:
    return (f"{record.get('tokenizer_type')} (vocabulary {record.get('vocab_size')}, eod {record.get('eod')}, "
            f"files {record.get('fingerprint')})")


def read_tokenizer_record(prefix: str, field: str) -> dict | None:
    """``<prefix>.tokenizer.json`` (local or s3://), or None when there is none."""
    path = _strip_suffix(prefix) + TOKENIZER_RECORD
    try:
        if path.startswith("s3://"):
            from kubetron.storage import open_store

            parent, _, leaf = path.rpartition("/")
            store = open_store(parent)
            data = None
            if store.exists(leaf):
                with store.open_read(leaf) as f:
                    data = f.read(_MAX_RECORD_BYTES)
        elif os.path.isfile(path):
            with open(path, "rb") as f:
                data = f.read(_MAX_RECORD_BYTES)
        else:
            data = None
        record = None if data is None else json.loads(data)
    except (OSError, ValueError) as exc:
        raise ConfigError(field, f"{path}: not a tokenizer record ({exc})") from None
    if record is not None and not isinstance(record, dict):
        raise ConfigError(field, f"{path}: not a tokenizer record (a JSON object)")
    return record


def check_data_tokenizer(dataset_cfg, tokenizer) -> None:
    """Every data prefix of the ``dataset`` section was made by ``tokenizer``: a prefix whose record names
    another is a config error naming both; prefixes without a record are logged and read as they are."""
    ours, unknown = tokenizer_record(tokenizer), []
    for field, paths in (("dataset.data_path", dataset_cfg.data_path),
                         *((f"dataset.{k}_data_path", v) for k, v in dataset_cfg.blends().items())):
        for _, prefix in parse_data_path(paths, field):
            record = read_tokenizer_record(prefix, field)
            if record is None:
                unknown.append(_strip_suffix(prefix))
            elif any(record.get(k) != ours[k] for k in _RECORD_KEYS):
                raise ConfigError(field, f"{_strip_suffix(prefix)} was tokenized by {_describe(record)}; this run's "
                                         f"tokenizer is {_describe(ours)}: preprocess it again with this tokenizer, "
                                         "or configure the one that made it")
    if unknown:
        log.info("%s: no %s beside the data (an older preprocess or megatron's tools): which tokenizer made it is "
                 "not checked", ", ".join(sorted(set(unknown))[:3]), TOKENIZER_RECORD)


def _check_not_empty(prefix: str, field: str) -> None:
    """A per-split prefix without tokens would make megatron-core spin forever: refuse it first."""
    indexed = open_indexed(prefix, field)  # held while its mmap'd lengths are read
    if int(np.asarray(indexed.sequence_lengths).sum()) == 0:
        raise ConfigError(field, f"{prefix!r} holds no tokens")


def _splits_with_tokens(prefixes, weights, wanted, required, split: str) -> list[bool]:
    """`wanted` less the optional splits whose document range of some prefix holds no tokens.
    megatron-core spins forever drawing samples from a split without tokens: a required split
    without any is a config error; an optional one is left out, with a log line."""
    wanted = list(wanted)
    for prefix in prefixes:
        indexed = open_indexed(prefix)
        lengths = np.array(indexed.sequence_lengths)  # a copy: the mmap closes with `indexed`
        for i, r in enumerate(split_ranges(lengths.size, weights)):
            if not wanted[i] or r is None or int(lengths[r[0] : r[1]].sum()) > 0:
                continue
            what = (f"{split!r} gives the {SPLIT_NAMES[i]} split {r[1] - r[0]} of the {lengths.size} documents "
                    f"of {prefix!r} (no tokens)")
            if required[i]:
                raise ConfigError("dataset.split", f"{what}; give it more weight or 0")
            log.info("dataset.split %s: no %s evaluation", what, SPLIT_NAMES[i])
            wanted[i] = False
    return wanted


class _NoIndexCacheNotice(logging.Filter):
    """Drops megatron-core's warning, once per dataset, that it cannot save its sample indices: kubetron builds
    them in memory on purpose (``path_to_cache=""``, the data may be on a read-only volume)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "indexes because path_to_cache is None" not in record.getMessage()


_NO_INDEX_CACHE_NOTICE = _NoIndexCacheNotice()


def _quiet_index_cache_notices() -> None:
    for name in ("megatron.core.datasets.gpt_dataset", "megatron.core.datasets.blended_dataset"):
        logger = logging.getLogger(name)
        if _NO_INDEX_CACHE_NOTICE not in logger.filters:
            logger.addFilter(_NO_INDEX_CACHE_NOTICE)


def _gpt_dataset_class():
    """megatron-core's ``GPTDataset``, reading s3:// prefixes in S3_BIN_CHUNK_BYTES ranged GETs
    (megatron-core's own path fixes the chunk at 256 MiB and needs ``mmap_bin_files`` off globally)."""
    from megatron.core.datasets.gpt_dataset import GPTDataset
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron.core.datasets.object_storage_utils import ObjectStorageConfig

    class KubetronGPTDataset(GPTDataset):
        @staticmethod
        def build_low_level_dataset(dataset_path, config):
            if not dataset_path.startswith("s3://"):
                return GPTDataset.build_low_level_dataset(dataset_path, config)
            storage = ObjectStorageConfig(config.object_storage_cache_path, bin_chunk_nbytes=S3_BIN_CHUNK_BYTES)
            return IndexedDataset(dataset_path, multimodal=False, mmap=False, object_storage_config=storage)

    return KubetronGPTDataset


def build_gpt_datasets(
    dataset_cfg,
    seq_length: int,
    seed: int,
    tokenizer,
    sizes: Sequence[int],
    required: Sequence[bool] = (True, True, True),
) -> dict[str, object | None]:
    """``{"train": ds, "valid": ds|None, "test": ds|None}`` for a ``dataset`` config section.

    ``sizes`` are the samples each split must provide (Megatron's train/valid/test counts); a split of
    ``data_path`` that is not ``required`` and holds no tokens is None.
    No data path -> mock data for all three splits (different streams per split, from
    ``dataset_cfg.mock_seed`` or else ``seed``).
    """
    d = dataset_cfg
    per_split = {n: getattr(d, f"{n}_data_path", None) for n in SPLIT_NAMES}
    if d.data_path is None and per_split["train"] is None:
        s = seed if getattr(d, "mock_seed", None) is None else d.mock_seed
        return {name: MockGPTDataset(seq_length, tokenizer.eod, seed=s, salt=i) for i, name in enumerate(SPLIT_NAMES)}
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    blend = blend_per_split = split = None
    wanted = [size > 0 for size in sizes]  # a split nobody reads is not built (nor required to hold data)
    if d.data_path is not None:
        blend = megatron_blend(d.data_path)
        weights = parse_split(d.split)
        split = ",".join(repr(w) for w in weights)
        wanted = _splits_with_tokens(blend[0], weights, wanted, required, str(d.split))
    else:
        blend_per_split = [None if v is None or not w else megatron_blend(v, f"dataset.{n}_data_path")
                           for (n, v), w in zip(per_split.items(), wanted)]
        for n, b in zip(SPLIT_NAMES, blend_per_split):
            for prefix in b[0] if b else ():
                _check_not_empty(prefix, f"dataset.{n}_data_path")
    reset_attention_mask = bool(getattr(d, "reset_attention_mask", False))
    config = GPTDatasetConfig(
        random_seed=int(seed),
        sequence_length=int(seq_length),
        blend=blend,
        blend_per_split=blend_per_split,
        split=split,
        path_to_cache="",  # build the indices in memory on every rank: never write next to the data
        tokenizer=McoreTokenizer(tokenizer),
        reset_position_ids=bool(getattr(d, "reset_position_ids", False)),
        reset_attention_mask=reset_attention_mask,
        eod_mask_loss=bool(getattr(d, "eod_mask_loss", False)),
        create_attention_mask=reset_attention_mask,  # otherwise causal is implied and no mask is built
        object_storage_cache_path=S3_INDEX_CACHE,  # used for s3:// prefixes only
    )
    if config.split_matrix is not None:  # unwanted splits: None keeps the others' document ranges as they are
        config.split_matrix = [m if w else None for m, w in zip(config.split_matrix, wanted)]
    _quiet_index_cache_notices()
    built = BlendedMegatronDatasetBuilder(_gpt_dataset_class(), list(sizes), lambda: True, config).build()
    out: dict[str, object | None] = {name: (EndlessDataset(ds, name) if ds is not None and len(ds) > 0 else None)
           for name, ds in zip(SPLIT_NAMES, built)}
    if out["train"] is None:
        raise ConfigError("dataset.data_path", f"the train split holds no sample of {seq_length + 1} tokens")
    return out
