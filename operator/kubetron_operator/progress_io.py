"""Reading a job's progress log (`<store>/progress.txt`) from the operator.

S3 stores: directly with boto3, with the credentials from the job's own Secret (never logged, never
put in status). PVC stores: no direct access from the operator; decide() uses rank 0's status endpoint and
the ranks' termination messages (a new attempt's rank 0 reports the checkpoint it resumed from).
"""

from __future__ import annotations

import logging
from typing import Any

from kubetron.contract.progress import PROGRESS_FILE, ProgressSummary, parse_progress, summarize_events

from kubetron_operator.api_calls import Kube
from kubetron_operator.model import Job, S3Storage

log = logging.getLogger(__name__)


def s3_key(job: Job) -> tuple[str, str]:
    """(bucket, key) of the job's progress log."""
    assert isinstance(job.spec.storage, S3Storage)
    rest = job.store[len("s3://"):]
    bucket, _, prefix = rest.partition("/")
    return bucket, f"{prefix}/{PROGRESS_FILE}" if prefix else PROGRESS_FILE


def read_s3_progress(job: Job, kube: Kube, client_factory: Any = None) -> ProgressSummary | None:
    """summarize_events() of the job's progress log; {} summary when there is none yet; None on errors."""
    storage = job.spec.storage
    if not isinstance(storage, S3Storage):
        return None
    try:
        secret = kube.secret_data(job.namespace, storage.secret_name)
        make = client_factory or _boto3_client
        client = make(
            endpoint_url=storage.endpoint or None,
            region_name=storage.region or None,
            aws_access_key_id=secret.get("AWS_ACCESS_KEY_ID"),
            aws_secret_access_key=secret.get("AWS_SECRET_ACCESS_KEY"),
        )
        bucket, key = s3_key(job)
        try:
            text = client.get_object(Bucket=bucket, Key=key)["Body"].read().decode("utf-8", "replace")
        except client.exceptions.NoSuchKey:
            text = ""
    except Exception as exc:  # noqa: BLE001 - any failure means "unread"; say which, not the secret
        log.warning("cannot read the progress log of %s/%s: %s", job.namespace, job.name, type(exc).__name__)
        return None
    summary = summarize_events(parse_progress(text))
    summary.pop("events", None)
    return summary


def _boto3_client(**kwargs: Any) -> Any:
    import boto3

    return boto3.client("s3", **kwargs)
