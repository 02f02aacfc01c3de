"""One storage layer for checkpoints: a local/PVC directory or `s3://bucket/prefix`, same layout on both.

    store = open_store("runs/x")            # or "s3://bucket/prefix" (AWS_* environment or arguments)
    with store.open_write("iter_0000020/model_rank0.pt") as f:   # appears atomically on clean exit
        torch.save(state, f)
    torch.load(store.open_read("iter_0000020/model_rank0.pt"), weights_only=True)

Checkpoint directories are transactions (`begin_dir` ... `commit(marker)`), see `kubetron.storage.base`.
Async saves: `kubetron.storage.background.AsyncSaver`. Memory snapshots' files in a pod's memory volume:
`kubetron.storage.snapshot_files`. Importing this package pulls in neither torch
nor boto3 (boto3 only when an s3:// store is opened).
"""

from __future__ import annotations

import os

from kubetron.storage.background import AsyncSaver
from kubetron.storage.base import MARKER, DirTxn, Store
from kubetron.storage.local import LocalStore

__all__ = ["MARKER", "AsyncSaver", "DirTxn", "LocalStore", "Store", "is_s3_url", "open_store"]


def is_s3_url(url: str | os.PathLike) -> bool:
    return isinstance(url, str) and url.startswith("s3://")


def open_store(
    url: str | os.PathLike,
    *,
    endpoint_url: str | None = None,
    region: str | None = None,
    access_key: str | None = None,
    secret_key: str | None = None,
    s3_options=None,
) -> Store:
    """A Store for a local path (relative or absolute; `file://` accepted) or `s3://bucket/prefix`.

    For S3, endpoint/credentials/region come from the standard AWS environment (and botocore's other
    credential sources) unless given as arguments; `s3_options` (an `S3Options`) overrides the
    KUBETRON_S3_* tuning variables.
    """
    if isinstance(url, Store):
        return url
    s = os.fspath(url)
    if s.startswith("s3://"):
        from kubetron.storage.s3 import S3Store

        return S3Store(
            s,
            endpoint_url=endpoint_url,
            region=region,
            access_key=access_key,
            secret_key=secret_key,
            options=s3_options,
        )
    if s.startswith("file://"):
        s = s[len("file://") :]
    elif "://" in s:
        raise ValueError(f"unsupported store URL {s!r}: use a path or s3://bucket/prefix")
    if not s:
        raise ValueError("empty store path")
    return LocalStore(s)
