"""The tokenized and packed fine-tuning data, built once and reused by every rank and every restart.

* Key: a SHA-256 over ``CACHE_VERSION``, the **content** of each data file (streamed through the hash, in reading
  order, with its name), the tokenizer's type and files (its chat templates included), and the settings that shape
  the samples (``seq_length``, ``packing``, ``add_eod``, the row keys, the chosen chat template). Another input is
  another key: an edit that keeps a file's size and puts its mtime back is another key too. Every rank hashes the
  data itself (it trusts no other process's word for what the data is).
* Authenticated: a cache file is ``MAGIC + HMAC-SHA256(job key, npz bytes) + npz bytes``. The job key is 32 random
  bytes kept in the job's own store (``<checkpoint.save>/sft_cache.key``, written once by rank 0; without
  ``checkpoint.save``, ``$TMPDIR/kubetron-sft-cache/key``, a directory only this user may write). A cache another
  job wrote, or anyone who can write a shared ``finetuning.cache_dir`` but not this job's store, does not verify:
  it is rebuilt (and overwritten), with a line saying why.
* Where: ``finetuning.cache_dir``; else the job's store, ``<checkpoint.save>/sft_cache`` (every rank and every
  restart of a job sees it, and it works when the data sits on read-only storage or S3); else, for a run that saves
  nothing, ``$TMPDIR/kubetron-sft-cache`` on this machine.
* Who: global rank 0 (local rank 0 for the machine-local default) loads it, or builds and writes it in one atomic
  write (``<key>.sftcache``: a temp file renamed, or one S3 PUT); every other rank waits for that file and loads it.
* A cache is data, not code: its MAC is checked first, then ``np.load`` without pickles, then its arrays (its key,
  array types and lengths, token ids below the vocabulary); one that fails (truncated, damaged, foreign, tampered) is
  rebuilt.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import logging
import os
import secrets
import stat
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kubetron.contract.errors import ConfigError

log = logging.getLogger("kubetron")

CACHE_VERSION = 2
CACHE_SUBDIR = "sft_cache"
KEY_NAME = "sft_cache.key"  # in the job's store, beside sft_cache/
SUFFIX = ".sftcache"
MAGIC = b"KBTSFT2\n"
LOCAL_CACHE = os.path.join(tempfile.gettempdir(), "kubetron-sft-cache")
HASH_CHUNK = 1 << 20
WAIT_LOG_EVERY_S = 30.0
POLL_S = 0.5
ARRAYS = {"tokens": np.int32, "flags": np.uint8, "offsets": np.int64, "groups": np.int64,
          "group_offsets": np.int64, "meta": np.uint8}


def cache_key(files: list, tokenizer, settings: dict) -> str:
    """The hex key of one dataset: what it is built from (the files' bytes), never when or where."""
    assets = tokenizer.assets()
    digest = {name: hashlib.sha256(assets[name]).hexdigest() for name in sorted(assets)}
    what = {"version": CACHE_VERSION, "files": [[f.url, content_digest(f)] for f in files],
            "tokenizer": tokenizer.tokenizer_type, "vocab_size": int(tokenizer.vocab_size),
            "tokenizer_files": digest, "settings": settings}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:40]


def content_digest(f) -> str:
    """SHA-256 of a data file's bytes as stored, streamed (a local file in chunks; an S3 object as one GET)."""
    h = hashlib.sha256()
    with f.open() as raw:
        while chunk := raw.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


@dataclass(frozen=True)
class CachePlace:
    """Where a job's caches live, whether every rank of the job sees them, and where the job's key is."""

    location: str
    shared: bool
    key_store: str | None  # a store URL holding KEY_NAME; None: the machine-local key (LOCAL_CACHE)


def cache_location(cache_dir: str | None, save: str | None) -> CachePlace:
    """Where the caches live (see the module docstring)."""
    key_store = save.rstrip("/") if save else None
    if cache_dir:
        return CachePlace(cache_dir, True, key_store)
    if save:
        return CachePlace(f"{save.rstrip('/')}/{CACHE_SUBDIR}", True, key_store)
    return CachePlace(LOCAL_CACHE, False, None)


def is_builder(shared: bool, env=os.environ) -> bool:
    return int(env.get("RANK" if shared else "LOCAL_RANK", "0") or 0) == 0


def to_bytes(arrays: dict[str, np.ndarray], key: str, meta: dict, job_key: bytes) -> bytes:
    buf = io.BytesIO()
    blob = np.frombuffer(json.dumps({**meta, "key": key, "version": CACHE_VERSION}).encode(), dtype=np.uint8)
    np.savez(buf, **{k: np.asarray(v, dtype=ARRAYS[k]) for k, v in arrays.items()},  # type: ignore[arg-type]
             meta=blob)  # (numpy's stubs: **arrays could name allow_pickle)
    body = buf.getvalue()
    return MAGIC + hmac.new(job_key, body, hashlib.sha256).digest() + body


def from_bytes(data: bytes, key: str, vocab_size: int, job_key: bytes) -> tuple[dict[str, np.ndarray], dict]:
    """The arrays and meta of a cache file; ValueError saying why it cannot be used."""
    head = len(MAGIC) + 32
    if not data.startswith(MAGIC) or len(data) < head:
        raise ValueError("not a kubetron cache of this version")
    if not hmac.compare_digest(data[len(MAGIC):head], hmac.new(job_key, data[head:], hashlib.sha256).digest()):
        raise ValueError("not written by this job (its signature does not match the job's key): another job's, "
                         "or changed since")
    try:
        with np.load(io.BytesIO(data[head:]), allow_pickle=False) as z:
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


def load_or_build(place: CachePlace, key: str, vocab_size: int,
                  build: Callable[[], tuple[dict[str, np.ndarray], dict]], what: str):
    """(arrays, meta, how) of the dataset `key`: loaded from `place`, or built (and stored by the builder)."""
    from kubetron.storage import open_store

    store, name = open_store(place.location), f"{key}{SUFFIX}"
    builder = is_builder(place.shared)
    if not builder:
        _wait_for(store, name, what)
    job_key = None  # made only when there is a cache to check or to sign: a run refused first leaves no key behind
    if store.exists(name):
        job_key = job_secret(place.key_store, builder, what)
        try:
            arrays, meta = from_bytes(store.read_bytes(name), key, vocab_size, job_key)
            return arrays, meta, f"loaded from {store.url}/{name}"
        except ValueError as e:
            log.warning("%s: the cached %s/%s is %s; rebuilding it", what, store.url, name, e)
    arrays, meta = build()
    if not builder:
        return arrays, meta, "built here (the stored copy could not be used)"
    store.write_bytes(name, to_bytes(arrays, key, meta, job_key or job_secret(place.key_store, builder, what)))
    return arrays, meta, f"stored in {store.url}/{name}"


def job_secret(key_store: str | None, builder: bool, what: str) -> bytes:
    """This job's cache key: read from its store (the builder writes it first when there is none)."""
    if key_store is None:
        return _local_secret()
    from kubetron.storage import open_store

    store = open_store(key_store)
    if builder and not store.exists(KEY_NAME):
        store.write_bytes(KEY_NAME, secrets.token_bytes(32))
    _wait_for(store, KEY_NAME, what)
    secret = store.read_bytes(KEY_NAME, limit=64)
    if len(secret) < 32:
        raise ConfigError("checkpoint.save", f"{store.url}/{KEY_NAME}: not a key ({len(secret)} bytes); delete it")
    return secret


def _local_secret() -> bytes:
    """The machine-local key, in LOCAL_CACHE when that is a directory only this user can write (else a key for
    this process: its caches are rebuilt by the next one)."""
    try:
        os.makedirs(LOCAL_CACHE, mode=0o700, exist_ok=True)
        st = os.stat(LOCAL_CACHE, follow_symlinks=False)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
            raise PermissionError(f"{LOCAL_CACHE} is not this user's own directory")
        path = os.path.join(LOCAL_CACHE, "key")
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(secrets.token_bytes(32))
        except FileExistsError:
            pass
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as f:
            if os.fstat(f.fileno()).st_uid != os.getuid():
                raise PermissionError(f"{path} is not this user's")
            secret = f.read(64)
        if len(secret) >= 32:
            return secret
    except OSError as e:
        log.warning("the machine-local SFT cache key is unusable (%s); caches made now are rebuilt next time", e)
    return _PROCESS_SECRET


_PROCESS_SECRET = secrets.token_bytes(32)


def _wait_for(store, name: str, what: str) -> None:
    """Until rank 0 has stored the dataset (if rank 0 fails, torchrun ends this process with it)."""
    t0 = last = time.monotonic()
    while not store.exists(name):
        if time.monotonic() - last >= WAIT_LOG_EVERY_S:
            last = time.monotonic()
            log.info("%s: waiting for rank 0 to store %s/%s (%.0fs)", what, store.url, name, last - t0)
        time.sleep(POLL_S)
