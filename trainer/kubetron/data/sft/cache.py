"""The tokenized and packed fine-tuning data, built once and reused by every rank and every restart.

* Key: a SHA-256 over ``CACHE_VERSION``, each data file's path, size and version (mtime, or the ETag on S3), the
  tokenizer's type and files (its chat templates included), and the settings that shape the samples
  (``seq_length``, ``packing``, ``add_eod``, the row keys, the chosen chat template). Another input is another key.
* Where: ``finetuning.cache_dir``; else the job's store, ``<checkpoint.save>/sft_cache`` (every rank and every
  restart of a job sees it, and it works when the data sits on read-only storage or S3); else, for a run that saves
  nothing, ``$TMPDIR/kubetron-sft-cache`` on this machine.
* Who: global rank 0 (local rank 0 for the machine-local default) loads it, or builds and writes it in one atomic
  write (``<key>.npz``: a temp file renamed, or one S3 PUT); every other rank waits for that file and loads it.
* A cache is data, not code: ``np.load`` without pickles, and it is checked before use (its key, array types and
  lengths, token ids below the vocabulary); one that fails (truncated, damaged, foreign) is rebuilt.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable

import numpy as np

log = logging.getLogger("kubetron")

CACHE_VERSION = 1
CACHE_SUBDIR = "sft_cache"
LOCAL_CACHE = os.path.join(tempfile.gettempdir(), "kubetron-sft-cache")
WAIT_LOG_EVERY_S = 30.0
POLL_S = 0.5
ARRAYS = {"tokens": np.int32, "flags": np.uint8, "offsets": np.int64, "groups": np.int64,
          "group_offsets": np.int64, "meta": np.uint8}


def cache_key(files: list, tokenizer, settings: dict) -> str:
    """The hex key of one dataset: what it is built from, never when or where."""
    assets = tokenizer.assets()
    digest = {name: hashlib.sha256(assets[name]).hexdigest() for name in sorted(assets)}
    what = {"version": CACHE_VERSION, "files": [f.identity() for f in files], "tokenizer": tokenizer.tokenizer_type,
            "vocab_size": int(tokenizer.vocab_size), "tokenizer_files": digest, "settings": settings}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:40]


def cache_location(cache_dir: str | None, save: str | None) -> tuple[str, bool]:
    """(where the caches live, whether every rank of the job sees it)."""
    if cache_dir:
        return cache_dir, True
    if save:
        return f"{save.rstrip('/')}/{CACHE_SUBDIR}", True
    return LOCAL_CACHE, False


def is_builder(shared: bool, env=os.environ) -> bool:
    return int(env.get("RANK" if shared else "LOCAL_RANK", "0") or 0) == 0


def to_bytes(arrays: dict[str, np.ndarray], key: str, meta: dict) -> bytes:
    buf = io.BytesIO()
    blob = np.frombuffer(json.dumps({**meta, "key": key, "version": CACHE_VERSION}).encode(), dtype=np.uint8)
    np.savez(buf, **{k: np.asarray(v, dtype=ARRAYS[k]) for k, v in arrays.items()},  # type: ignore[arg-type]
             meta=blob)  # (numpy's stubs: **arrays could name allow_pickle)
    return buf.getvalue()


def from_bytes(data: bytes, key: str, vocab_size: int) -> tuple[dict[str, np.ndarray], dict]:
    """The arrays and meta of a cache file; ValueError saying why it cannot be used."""
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            arrays = {k: z[k] for k in ARRAYS}
    except Exception as e:  # a damaged zip, a missing array, an object array: all mean "rebuild"
        raise ValueError(f"unreadable ({type(e).__name__}: {e})") from None
    meta = json.loads(arrays.pop("meta").tobytes().decode("utf-8", "replace") or "{}")
    if not isinstance(meta, dict) or meta.get("key") != key or meta.get("version") != CACHE_VERSION:
        raise ValueError("made for other inputs")
    _check(arrays, vocab_size)
    return arrays, meta


def _check(a: dict[str, np.ndarray], vocab_size: int) -> None:
    for name, dtype in ARRAYS.items():
        if name in a and (a[name].dtype != dtype or a[name].ndim != 1):
            raise ValueError(f"{name} is {a[name].dtype}[{a[name].ndim}-d], not {np.dtype(dtype)}[1-d]")
    off, goff = a["offsets"], a["group_offsets"]
    if len(a["flags"]) != len(a["tokens"]) or not _bounds(off, len(a["tokens"])) or not _bounds(goff, len(a["groups"])):
        raise ValueError("inconsistent lengths")
    if len(off) < 2 or np.any(np.diff(off) < 2) or np.any(np.diff(goff) < 1):
        raise ValueError("an example or a sequence is empty")
    if len(a["tokens"]) and (a["tokens"].min() < 0 or a["tokens"].max() >= vocab_size):
        raise ValueError(f"token ids outside the vocabulary of {vocab_size}")
    if len(a["groups"]) and (a["groups"].min() < 0 or a["groups"].max() >= len(off) - 1):
        raise ValueError("a sequence names an example that does not exist")


def _bounds(offsets: np.ndarray, total: int) -> bool:
    return len(offsets) >= 1 and offsets[0] == 0 and offsets[-1] == total and bool(np.all(np.diff(offsets) >= 0))


def load_or_build(location: str, shared: bool, key: str, vocab_size: int,
                  build: Callable[[], tuple[dict[str, np.ndarray], dict]], what: str):
    """(arrays, meta, how) of the dataset `key`: loaded from `location`, or built (and stored by the builder)."""
    from kubetron.storage import open_store

    store, name = open_store(location), f"{key}.npz"
    builder = is_builder(shared)
    if not builder:
        _wait_for(store, name, what)
    if store.exists(name):
        try:
            arrays, meta = from_bytes(store.read_bytes(name), key, vocab_size)
            return arrays, meta, f"loaded from {store.url}/{name}"
        except ValueError as e:
            log.warning("%s: the cached %s/%s is %s; rebuilding it", what, store.url, name, e)
    arrays, meta = build()
    if not builder:
        return arrays, meta, "built here (the stored copy could not be used)"
    store.write_bytes(name, to_bytes(arrays, key, meta))
    return arrays, meta, f"stored in {store.url}/{name}"


def _wait_for(store, name: str, what: str) -> None:
    """Until rank 0 has stored the dataset (if rank 0 fails, torchrun ends this process with it)."""
    t0 = last = time.monotonic()
    while not store.exists(name):
        if time.monotonic() - last >= WAIT_LOG_EVERY_S:
            last = time.monotonic()
            log.info("%s: waiting for rank 0 to store %s/%s (%.0fs)", what, store.url, name, last - t0)
        time.sleep(POLL_S)
