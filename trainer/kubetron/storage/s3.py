"""S3 store: streaming parallel multipart uploads, ranged parallel downloads, retries, commit markers.

Nothing is staged on local disk: `open_write` buffers at most `part_size * (concurrency + 2)` bytes in
memory and uploads full parts from a thread pool while the caller (e.g. `torch.save`) keeps writing.

Retries happen at two levels: botocore's own (`retries={"max_attempts", "mode"}`: 5xx, SlowDown,
throttling, connection resets, timeouts, with jittered exponential backoff), then outer attempts of ours
for whatever still fails transiently - e.g. when botocore's retry quota is spent or a GET body is cut
mid-stream: at least `outer_attempts`, and on for `outage_seconds` since the first, so that a store away
for tens of seconds (a restart, a failover) is waited out rather than failing the run (botocore's own
give up after 5-20 s, and at once once its retry quota is spent). When all fail, a CheckpointError names
the object.

Endpoint, credentials and region come from the standard AWS environment (AWS_ENDPOINT_URL[_S3],
AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_REGION / AWS_DEFAULT_REGION, profiles)
unless given as arguments. Secrets are never logged or put into error messages.
"""

from __future__ import annotations

import builtins
import logging
import os
import random
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, BinaryIO, TypeVar

import boto3
import botocore.exceptions as bce
import urllib3.exceptions
from botocore.config import Config

from kubetron.contract.errors import CheckpointError
from kubetron.storage.base import (
    MARKER,
    PENDING_NAME,
    TXN_ID_RE,
    DirTxn,
    MemoryReader,
    Store,
    check_key,
    default_primary,
    is_internal_name,
    join_key,
    too_large,
)

log = logging.getLogger(__name__)
T = TypeVar("T")
MiB = 1 << 20
_MIN_PART = 5 * MiB  # S3's minimum size of every part but the last

_RETRYABLE_CODES = {
    "SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestTimeTooSkewed",
    "InternalError", "ServiceUnavailable", "RequestLimitExceeded", "BadDigest", "IncompleteBody",
    "XAmzContentSHA256Mismatch",
}  # fmt: skip
_RETRYABLE_EXC = (
    bce.ConnectionError,  # EndpointConnectionError, ConnectTimeoutError, ...
    bce.HTTPClientError,  # ConnectionClosedError, ReadTimeoutError, ResponseStreamingError
    bce.IncompleteReadError,
    bce.ChecksumError,
    bce.FlexibleChecksumError,  # a response body that does not match its checksum
    urllib3.exceptions.HTTPError,
    ConnectionError,
    TimeoutError,
)


def _env_int(name: str, default: int) -> int:
    v = os.environ.get(name)
    return int(v) if v not in (None, "") else default


@dataclass
class S3Options:
    """Tuning knobs; each also reads a KUBETRON_S3_* environment variable (see `from_env`)."""

    part_size: int = 32 * MiB  # multipart part size and ranged-GET chunk size
    concurrency: int = 8  # parallel part uploads / ranged GETs per store
    max_attempts: int = 8  # botocore's total attempts per request
    retry_mode: str = "standard"  # botocore: "standard" or "adaptive" (client-side rate limiting)
    outer_attempts: int = 2  # our attempts around botocore's, for what is still transient after them
    outage_seconds: float = 90.0  # ... and ours go on this long since the first (a store away that long)
    connect_timeout: float = 10.0
    read_timeout: float = 120.0
    addressing_style: str | None = None  # None: "path" for a custom endpoint, else botocore's default
    # SigV4 SHA-256 of every body. None: botocore's default (signed on http://, skipped on https:// when
    # a checksum header protects the body). False saves CPU on in-cluster http:// endpoints; bodies
    # then still carry a CRC32 checksum header (botocore's default request_checksum_calculation).
    payload_signing: bool | None = None
    extra_config: dict[str, Any] = field(default_factory=dict)  # more botocore Config(...) arguments

    @classmethod
    def from_env(cls) -> S3Options:
        o = cls()
        o.part_size = _env_int("KUBETRON_S3_PART_SIZE_MB", o.part_size // MiB) * MiB
        o.concurrency = _env_int("KUBETRON_S3_CONCURRENCY", o.concurrency)
        o.max_attempts = _env_int("KUBETRON_S3_MAX_ATTEMPTS", o.max_attempts)
        o.outer_attempts = _env_int("KUBETRON_S3_OUTER_ATTEMPTS", o.outer_attempts)
        o.outage_seconds = float(os.environ.get("KUBETRON_S3_OUTAGE_SECONDS") or o.outage_seconds)
        o.read_timeout = float(os.environ.get("KUBETRON_S3_READ_TIMEOUT") or o.read_timeout)
        o.connect_timeout = float(os.environ.get("KUBETRON_S3_CONNECT_TIMEOUT") or o.connect_timeout)
        o.retry_mode = os.environ.get("KUBETRON_S3_RETRY_MODE") or o.retry_mode
        o.addressing_style = os.environ.get("KUBETRON_S3_ADDRESSING_STYLE") or None
        sign = os.environ.get("KUBETRON_S3_PAYLOAD_SIGNING", "").lower()
        o.payload_signing = {"1": True, "true": True, "0": False, "false": False}.get(sign)
        return o

    def validate(self) -> None:
        if self.part_size < _MIN_PART:
            raise ValueError(f"S3 part_size must be >= 5 MiB, got {self.part_size}")
        if self.concurrency < 1 or self.max_attempts < 1 or self.outer_attempts < 1:
            raise ValueError("S3 concurrency, max_attempts and outer_attempts must be >= 1")
        if not 0 <= self.outage_seconds < float("inf"):
            raise ValueError(f"S3 outage_seconds must be >= 0, got {self.outage_seconds}")
        if self.retry_mode not in ("standard", "adaptive", "legacy"):
            raise ValueError(f"S3 retry_mode must be standard/adaptive/legacy, got {self.retry_mode!r}")


def parse_s3_url(url: str) -> tuple[str, str]:
    if not url.startswith("s3://"):
        raise ValueError(f"not an s3:// URL: {url!r}")
    bucket, _, prefix = url[5:].partition("/")
    if not bucket:
        raise ValueError(f"no bucket in {url!r}")
    return bucket, check_key(prefix, allow_empty=True)


def _code(e: bce.ClientError) -> str:
    return str(e.response.get("Error", {}).get("Code", ""))


def _status(e: bce.ClientError) -> int:
    return int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)


def _not_found(e: bce.ClientError) -> bool:
    return _code(e) in ("NoSuchKey", "404", "NotFound") or _status(e) == 404 and _code(e) != "NoSuchBucket"


def _transient(e: BaseException) -> bool:
    if isinstance(e, bce.ClientError):
        return _code(e) in _RETRYABLE_CODES or _status(e) >= 500
    return isinstance(e, _RETRYABLE_EXC)


class S3Store(Store):
    is_remote = True

    def __init__(
        self,
        url: str,
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        access_key: str | None = None,
        secret_key: str | None = None,
        options: S3Options | None = None,
    ):
        self.bucket, self.prefix = parse_s3_url(url)
        self.url = f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"
        o = options or S3Options.from_env()
        o.validate()
        self.options = o
        env = os.environ
        self.endpoint_url = endpoint_url or env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or None
        self.region = region or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or None
        if self.region is None and self.endpoint_url:
            self.region = "us-east-1"  # any region signs for S3-compatible servers
        style = o.addressing_style or ("path" if self.endpoint_url else None)
        extra = dict(o.extra_config)
        s3cfg = dict(extra.pop("s3", None) or {})
        if style:
            s3cfg.setdefault("addressing_style", style)
        if o.payload_signing is not None:
            s3cfg.setdefault("payload_signing_enabled", o.payload_signing)
        cfg = Config(
            retries={"max_attempts": o.max_attempts, "mode": o.retry_mode},
            max_pool_connections=2 * o.concurrency + 4,
            connect_timeout=o.connect_timeout,
            read_timeout=o.read_timeout,
            tcp_keepalive=True,
            s3=s3cfg or None,
            **extra,
        )
        # explicit keys win; otherwise botocore's chain: AWS_ACCESS_KEY_ID/..., profiles, IRSA, IMDS
        session = boto3.session.Session(aws_access_key_id=access_key, aws_secret_access_key=secret_key)
        self.client = session.client("s3", endpoint_url=self.endpoint_url, region_name=self.region, config=cfg)
        self._pool = ThreadPoolExecutor(o.concurrency, thread_name_prefix="kubetron-s3")
        log.debug("S3 store %s (endpoint %s, region %s)", self.url, self.endpoint_url or "AWS", self.region)

    # -- plumbing --------------------------------------------------------------------------------------
    def _k(self, key: str) -> str:
        return join_key(self.prefix, key)

    def _what(self, key: str) -> str:
        return f"s3://{self.bucket}/{self._k(key)}"

    def _call(self, what: str, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        """fn(*args, **kw) with outer retries (at least `outer_attempts`, and for `outage_seconds` since the
        first); 404 -> FileNotFoundError, failures -> CheckpointError."""
        n, until = self.options.outer_attempts, time.monotonic() + self.options.outage_seconds
        attempt = 0
        while True:
            attempt += 1
            last = attempt >= n and time.monotonic() >= until
            try:
                return fn(*args, **kw)
            except (FileNotFoundError, CheckpointError, _ObjectChanged):
                raise
            except bce.ClientError as e:
                if _not_found(e):
                    raise FileNotFoundError(what) from e
                if not _transient(e) or last:
                    raise CheckpointError(f"{what}: {_code(e) or _status(e)}: {e}") from e
                err: BaseException = e
            except (bce.NoCredentialsError, bce.PartialCredentialsError) as e:
                raise CheckpointError(f"{what}: no usable S3 credentials ({type(e).__name__})") from e
            except Exception as e:
                if not _transient(e) or last:
                    raise CheckpointError(f"{what}: {type(e).__name__}: {e}") from e
                err = e
            delay = random.uniform(0.5, 1.0) * min(8.0, 0.5 * 2 ** (attempt - 1))
            if attempt >= n:  # the outage's wait: never past its end by more than a step
                delay = max(0.0, min(delay, until - time.monotonic()))
            log.warning("%s: %s, retrying in %.1fs (attempt %d)", what, type(err).__name__, delay, attempt)
            time.sleep(delay)

    def _put(self, key: str, data: bytes | bytearray) -> None:
        k = self._k(key)
        self._call(self._what(key), self.client.put_object, Bucket=self.bucket, Key=k, Body=data)

    def _delete_keys(self, full_keys: list[str], what: str) -> None:
        for i in range(0, len(full_keys), 1000):
            batch = [{"Key": k} for k in full_keys[i : i + 1000]]
            r = self._call(
                what, self.client.delete_objects, Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True}
            )
            errs = r.get("Errors") or []
            if errs:
                raise CheckpointError(f"{what}: could not delete {len(errs)} objects, e.g. {errs[0]}")

    def _keys_under(self, full_prefix: str) -> builtins.list[str]:
        """Every object's full key under `full_prefix` (all pages)."""
        return [o["Key"] for page in self._list_raw(full_prefix) for o in page.get("Contents", [])]

    def _list_raw(self, full_prefix: str, delimiter: str | None = None) -> Iterator[dict]:
        """Pages of list_objects_v2, each page fetched with retries."""
        kw: dict[str, Any] = {"Bucket": self.bucket, "Prefix": full_prefix}
        if delimiter:
            kw["Delimiter"] = delimiter
        what = f"listing s3://{self.bucket}/{full_prefix}"
        while True:
            page = self._call(what, self.client.list_objects_v2, **kw)
            yield page
            if not page.get("IsTruncated"):
                return
            kw["ContinuationToken"] = page["NextContinuationToken"]

    def _dir_prefix(self, prefix: str) -> str:
        """The full S3 prefix (ending in '/', or '' for the bucket root) of a store directory."""
        full = self._k(check_key(prefix, allow_empty=True))
        return f"{full}/" if full else ""

    # -- objects ---------------------------------------------------------------------------------------
    @contextmanager
    def open_write(self, key: str) -> Iterator[BinaryIO]:
        w = _S3Writer(self, check_key(key))
        try:
            yield w  # type: ignore[misc]
            w.finish()
        except BaseException:
            w.abort()
            raise

    def write_bytes(self, key: str, data: bytes) -> None:
        k = check_key(key)
        if len(data) <= self.options.part_size:
            self._put(k, data)
        else:
            super().write_bytes(k, data)

    def replace_tracker(self, key: str, data: bytes) -> None:
        self._put(check_key(key), data)  # a single PUT replaces an object atomically

    def _download(self, key: str, limit: int | None = None) -> bytes | bytearray:
        k = check_key(key)
        what = self._what(k)
        ps = self.options.part_size
        for _ in range(3):  # the object may be replaced while we read it (If-Match fails): start over

            def first() -> tuple[bytes, int, str | None]:
                try:
                    r = self.client.get_object(Bucket=self.bucket, Key=self._k(k), Range=f"bytes=0-{ps - 1}")
                except bce.ClientError as e:
                    if _code(e) != "InvalidRange" and _status(e) != 416:
                        raise
                    r = self.client.get_object(Bucket=self.bucket, Key=self._k(k))  # an empty object
                body = r["Body"].read()
                cr = r.get("ContentRange")  # "bytes 0-99/1234"
                total = int(cr.rsplit("/", 1)[1]) if cr else len(body)
                if len(body) != min(total, ps):
                    raise bce.IncompleteReadError(actual_bytes=len(body), expected_bytes=min(total, ps))
                return body, total, r.get("ETag")

            head, total, etag = self._call(what, first)
            if limit is not None and max(total, len(head)) > limit:  # before a buffer of that size exists
                raise too_large(what, max(total, len(head)), limit)
            if total <= len(head):
                return head
            buf = bytearray(total)
            mv = memoryview(buf)
            mv[: len(head)] = head
            ranges = [(lo, min(lo + ps, total)) for lo in range(len(head), total, ps)]
            futs = [self._pool.submit(self._get_range, k, etag, lo, hi, mv[lo:hi]) for lo, hi in ranges]
            try:
                for f in futs:
                    f.result()
            except _ObjectChanged:
                for f in futs:
                    f.cancel()
                continue
            finally:
                for f in futs:  # never return while a worker still writes into buf
                    if not f.cancelled():
                        f.exception()
            return buf
        raise CheckpointError(f"{what}: the object kept changing while being read")

    def _get_range(self, k: str, etag: str | None, start: int, end: int, out: memoryview) -> None:
        def once() -> None:
            kw = {"IfMatch": etag} if etag else {}
            try:
                r = self.client.get_object(Bucket=self.bucket, Key=self._k(k), Range=f"bytes={start}-{end - 1}", **kw)
            except bce.ClientError as e:
                if _code(e) == "PreconditionFailed" or _status(e) == 412:
                    raise _ObjectChanged() from e
                raise
            body = r["Body"]
            got = 0
            while got < len(out):
                n = body.readinto(out[got:])
                if not n:
                    raise bce.IncompleteReadError(actual_bytes=got, expected_bytes=len(out))
                got += n

        self._call(f"{self._what(k)} bytes {start}-{end - 1}", once)

    def read_range(self, key: str, start: int, length: int) -> bytes:
        """Ranged GETs of at most part_size each, in parallel; only these bytes cross the network. The range
        is checked against the object's size (one HEAD) before a buffer for it exists: a caller's range may
        come from a checkpoint's own index, which is hostile input."""
        k = check_key(key)
        head = self._call(self._what(k), self.client.head_object, Bucket=self.bucket, Key=self._k(k))
        size = int(head.get("ContentLength", 0))
        if start < 0 or length < 0 or start + length > size:
            raise CheckpointError(f"{self._what(k)}: expected {length} bytes at offset {start}, the object "
                                  f"holds {size}")
        buf = bytearray(length)
        mv = memoryview(buf)
        ps = self.options.part_size
        etag = head.get("ETag")  # the object checked above, or the read fails (never a mix of two)
        futs = [self._pool.submit(self._get_range, k, etag, start + lo, start + min(lo + ps, length),
                                  mv[lo:min(lo + ps, length)]) for lo in range(0, length, ps)]
        errors = [e for e in (f.exception() for f in futs) if e is not None]  # every part done first
        if any(isinstance(e, _ObjectChanged) for e in errors):
            raise CheckpointError(f"{self._what(k)}: the object changed while being read")
        if errors:
            raise errors[0]
        return bytes(buf)

    def read_bytes(self, key: str, limit: int | None = None) -> bytes:
        data = self._download(key, limit)
        return data if isinstance(data, bytes) else bytes(data)

    def open_read(self, key: str) -> BinaryIO:
        return MemoryReader(self._download(key))  # type: ignore[return-value]

    def exists(self, key: str) -> bool:
        k = check_key(key)
        try:
            self._call(self._what(k), self.client.head_object, Bucket=self.bucket, Key=self._k(k))
            return True
        except FileNotFoundError:
            return False

    def stat(self, key: str) -> tuple[int, str]:
        """(size in bytes, ETag) of an object: what identifies its content without reading it."""
        k = check_key(key)
        r = self._call(self._what(k), self.client.head_object, Bucket=self.bucket, Key=self._k(k))
        return int(r["ContentLength"]), str(r.get("ETag", ""))

    def list(self, prefix: str = "") -> list[str]:
        full = self._dir_prefix(prefix)
        root = f"{self.prefix}/" if self.prefix else ""
        out = []
        for page in self._list_raw(full):
            for obj in page.get("Contents", []):
                rel = obj["Key"][len(root) :]
                if rel and not any(is_internal_name(p) for p in rel.split("/")):
                    out.append(rel)
        return sorted(out)

    def list_dirs(self, prefix: str = "") -> builtins.list[str]:
        full = self._dir_prefix(prefix)
        out = set()
        for page in self._list_raw(full, delimiter="/"):
            for cp in page.get("CommonPrefixes", []):
                name = cp["Prefix"][len(full) :].rstrip("/")
                if name and not is_internal_name(name):
                    out.add(name)
        return sorted(out)

    def delete_prefix(self, prefix: str) -> None:
        k = check_key(prefix)  # never the whole store
        what = f"deleting {self._what(k)}"
        # the marker first: a delete interrupted halfway never leaves a "committed" directory behind
        self._delete_keys([self._k(join_key(k, MARKER))], what)
        base = self._k(k) + "/"
        keys = self._keys_under(base)
        if self.exists(k):
            keys.append(self._k(k))
        self._delete_keys(keys, what)
        # Servers with real directories (SeaweedFS) keep listing emptied ones: delete those too, deepest
        # first. On AWS these keys do not exist (or are empty "folder" objects) and the delete is a no-op.
        dirs = {base}
        for key in keys:
            parts = key[len(base) :].split("/")[:-1]
            dirs.update(base + "/".join(parts[:i]) + "/" for i in range(1, len(parts) + 1))
        self._delete_keys(sorted(dirs, key=lambda d: (-d.count("/"), d)), what)

    def append_line(self, key: str, line: str) -> None:
        k = check_key(key)
        if not line.endswith("\n"):
            line += "\n"
        try:
            old = self._download(k)
        except FileNotFoundError:
            old = b""
        self._put(k, bytes(old) + line.encode("utf-8"))  # read-modify-write: single writer (rank 0)

    # -- checkpoint directories -------------------------------------------------------------------------
    def begin_dir(self, name: str, *, txn_id: str | None = None, primary: bool | None = None) -> DirTxn:
        shared = txn_id is not None  # other ranks may already be writing into it: their files stay (sweep)
        return _S3DirTxn(self, check_key(name), txn_id or uuid.uuid4().hex, default_primary(primary), shared)

    def cleanup_partial(self, *, min_age_s: float = 0.0) -> builtins.list[str]:
        root = f"{self.prefix}/" if self.prefix else ""
        now = datetime.now(UTC)
        pending: dict[str, datetime] = {}
        markers: set[str] = set()
        for page in self._list_raw(root):
            for obj in page.get("Contents", []):
                d, _, base = obj["Key"][len(root) :].rpartition("/")
                if base == PENDING_NAME:
                    pending[d] = obj["LastModified"]
                elif base == MARKER:
                    markers.add(d)
        done: builtins.list[str] = []
        for d, mtime in sorted(pending.items()):
            if (now - mtime).total_seconds() < min_age_s:
                continue
            if d in markers:  # committed; only the pending flag was left (killed right after the marker)
                self._delete_keys([self._k(join_key(d, PENDING_NAME))], f"cleaning {self._what(d)}")
            else:
                self.delete_prefix(d)
                done.append(d)
        done += self._abort_dangling_uploads(root, now, min_age_s)
        return done

    def _abort_dangling_uploads(self, root: str, now: datetime, min_age_s: float) -> builtins.list[str]:
        done: builtins.list[str] = []
        try:
            r = self.client.list_multipart_uploads(Bucket=self.bucket, Prefix=root)
        except (bce.ClientError, bce.BotoCoreError) as e:  # not every S3-compatible server lists them
            log.info("cannot list multipart uploads in s3://%s/%s: %s", self.bucket, root, e)
            return done
        for u in r.get("Uploads", []):
            if (now - u["Initiated"]).total_seconds() < min_age_s:
                continue
            try:
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=u["Key"], UploadId=u["UploadId"])
                done.append(f"multipart upload of {u['Key'][len(root) :]}")
            except (bce.ClientError, bce.BotoCoreError):
                pass
        return done

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class _ObjectChanged(Exception):
    pass


class _S3Writer:
    """The stream `open_write` yields: fills parts in memory and uploads them in the store's pool."""

    def __init__(self, store: S3Store, key: str):
        self.store, self.key = store, key
        self.full_key = store._k(key)
        self.what = store._what(key)
        self.part_size = store.options.part_size
        self._buf = bytearray()
        self._pos = 0
        self._upload_id: str | None = None
        self._parts: list[tuple[int, Future]] = []
        self._slots = threading.BoundedSemaphore(store.options.concurrency + 2)
        self._error: BaseException | None = None
        self.closed = False

    # the file-object surface torch.save and friends use
    def writable(self) -> bool:
        return True

    def readable(self) -> bool:
        return False

    def seekable(self) -> bool:
        return False

    def tell(self) -> int:
        return self._pos

    def flush(self) -> None:
        self._check()

    def write(self, b) -> int:
        if self.closed:
            raise ValueError(f"{self.what}: write to a finished upload")
        self._check()
        mv = memoryview(b).cast("B")
        n, off, ps = len(mv), 0, self.part_size
        while off < n:
            if not self._buf and n - off >= ps:  # a whole part straight from the caller's buffer
                self._submit(bytes(mv[off : off + ps]))
                off += ps
                continue
            take = min(ps - len(self._buf), n - off)
            self._buf += mv[off : off + take]
            off += take
            if len(self._buf) >= ps:
                part, self._buf = self._buf, bytearray()
                self._submit(part)
        self._pos += n
        return n

    def _check(self) -> None:
        if self._error is not None:
            raise CheckpointError(f"{self.what}: upload failed: {self._error}") from self._error

    def _submit(self, data: bytes | bytearray) -> None:
        st = self.store
        if self._upload_id is None:
            r = st._call(
                f"{self.what}: create multipart upload",
                st.client.create_multipart_upload, Bucket=st.bucket, Key=self.full_key,
            )  # fmt: skip
            self._upload_id = r["UploadId"]
        while not self._slots.acquire(timeout=0.5):  # bound the memory in flight
            self._check()
        self._check()
        num = len(self._parts) + 1
        try:
            fut = st._pool.submit(self._upload_part, num, data)
        except BaseException:
            self._slots.release()
            raise
        fut.add_done_callback(self._part_done)
        self._parts.append((num, fut))

    def _part_done(self, fut: Future) -> None:
        self._slots.release()
        if not fut.cancelled() and fut.exception() is not None and self._error is None:
            self._error = fut.exception()

    def _upload_part(self, num: int, data: bytes | bytearray) -> str:
        st = self.store
        r = st._call(
            f"{self.what} part {num}", st.client.upload_part,
            Bucket=st.bucket, Key=self.full_key, UploadId=self._upload_id, PartNumber=num, Body=data,
        )  # fmt: skip
        return r["ETag"]

    def finish(self) -> None:
        st = self.store
        self.closed = True
        if self._upload_id is None:
            st._put(self.key, self._buf)
            self._buf = bytearray()
            return
        if self._buf:
            part, self._buf = self._buf, bytearray()
            self._submit(part)
        parts = [{"PartNumber": num, "ETag": fut.result()} for num, fut in self._parts]
        self._check()
        try:
            st._call(
                f"{self.what}: complete multipart upload", st.client.complete_multipart_upload,
                Bucket=st.bucket, Key=self.full_key, UploadId=self._upload_id,
                MultipartUpload={"Parts": parts},
            )  # fmt: skip
        except CheckpointError as e:
            # a retried Complete whose first attempt did succeed (its response lost) sees NoSuchUpload
            if not (isinstance(e.__cause__, bce.ClientError) and _code(e.__cause__) == "NoSuchUpload"):
                raise
            if not self._landed(len(parts)):
                raise
        self._upload_id = None

    def _landed(self, nparts: int) -> bool:
        st = self.store
        try:
            h = st._call(self.what, st.client.head_object, Bucket=st.bucket, Key=self.full_key)
        except (FileNotFoundError, CheckpointError):
            return False
        etag = str(h.get("ETag", "")).strip('"')
        return h.get("ContentLength") == self._pos and (etag.endswith(f"-{nparts}") or "-" not in etag)

    def abort(self) -> None:
        self.closed = True
        self._buf = bytearray()
        for _, fut in self._parts:
            fut.cancel()
        for _, fut in self._parts:
            if not fut.cancelled():
                fut.exception()  # wait: no part may land after the abort
        if self._upload_id is not None:
            st = self.store
            try:
                st.client.abort_multipart_upload(Bucket=st.bucket, Key=self.full_key, UploadId=self._upload_id)
            except (bce.ClientError, bce.BotoCoreError) as e:  # cleanup_partial retries it later
                log.warning("%s: aborting the multipart upload failed: %s", self.what, e)
            self._upload_id = None


class _S3DirTxn(DirTxn):
    def __init__(self, store: S3Store, name: str, txn_id: str, primary: bool, shared: bool):
        if not TXN_ID_RE.match(txn_id):
            raise ValueError(f"txn_id must match {TXN_ID_RE.pattern}, got {txn_id!r}")
        self.store, self.name, self.txn_id, self.primary = store, name, txn_id, primary
        self._open = 0
        self._failed: list[str] = []
        self.written: list[str] = []
        self._done = False
        if primary:
            # An old copy of `name` stops counting first (marker gone): nothing reads the directory again until the
            # new marker. With a shared txn_id, the other ranks may be writing their files of this save already,
            # so what is left of an older copy (or of a killed attempt) goes only once they are done (sweep, before
            # the commit): a deletion here could remove a rank's fresh file of the same key, listed as old just
            # before that rank rewrote it (the chaos soak lost a shard so, then every resume failed on it). A
            # single writer's (no txn_id) old objects go at once.
            what = f"preparing {self._what()}"
            store._call(what, store.client.delete_object, Bucket=store.bucket, Key=store._k(join_key(name, MARKER)))
            if not shared:
                store._delete_keys(store._keys_under(store._k(name) + "/"), what)
            store._put(join_key(name, PENDING_NAME), txn_id.encode())

    def sweep(self, keep: Collection[str]) -> list[str]:
        base = self.store._k(self.name) + "/"
        kept = {base + check_key(k) for k in keep} | {base + PENDING_NAME, base + MARKER}
        stale = [k for k in self.store._keys_under(base) if k not in kept]
        self.store._delete_keys(stale, f"cleaning {self._what()}")
        return [k[len(base):] for k in stale]

    def _what(self, relkey: str = "") -> str:
        return self.store._what(join_key(self.name, relkey))

    @contextmanager
    def _open_object(self, rk: str) -> Iterator[BinaryIO]:
        with self.store.open_write(join_key(self.name, rk)) as f:
            yield f

    def _commit(self, marker: bytes) -> None:
        self.store._put(join_key(self.name, MARKER), marker)
        self._done = True
        try:
            self.store._delete_keys([self.store._k(join_key(self.name, PENDING_NAME))], self._what())
        except CheckpointError as e:  # harmless leftover: cleanup_partial removes it
            log.warning("%s", e)

    def abort(self) -> None:
        self._done = True
        if self.primary:
            self.store.delete_prefix(self.name)
