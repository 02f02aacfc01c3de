"""Reading a job's progress log (`<store>/progress.txt`) from the operator: only its tail, within bounds.

S3 stores. The request is signed only with the job's own Secret (`storage.s3.secretRef`): botocore's
default credential chain (the operator's environment, instance metadata, IRSA) is never consulted for
it, so a tenant's endpoint never sees a request signed with the operator's identity. A Secret without
both keys is a reason in the job's status naming the Secret and the key, never a fallback. A job with no
secretRef (its pods get credentials from their ServiceAccount: IRSA, workload identity) is not read at
all, unless the admin lists its bucket in `--s3-operator-buckets` (the chart's `operatorS3Buckets`):
then the operator reads it with its own identity, at its own endpoint only (the job's endpoint must be
empty or the same), since a signed request goes to whoever serves that endpoint.

The read itself (http_get): one presigned GET with `Range: bytes=-TAIL_BYTES`, a total deadline
(READ_DEADLINE), no redirects, at most TAIL_BYTES of body. A store that is slow, answers with more than
asked, or refuses gives the job a reason (ProgressRead.unread), and the caller reads again later.

What a tail gives: the operator uses the summary's lastCheckpoint, trainIters, iteration, jobIterations and
inPlaceRestarts of the current attempt, and completed (the last Exiting job after the last Starting job):
all of them come from the newest lines, which a 256 KiB tail (about 1,000 lines, far more than any
attempt writes between two reads) holds. What needs the whole history (`jobs`, `startTime`) is not read by
the operator; `kubetron progress STORE` reads the whole log. Lines whose numbers do not fit int64 are
dropped (ProgressRead.warnings says so), the rest still count.

PVC stores: no direct access from the operator; decide() uses rank 0's status endpoint and the ranks'
termination messages (a new attempt's rank 0 reports the checkpoint it resumed from).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from kubetron.contract.progress import (
    IN_PLACE_RESTARTS_KEY,
    PROGRESS_FILE,
    ProgressEvent,
    ProgressSummary,
    as_int,
    parse_progress,
    summarize_events,
)

from kubetron_operator.api_calls import ApiError, Kube
from kubetron_operator.model import S3_SECRET_KEYS, Job, S3Storage
from kubetron_operator.trainer_reports import http_get
from kubetron_operator.untrusted import INT64_MAX, clean

log = logging.getLogger(__name__)

TAIL_BYTES = 256 * 1024  # the end of the log the operator reads (see the module docstring)
READ_DEADLINE = 3.0  # seconds for one read of the store, all of it
SIGNED_FOR = 60  # seconds a presigned request stays valid


@dataclass(frozen=True)
class ProgressRead:
    """One read: the summary (None: unread), why it is unread as (reason, message) for the job's status
    (None: read, or not the operator's to read), and what was ignored in it."""

    summary: ProgressSummary | None = None
    unread: tuple[str, str] | None = None
    warnings: tuple[str, ...] = ()


class Unread(Exception):
    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason, self.message = reason, message


def s3_key(job: Job) -> tuple[str, str]:
    """(bucket, key) of the job's progress log."""
    assert isinstance(job.spec.storage, S3Storage)
    rest = job.store[len("s3://"):]
    bucket, _, prefix = rest.partition("/")
    return bucket, f"{prefix}/{PROGRESS_FILE}" if prefix else PROGRESS_FILE


def read_s3_progress(job: Job, kube: Kube, own_buckets: Collection[str] = ()) -> ProgressRead:
    """The summary of the tail of the job's progress log (an empty one when there is no log yet), or why
    it is unread; ProgressRead() when it is not the operator's to read (PVC, or no secretRef)."""
    storage = job.spec.storage
    if not isinstance(storage, S3Storage):
        return ProgressRead()
    try:
        url = signed_url(job, storage, kube, own_buckets)
        if url is None:
            return ProgressRead()
        text = read_tail(url, storage.endpoint or "AWS S3")
    except Unread as exc:
        log.warning("progress log of %s/%s unread: %s: %s", job.namespace, job.name, exc.reason, exc.message)
        return ProgressRead(unread=(exc.reason, exc.message))
    events = parse_progress(text)
    limit = job.spec.max_in_place_restarts
    kept = [ev for ev in events if _in_range(ev, limit)]
    summary = summarize_events(kept)
    summary.pop("events", None)
    dropped = len(events) - len(kept)
    warnings: tuple[str, ...] = (f"{PROGRESS_FILE}: {dropped} line(s) ignored, a number beyond int64 or more "
                                 f"in-place restarts than maxInPlaceRestarts {limit}",) if dropped else ()
    too_many = sorted(job_id for job_id, n in summary["hangs"].items() if n > limit)
    for job_id in too_many:  # more "Hang detected" lines than an attempt can have: counted up to what it can
        summary["hangs"][job_id] = limit
    if too_many:
        warnings += (f"{PROGRESS_FILE}: more hangs than maxInPlaceRestarts {limit} for {clean(too_many[0], 200)}; "
                     f"counted as {limit}",)
    return ProgressRead(summary=summary, warnings=warnings)


def _in_range(ev: ProgressEvent, max_in_place: int) -> bool:
    """The numbers the operator takes from a line fit the CRD's status (int64, not negative) and the spec (an
    attempt's in-place restarts at most maxInPlaceRestarts)."""
    counts = (ev.iteration, ev.train_iters)
    restarts = as_int(ev.fields.get(IN_PLACE_RESTARTS_KEY))
    return all(n is None or 0 <= n <= INT64_MAX for n in counts) and (restarts is None or 0 <= restarts <= max_in_place)


def signed_url(job: Job, storage: S3Storage, kube: Kube, own_buckets: Collection[str]) -> str | None:
    """A presigned GET of the job's progress log, signed with the job's Secret, or (an admin's opt-in)
    the operator's own identity; None when neither applies."""
    bucket, key = s3_key(job)
    if storage.secret_name:
        keys = job_credentials(kube, job.namespace, storage.secret_name)
        return presign(storage.endpoint, storage.region, bucket, key, keys)
    if bucket not in own_buckets:
        return None
    own = operator_endpoint()
    if storage.endpoint and storage.endpoint.rstrip("/") != own.rstrip("/"):
        raise Unread("StoreNotAllowed", f"bucket {bucket} is read with the operator's identity only at its own "
                     f"endpoint ({own or 'AWS S3'}), not at {clean(storage.endpoint, 200)}; give the job a secretRef")
    return presign(own, storage.region, bucket, key, operator_credentials())


def job_credentials(kube: Kube, namespace: str, secret: str) -> tuple[str, str, str | None]:
    """(access key id, secret access key, None) from the job's Secret; Unread naming what is missing.
    The values are never logged, nor put in status or events."""
    try:
        data = kube.secret_data(namespace, secret)
    except ApiError as exc:
        reason = "SecretNotFound" if exc.status == 404 else "SecretUnreadable"
        raise Unread(reason, f"Secret {secret}: {clean(exc, 300)}") from None
    except ValueError:  # not base64 / not UTF-8
        raise Unread("SecretUnreadable", f"Secret {secret}: its data does not decode") from None
    missing = [k for k in S3_SECRET_KEYS if not data.get(k)]
    if missing:
        raise Unread("SecretKeyMissing", f"Secret {secret} has no key {' or '.join(missing)}; the operator reads "
                     "the job's store only with the job's own credentials")
    return data[S3_SECRET_KEYS[0]], data[S3_SECRET_KEYS[1]], None


def operator_endpoint() -> str:
    """The operator's own S3 endpoint (as botocore reads it from the environment); "" for AWS S3."""
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or ""


_OWN: list[Any] = []  # the operator's own credentials, resolved once (botocore refreshes them)


def operator_credentials() -> tuple[str, str, str | None]:
    """The operator's own identity, from botocore's default chain (environment, IRSA, instance metadata):
    only for buckets an admin listed (--s3-operator-buckets)."""
    import botocore.session

    if not _OWN:
        _OWN.append(botocore.session.get_session().get_credentials())
    if _OWN[0] is None:
        raise Unread("NoOperatorCredentials", "the operator has no credentials of its own for this bucket")
    frozen = _OWN[0].get_frozen_credentials()
    return frozen.access_key, frozen.secret_key, frozen.token


def presign(endpoint: str, region: str, bucket: str, key: str, keys: tuple[str, str, str | None]) -> str:
    """A SigV4 presigned GET of s3://bucket/key at `endpoint` (path style; "" is AWS S3 in `region`)."""
    from botocore.auth import S3SigV4QueryAuth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    region = region or "us-east-1"
    base = endpoint.rstrip("/") or f"https://s3.{region}.amazonaws.com"
    request = AWSRequest(method="GET", url=f"{base}/{bucket}/{quote(key, safe='/~')}")
    S3SigV4QueryAuth(Credentials(*keys), "s3", region, expires=SIGNED_FOR).add_auth(request)
    return str(request.url)


def read_tail(url: str, where: str) -> str:
    """The last TAIL_BYTES of the object (all of it when smaller; "" when there is none), starting at a
    whole line; Unread when the store is slow, answers with more, or refuses."""
    try:
        answer = http_get.get(url, limit=TAIL_BYTES, deadline=READ_DEADLINE, headers={"Range": f"bytes=-{TAIL_BYTES}"})
    except TimeoutError:
        raise Unread("StoreTimeout", f"the store at {clean(where, 200)} did not answer within "
                     f"{READ_DEADLINE:.0f}s; reading again later") from None
    except http_get.TooLarge:
        raise Unread("StoreTooLarge", f"the store at {clean(where, 200)} answered with more than the last "
                     f"{TAIL_BYTES // 1024} KiB of {PROGRESS_FILE} it was asked for") from None
    except (OSError, ValueError) as exc:
        raise Unread("StoreError", f"the store at {clean(where, 200)}: {type(exc).__name__}: {clean(exc, 200)}") \
            from None
    if answer.status in (404, 416):  # no log yet; an empty one (no range of it is satisfiable)
        return ""
    if answer.status not in (200, 206):
        raise Unread("StoreError", f"the store at {clean(where, 200)} answered HTTP {answer.status} "
                     f"({_s3_code(answer.body)}) to a GET of {PROGRESS_FILE}")
    text = answer.body.decode("utf-8", "replace")
    whole = answer.status == 200 or str(answer.headers.get("Content-Range", "")).startswith("bytes 0-")
    return text if whole else text.partition("\n")[2]  # the first line may be cut: drop it


def _s3_code(body: bytes) -> str:
    """The <Code> of an S3 error answer, or "no error code"."""
    text = body[:2048].decode("utf-8", "replace")
    start, end = text.find("<Code>"), text.find("</Code>")
    return clean(text[start + 6:end], 60) if 0 <= start < end else "no error code"
