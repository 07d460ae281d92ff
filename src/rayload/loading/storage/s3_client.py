"""The boto3 side of :mod:`rayload.loading.storage.s3`: the client from the standard AWS
chain, the time-outs of one attempt under the load's deadline, reading a response body
into given buffers, and an S3 error response as one message.

Never in a message: a credential. Only where it came from (``env``,
``shared-credentials-file``, ``iam-role``...) is named.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from rayload.errors import ConfigError, StorageError
from rayload.loading.storage.base import current_deadline

MAX_POOL = 64
"""Connections per client: the reader threads' GETs in flight."""
CONNECT_TIMEOUT_S = 3.0
READ_TIMEOUT_S = 30.0
RETRYABLE = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestTimeout",
        "InternalError",
        "ServiceUnavailable",
        "500",
        "502",
        "503",
        "504",
    }
)
"""Error codes retried with backoff (throttling and 5xx)."""
_DENIED = frozenset(
    {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken"}
)


def attempt_timeouts() -> tuple[float, float]:
    """(connect, read) time-outs of one request, in seconds: 3 and 30 without a deadline;
    under a deadline of T seconds (:func:`~rayload.loading.storage.storage_deadline`) a
    sixth of T when shorter, so that an attempt started (and a body read resumed) while
    the deadline leaves room for them both ends before it, however the server stalls."""
    deadline = current_deadline()
    if deadline is None:
        return CONNECT_TIMEOUT_S, READ_TIMEOUT_S
    read = round(min(READ_TIMEOUT_S, max(0.25, deadline[1] / 6)), 3)
    return min(CONNECT_TIMEOUT_S, read), read


def slack(timeout_s: float) -> float:
    """What a deadline of ``timeout_s`` keeps back after the last request or body read may
    end: time for a rank's other reads to stop and its error to reach the driver before
    the driver's own wait ends (a tenth of it, from 1 to 10 s)."""
    return min(10.0, max(1.0, timeout_s / 10))


PROGRESS_BYTES = 256 << 10
"""How often (in bytes of a body) :func:`fill` tells its ``progress``."""


def fill(
    body: Any,
    pending: list[memoryview],
    read_timeout: float,
    progress: Callable[[int], None] | None = None,
) -> tuple[int, str]:
    """Read ``body`` into ``pending`` (consumed in place) until full or the body ends;
    the bytes read and, when it ended early, why; ``progress(got)`` every
    :data:`PROGRESS_BYTES` or so. Under a deadline, no read starts that could block
    (``read_timeout``) past it: the body is left, and its resumption then fails the
    deadline check."""
    import botocore.exceptions as bex
    import urllib3.exceptions as uex

    deadline = current_deadline()
    stop_at = None if deadline is None else deadline[0] - read_timeout - slack(deadline[1])
    got = told = 0
    try:
        while pending:
            if stop_at is not None and time.monotonic() > stop_at:
                return got, "the load's deadline came mid-body"
            n = body.readinto(pending[0])
            if n == 0:
                return got, "the body ended early"
            got += n
            if n == len(pending[0]):
                pending.pop(0)
            else:
                pending[0] = pending[0][n:]
            if progress is not None and got - told >= PROGRESS_BYTES:
                progress(got)
                told = got
    except (bex.BotoCoreError, uex.HTTPError, OSError) as exc:
        return got, type(exc).__name__
    return got, ""


def make_client(connect_timeout: float, read_timeout: float) -> tuple[Any, str, str]:
    """A boto3 S3 client from the standard AWS chain, its endpoint URL and where its
    credentials came from (never the credentials)."""
    try:
        import boto3
        import botocore.config
        from botocore import UNSIGNED
    except ImportError as exc:
        raise ConfigError(
            f"reading s3:// checkpoints needs boto3 ({exc}); pip install 'rayload[s3]'"
        ) from None
    session = boto3.session.Session()
    scoped = session._session.get_scoped_config()
    credentials = session.get_credentials()
    if credentials is None:
        source = "nowhere (no AWS credentials found: unsigned, anonymous requests)"
    else:
        source = str(credentials.method)
        if profile := os.environ.get("AWS_PROFILE"):
            source += f" (profile {profile!r})"
    custom_endpoint = (
        os.environ.get("AWS_ENDPOINT_URL_S3")
        or os.environ.get("AWS_ENDPOINT_URL")
        or (scoped.get("s3") or {}).get("endpoint_url")
        or scoped.get("endpoint_url")
    )
    style = (scoped.get("s3") or {}).get("addressing_style") or (
        "path" if custom_endpoint else "auto"
    )
    config = botocore.config.Config(
        region_name=session.region_name or "us-east-1",
        max_pool_connections=MAX_POOL,
        connect_timeout=connect_timeout,
        read_timeout=read_timeout,
        retries={"mode": "standard", "total_max_attempts": 1},  # ours: S3Storage._call
        s3={"addressing_style": style},
        tcp_keepalive=True,
        signature_version=UNSIGNED if credentials is None else None,
        response_checksum_validation="when_required",
    )
    client = session.client("s3", config=config)
    return client, str(client.meta.endpoint_url), source


def translate(
    path: str,
    response: dict[str, Any],
    *,
    bucket: str,
    key: str,
    endpoint: str,
    credential_source: str,
    etag: str,
) -> StorageError:
    """An S3 error ``response`` to a request for ``path`` as one StorageError naming the
    bucket, key and endpoint (and, when access is denied, where the credentials came
    from); ``etag``: the version the request was pinned to."""
    error = response.get("Error") or {}
    code = str(error.get("Code", ""))
    status = int((response.get("ResponseMetadata") or {}).get("HTTPStatusCode", 0))
    where = f"bucket {bucket!r}, key {key!r} at {endpoint}"
    if code == "NoSuchBucket":
        return StorageError(
            f"{path}: no bucket {bucket!r} at {endpoint}; check the bucket "
            "name, AWS_ENDPOINT_URL and AWS_REGION",
            url=path,
            missing=True,
        )
    if code in ("NoSuchKey", "404", "NotFound") or status == 404:
        return StorageError(
            f"{path}: no such object ({where}); check the path, or that the upload finished",
            url=path,
            missing=True,
        )
    if code in ("PreconditionFailed", "412") or status == 412:
        return StorageError(
            f"{path}: the object changed after its header was read (its ETag is no longer "
            f"{etag}; {where}); refusing to mix two versions: load again once the upload "
            "has finished",
            url=path,
        )
    if status == 403 or code in _DENIED:
        return StorageError(
            f"{path}: access denied ({code or status}; {where}) with credentials from "
            f"{credential_source}; check that they are valid and allow s3:GetObject "
            "and s3:ListBucket",
            url=path,
        )
    if code == "InvalidRange":
        return StorageError(
            f"{path}: a byte range lies past the end of the object ({where}); it is "
            "shorter than its header says: upload it again",
            url=path,
        )
    return StorageError(
        f"{path}: {code or 'HTTP ' + str(status)} from {endpoint} ({where}): "
        f"{error.get('Message', '')}",
        url=path,
    )
