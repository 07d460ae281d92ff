"""Object storage over the S3 protocol (AWS S3 and S3-compatible stores), through boto3.

Configuration is the standard AWS chain, read by botocore in the process that reads
(each rank on its own node): credentials from ``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``, ``AWS_PROFILE`` and the shared config
and credentials files, or instance metadata; ``AWS_REGION``; the endpoint from
``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` (or the profile's ``endpoint_url``). A
custom endpoint is addressed path-style unless the profile's ``s3.addressing_style``
says otherwise. With no credentials anywhere, requests go unsigned (public buckets).

Reads:

* one version: the first request that sees a key (a listing, a HEAD, a header read)
  pins its size and ETag, and every later GET of it in this process carries
  ``If-Match``; an object that changed is a :class:`~rayload.errors.StorageError` naming
  the key, never bytes of two versions; a new :func:`open_checkpoint` (a reload) pins
  afresh. A rank given the driver's checkpoint adopts its pins (:meth:`S3Storage.adopt`)
  and sends no request but its data GETs.
* throttling (503 SlowDown), other 5xx and connection errors before the body are
  retried (exponential backoff with full jitter, at most :data:`_API_ATTEMPTS`
  attempts); a body cut short (reset, short read, time-out) is resumed from the first
  missing byte, with backoff and jitter, at most :data:`BODY_RETRIES` times. Both are
  counted. No attempt starts, and no back-off sleeps, past the deadline of the load
  (:func:`~rayload.loading.storage.storage_deadline`, from ``--timeout``; a rank's from
  its load request), and under a deadline each attempt's connect and read time-outs are
  short enough (:func:`attempt_timeouts`) that no request, nor any read of a body, ends
  past it: an endpoint that does not answer, or stops answering mid-load, is this
  error within the load's timeout, on the driver as on each rank, never a rank that
  outlives the load's wait.
* a server that ignores ``Range`` and answers 200 with the whole object is refused
  before its body is read (nothing buffered).

Never in a message, attribute or pickle: a credential. Only where it came from
(``env``, ``shared-credentials-file``, ``iam-role``...) is named. The boto3 side (the
client, time-outs, body reads, error messages) is :mod:`.s3_client`.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, ClassVar
from urllib.parse import urlsplit

from rayload.errors import ConfigError, StorageError
from rayload.loading.storage.base import (
    S3_SCHEME,
    Progress,
    Storage,
    StorageCounters,
    StorageKind,
    current_deadline,
)
from rayload.loading.storage.s3_client import (
    RETRYABLE,
    attempt_timeouts,
    fill,
    make_client,
    slack,
    translate,
)

BODY_RETRIES = 5
"""Resumptions of one ranged GET whose body was cut short."""


def _from(progress: Progress, base: int, got: int) -> None:
    """``progress`` of a resumed body: ``base`` bytes were in place before it."""
    progress(base + got)


_API_ATTEMPTS = 6
"""Attempts per request (botocore's own retries are off: these are bounded by the
load's deadline)."""
_MAX_BACKOFF_S = 20.0


def split_url(url: str) -> tuple[str, str]:
    """``s3://bucket/key`` -> ``(bucket, key)`` (the key may be empty); ConfigError for
    anything else."""
    if not url.startswith(S3_SCHEME):
        raise ConfigError(f"{url}: not an s3:// URL")
    bucket, _, key = url[len(S3_SCHEME) :].partition("/")
    if not bucket:
        raise ConfigError(f"{url}: no bucket; write s3://BUCKET/PREFIX")
    return bucket, key.strip("/")


class S3Storage(Storage):
    """The objects of one bucket. Thread-safe; one boto3 client (created on first use,
    never pickled) shared by the reader threads."""

    kind: ClassVar[StorageKind] = "s3"
    gather_gap: ClassVar[int] = 64 << 10
    """A request costs about as much as this many bytes: closer rows are fetched as one
    run (the gaps are other ranks' bytes, which the server then serves again). Measured
    (docs/design.md "Object storage"): one TP=2 group fetching its split-1 rows exactly
    is served 1.000x the checkpoint but makes 54x the requests and takes 29x as long as
    fetching runs (1.26x); the converted layout is served 1.00x with large reads."""
    gather_bytes: ClassVar[int] = 4 << 20
    """The longest run, one GET (a 4 MiB bounce buffer per reader thread): 1.7x faster
    than 1 MiB runs for the same bytes, since a strided read's runs follow one another
    on one thread."""

    def __init__(self, bucket: str) -> None:
        self.bucket = bucket
        self._lock = threading.Lock()
        self._clients: dict[tuple[float, float], Any] = {}  # (connect, read) -> client
        self._endpoint = ""
        self._credential_source = ""
        self._pinned: dict[str, tuple[int, str]] = {}  # key -> (size, ETag)
        self._listed: set[str] = set()  # prefixes listed (a key absent from them is absent)
        self._requests = self._retries = self._bytes = 0

    def __reduce__(self) -> tuple[Any, ...]:
        return (S3Storage, (self.bucket,))

    # -- the contract -------------------------------------------------------------------

    def join(self, root: str, name: str) -> str:
        return f"{root.rstrip('/')}/{name}"

    def is_dir(self, path: str) -> bool:
        return bool(self.listdir(path))

    def is_file(self, path: str) -> bool:
        key = self._key(path)
        if key in self._pinned:
            return True
        if key.rpartition("/")[0] in self._listed:
            return False
        try:
            self.size(path)
        except StorageError as exc:
            if exc.missing:
                return False
            raise
        return True

    def listdir(self, root: str) -> list[str]:
        prefix = self._key(root)
        client = self._get_client()
        names: list[str] = []
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"Bucket": self.bucket, "Delimiter": "/"}
            if prefix:
                kwargs["Prefix"] = prefix + "/"
            if token:
                kwargs["ContinuationToken"] = token
            page = self._call(root, client.list_objects_v2, **kwargs)
            for item in page.get("Contents", ()):
                key = item["Key"]
                self._pin(key, int(item["Size"]), item["ETag"])
                names.append(key.rpartition("/")[2])
            if not page.get("IsTruncated"):
                break
            token = page["NextContinuationToken"]
        with self._lock:
            self._listed.add(prefix)
        return sorted(n for n in names if n)

    def size(self, path: str) -> int:
        key = self._key(path)
        pinned = self._pinned.get(key)
        if pinned is None:
            client = self._get_client()
            head = self._call(path, client.head_object, Bucket=self.bucket, Key=key)
            self._pin(key, int(head["ContentLength"]), head["ETag"])
            pinned = self._pinned[key]
        return pinned[0]

    def read(self, path: str, offset: int, length: int) -> bytes:
        size = self.size(path)
        length = max(0, min(length, size - offset))
        if length == 0:
            return b""
        buffer = bytearray(length)
        self.read_into(path, offset, [memoryview(buffer)], length)
        return bytes(buffer)

    def read_all(self, path: str) -> bytes:
        return self.read(path, 0, self.size(path))

    def counters(self) -> StorageCounters:
        with self._lock:
            return StorageCounters(self._requests, self._retries, self._bytes)

    def attributes(self) -> dict[str, Any]:
        self._get_client()
        return {
            "rayload.storage": "s3",
            "rayload.storage.endpoint": urlsplit(self._endpoint).hostname or self._endpoint,
            "rayload.storage.bucket": self.bucket,
        }

    # -- ranged reads into given buffers --------------------------------------------------

    def read_into(
        self,
        path: str,
        offset: int,
        views: list[memoryview],
        size: int,
        progress: Progress | None = None,
    ) -> int:
        """Fill ``views`` (``size`` bytes together) from ``offset`` of ``path`` with one
        ranged GET, resumed where a body was cut short; returns ``size``. ``progress`` is
        told the bytes in place every
        :data:`~rayload.loading.storage.s3_client.PROGRESS_BYTES` or so as the body comes."""
        if size == 0:
            return 0
        key = self._key(path)
        self.size(path)  # pins the version
        _, etag = self._pinned[key]
        client = self._get_client()
        _, read_timeout = attempt_timeouts()
        pending = list(views)
        done = resumed = 0
        end = offset + size  # exclusive
        while True:
            start = offset + done
            response = self._call(
                path,
                client.get_object,
                Bucket=self.bucket,
                Key=key,
                Range=f"bytes={start}-{end - 1}",
                IfMatch=etag,
            )
            body = response["Body"]
            try:
                self._check_range(path, response, start, end)
                got, problem = fill(
                    body,
                    pending,
                    read_timeout,
                    None if progress is None else partial(_from, progress, done),
                )
            except BaseException:
                body.close()
                raise
            with self._lock:
                self._bytes += got
            done += got
            if done == size:
                body.close()
                return size
            body.close()
            resumed += 1
            if resumed > BODY_RETRIES:
                raise StorageError(
                    f"{path}: bytes {start}-{end - 1} from {self._endpoint} came short "
                    f"{resumed} times ({problem}); the connection or the server is failing: "
                    "try again",
                    url=path,
                )
            self._back_off(path, resumed, problem)

    def _check_range(self, path: str, response: dict[str, Any], start: int, end: int) -> None:
        status = response["ResponseMetadata"]["HTTPStatusCode"]
        if status == 206 and str(response.get("ContentRange", "")).startswith(
            f"bytes {start}-{end - 1}/"
        ):
            return
        whole = response.get("ContentLength")
        if status == 200 and start == 0 and whole == end:
            return  # the range was the whole object
        raise StorageError(
            f"{path}: {self._endpoint} ignored the byte range {start}-{end - 1} (HTTP "
            f"{status}, {whole} bytes, Content-Range {response.get('ContentRange')!r}); "
            "refusing to download the whole object for each range: use a store that "
            "supports ranged GETs",
            url=path,
        )

    # -- the client, requests and their errors ---------------------------------------------

    def _key(self, path: str) -> str:
        bucket, key = split_url(path)
        if bucket != self.bucket:
            raise ConfigError(f"{path}: not in bucket {self.bucket!r}")
        return key

    def _pin(self, key: str, size: int, etag: str) -> None:
        with self._lock:
            self._pinned[key] = (size, etag)

    def _under(self, root: str) -> Callable[[str], bool]:
        prefix = self._key(root)
        if not prefix:  # the whole bucket
            return lambda key: True
        return lambda key: key == prefix or key.startswith(prefix + "/")

    def versions(self, root: str) -> dict[str, tuple[int, str]]:
        under = self._under(root)
        with self._lock:
            return {f"s3://{self.bucket}/{k}": pin for k, pin in self._pinned.items() if under(k)}

    def adopt(self, root: str, versions: Mapping[str, tuple[int, str]]) -> None:
        """Forget the versions and listings under ``root``, then pin ``versions``: with
        none, the next reads pin the objects as they are now (each open, a reload)."""
        pins = {self._key(path): (int(size), etag) for path, (size, etag) in versions.items()}
        under = self._under(root)
        with self._lock:
            for key in [k for k in self._pinned if under(k)]:
                del self._pinned[key]
            self._listed = {p for p in self._listed if not under(p)}
            self._pinned.update(pins)

    def _get_client(self) -> Any:
        """The client whose time-outs suit the current deadline (one per distinct pair,
        so one per load's ``--timeout``: the connections are reused within a load)."""
        timeouts = attempt_timeouts()
        with self._lock:
            client = self._clients.get(timeouts)
            if client is None:
                client, self._endpoint, self._credential_source = make_client(*timeouts)
                self._clients[timeouts] = client
            return client

    def _call(self, path: str, fn: Any, **kwargs: Any) -> Any:
        """``fn(**kwargs)``, retried on throttling, 5xx and connection errors; its errors
        translated into StorageErrors naming ``path``."""
        import botocore.exceptions as bex

        unreachable = (bex.EndpointConnectionError, bex.ConnectTimeoutError)
        for attempt in range(1, _API_ATTEMPTS + 1):
            if attempt > 1:
                self._back_off(path, attempt - 1, "")
            else:
                self._check_deadline(path, "")
            with self._lock:
                self._requests += 1
            try:
                return fn(**kwargs)
            except bex.ClientError as exc:
                code = str((exc.response.get("Error") or {}).get("Code", ""))
                if code not in RETRYABLE or attempt == _API_ATTEMPTS:
                    key = self._key(path)
                    raise translate(
                        path,
                        exc.response,
                        bucket=self.bucket,
                        key=key,
                        endpoint=self._endpoint,
                        credential_source=self._credential_source,
                        etag=self._pinned.get(key, (0, "?"))[1],
                    ) from None
            except unreachable as exc:
                if attempt == _API_ATTEMPTS:
                    raise StorageError(
                        f"{path}: cannot reach the S3 endpoint {self._endpoint} "
                        f"({type(exc).__name__}, {attempt} attempts); check AWS_ENDPOINT_URL / "
                        "AWS_ENDPOINT_URL_S3 and the network",
                        url=path,
                    ) from None
            except (bex.ReadTimeoutError, bex.ConnectionClosedError) as exc:
                if attempt == _API_ATTEMPTS:
                    raise StorageError(
                        f"{path}: {self._endpoint} stopped answering ({type(exc).__name__}) "
                        f"after {attempt} attempts; try again",
                        url=path,
                    ) from None
            except bex.NoCredentialsError:
                raise StorageError(f"{path}: no AWS credentials found", url=path) from None
        raise AssertionError("unreachable")

    def _back_off(self, path: str, retry: int, problem: str) -> None:
        """Count retry number ``retry`` and sleep before it (full jitter); StorageError
        instead when the deadline leaves no time for an attempt after the sleep."""
        with self._lock:
            self._retries += 1
        pause = random.uniform(0, min(_MAX_BACKOFF_S, 0.05 * 2**retry))
        self._check_deadline(path, problem, after=pause)
        time.sleep(pause)

    def _check_deadline(self, path: str, problem: str, *, after: float = 0.0) -> None:
        """StorageError when the load's deadline leaves no time, ``after`` seconds from
        now, for another attempt (its connection and its wait for an answer,
        :func:`attempt_timeouts`, plus time for the error to reach the driver)."""
        deadline = current_deadline()
        if deadline is None:
            return
        connect, read = attempt_timeouts()
        if deadline[0] - time.monotonic() - after > connect + read + slack(deadline[1]):
            return
        raise StorageError(
            f"{path}: no answer from the S3 endpoint {self._endpoint} within the load's "
            f"timeout ({deadline[1]:g} s{'; ' + problem if problem else ''}); check "
            "AWS_ENDPOINT_URL / AWS_ENDPOINT_URL_S3 and the network, or raise --timeout",
            url=path,
        )
