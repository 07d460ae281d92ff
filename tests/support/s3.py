"""A real S3-protocol server for the tests, on 127.0.0.1: moto's standalone server behind a
small proxy that counts the bytes it serves and injects faults.

The AWS environment the tests run with (:func:`s3_environment`) is fixed when the test
session starts, before any Ray cluster does, so rank actors inherit it as their node's
environment: the endpoint is the proxy's port (chosen then), the secret a random canary
(:data:`CANARY`) that the secret tests grep for. The server itself starts on first use
(:func:`s3_server`), once per session.

Faults (:meth:`S3Proxy.inject`) apply to the next GETs with a ``Range`` of a key ending
with a suffix, starting at ``min_start`` or later (tensor data, not headers) and at least
``min_length`` bytes long (a rank's reads, not the driver's 4 KiB identity samples);
``denied`` applies to any request of such a key:

* ``slowdown``: 503 SlowDown (botocore retries it);
* ``reset`` / ``short``: half the body, then a TCP reset / a clean close;
* ``ignore_range``: the request goes on without its Range: 200 and the whole object;
* ``denied``: 403 AccessDenied;
* ``rewrite``: before forwarding, the object is overwritten (same size, other bytes), so
  its ETag changes between the header read and this data read;
* ``blackhole``: the response's status and headers, then nothing: the connection stays
  open and silent (an endpoint that stopped answering) until the client gives up or the
  faults are cleared.

A client that hangs up while the proxy writes (rayload abandoning a body it refused, or
one it stopped waiting for) is recorded as ``Served.disconnected``, not a traceback; any
other error of the proxy still is one.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import secrets
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

CANARY = "canary-" + secrets.token_hex(12)
"""The AWS secret access key of the test session: must never appear anywhere."""
ACCESS_KEY = "AKIARAYLOADTESTS0000"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


PROXY_PORT = _free_port()
ENDPOINT = f"http://127.0.0.1:{PROXY_PORT}"


_PACE_BYTES = 256 << 10
"""The body goes in pieces of this size when the proxy's rate is limited."""


def rewrite(client: Any, bucket: str, key: str) -> None:
    """Write ``bucket/key`` anew with its last byte flipped (same size: a new version)."""
    old = client.get_object(Bucket=bucket, Key=key)["Body"].read()
    client.put_object(
        Bucket=bucket, Key=key, Body=old[:-1] + bytes([old[-1] ^ 0xFF]) if old else b"x"
    )


def data_start(path: Path) -> int:
    """Where a local safetensors file's tensor bytes begin (after its 8 bytes and header)."""
    with path.open("rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def files_containing(root: Path, needle: str) -> list[str]:
    """The files under ``root`` whose bytes contain ``needle`` (the canary greps)."""
    found = []
    for path in root.rglob("*"):
        try:
            if path.is_file() and needle.encode() in path.read_bytes():
                found.append(str(path))
        except OSError:
            continue
    return found


def s3_environment() -> dict[str, str]:
    """The standard AWS variables naming the test server (no rayload-specific ones)."""
    return {
        "AWS_ENDPOINT_URL": ENDPOINT,
        "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": CANARY,
        "AWS_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }


@dataclass
class _Fault:
    kind: str
    suffix: str
    times: int
    min_start: int
    min_length: int


@dataclass
class Served:
    """One request the proxy answered."""

    method: str
    key: str
    range: str | None
    status: int
    body_bytes: int
    """What the proxy sent of the body, or began to send when ``disconnected``."""
    disconnected: bool = False
    """The client hung up before the proxy had written the response."""
    sent_ns: int = field(default_factory=time.time_ns)
    """When the proxy began to send the body (``time.time_ns()``, the spans' clock)."""


@dataclass
class S3Proxy:
    """Forwards every request to moto; records each one; injects faults."""

    upstream: tuple[str, int]
    log: list[Served] = field(default_factory=list)
    faults: list[_Fault] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    client: Any = None
    released: threading.Event = field(default_factory=threading.Event)
    """Set by :meth:`clear`: the blackholed connections then close."""
    rate: float = 0.0
    """Bytes per second of body the proxy sends, all connections together, as one link
    of that speed would (0: as fast as it can; the benchmarks' bandwidth-bound runs)."""
    _link_free: float = 0.0

    def pace(self, n: int) -> None:
        """Wait until ``n`` more body bytes have crossed the link of :attr:`rate`."""
        if self.rate <= 0:
            return
        with self.lock:
            start = max(self._link_free, time.monotonic())
            self._link_free = start + n / self.rate
            done = self._link_free
        time.sleep(max(0.0, done - time.monotonic()))

    def inject(
        self,
        kind: str,
        *,
        suffix: str = "",
        times: int = 1,
        min_start: int = 0,
        min_length: int = 0,
    ) -> None:
        with self.lock:
            self.released.clear()
            self.faults.append(_Fault(kind, suffix, times, min_start, min_length))

    def clear(self) -> None:
        with self.lock:
            self.log.clear()
            self.faults.clear()
            self.released.set()

    def served_bytes(self, prefix: str = "") -> int:
        """Body bytes of the GETs of keys under ``prefix`` (``bucket/key...``)."""
        with self.lock:
            return sum(
                r.body_bytes for r in self.log if r.method == "GET" and r.key.startswith(prefix)
            )

    def requests(self, prefix: str = "") -> list[Served]:
        with self.lock:
            return [r for r in self.log if r.key.startswith(prefix)]

    def take_fault(self, method: str, key: str, range_: str | None) -> str | None:
        start = length = -1
        if method == "GET" and range_ is not None:
            first, _, last = range_.removeprefix("bytes=").partition("-")
            start = int(first or 0)  # "bytes=N-" (to the end): s3transfer's downloads
            length = int(last) - start + 1 if last else 1 << 62
        with self.lock:
            for fault in self.faults:
                if not fault.times or not key.endswith(fault.suffix):
                    continue
                if fault.kind == "denied" or (
                    start >= fault.min_start and length >= max(1, fault.min_length)
                ):
                    fault.times -= 1
                    return fault.kind
        return None


def _handler(proxy: S3Proxy) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def handle(self) -> None:
            try:
                super().handle()
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True  # hung up between requests: not a failure

        def _forward(self) -> None:
            self._served: Served | None = None
            try:
                self._relay()
            except (BrokenPipeError, ConnectionResetError):
                # The client hung up (it refused a body, or stopped waiting for one).
                self.close_connection = True
                served = self._served or self._record(
                    self.command, self._key(), self.headers.get("Range"), 0, 0
                )
                with proxy.lock:
                    served.disconnected = True

        def _key(self) -> str:
            return unquote(urlsplit(self.path).path).lstrip("/")

        def _relay(self) -> None:
            method = self.command
            key = self._key()
            headers = {k: v for k, v in self.headers.items()}
            length = int(headers.get("Content-Length", 0) or 0)
            body = self.rfile.read(length) if length else None
            fault = proxy.take_fault(method, key, headers.get("Range"))
            if fault in ("slowdown", "denied"):
                self._error(
                    method,
                    key,
                    *(
                        (503, "SlowDown", "Please reduce your request rate.")
                        if fault == "slowdown"
                        else (403, "AccessDenied", "Access Denied")
                    ),
                )
                return
            if fault == "ignore_range":
                headers = {k: v for k, v in headers.items() if k.lower() != "range"}
            if fault == "rewrite":
                bucket, _, name = key.partition("/")
                rewrite(proxy.client, bucket, name)
            upstream = http.client.HTTPConnection(*proxy.upstream, timeout=60)
            try:
                upstream.request(method, self.path, body=body, headers=headers)
                response = upstream.getresponse()
                self.send_response_only(response.status, response.reason)
                for name, value in response.getheaders():
                    if name.lower() not in ("connection", "transfer-encoding", "server", "date"):
                        self.send_header(name, value)
                data = response.read()
                if "content-length" not in (n.lower() for n, _ in response.getheaders()):
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                sent = 0 if method == "HEAD" or fault == "blackhole" else len(data)
                if fault in ("reset", "short"):
                    sent //= 2
                # Logged before the body goes: a client that has the last byte finds its
                # request in the log (served_bytes right after a load).
                self._served = self._record(
                    method, key, headers.get("Range"), response.status, sent
                )
                if fault == "blackhole":
                    proxy.released.wait(120)
                    self.close_connection = True
                elif fault in ("reset", "short") and method != "HEAD":
                    self.wfile.write(data[:sent])
                    self.wfile.flush()
                    if fault == "reset":
                        self.connection.setsockopt(
                            socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                        )
                    self.close_connection = True
                elif method != "HEAD":
                    view = memoryview(data)
                    for at in range(0, len(data), _PACE_BYTES):
                        proxy.pace(min(_PACE_BYTES, len(data) - at))
                        self.wfile.write(view[at : at + _PACE_BYTES])
            finally:
                upstream.close()

        def _error(self, method: str, key: str, status: int, code: str, message: str) -> None:
            body = (
                f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
                f"<Message>{message}</Message><Resource>/{key}</Resource></Error>"
            ).encode()
            self.send_response_only(status)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self._served = self._record(method, key, self.headers.get("Range"), status, 0)
            self.wfile.write(body)

        def _record(
            self,
            method: str,
            key: str,
            range_: str | None,
            status: int,
            n: int,
        ) -> Served:
            served = Served(method, key, range_, status, n)
            with proxy.lock:
                proxy.log.append(served)
            return served

        do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _forward

    return Handler


@dataclass
class S3Server:
    proxy: S3Proxy
    client: Any
    endpoint: str

    def upload(self, directory: Path, bucket: str, prefix: str) -> str:
        """Upload every file of ``directory`` (not recursive) under ``bucket/prefix``;
        returns ``s3://bucket/prefix``."""
        with contextlib.suppress(self.client.exceptions.BucketAlreadyOwnedByYou):
            self.client.create_bucket(Bucket=bucket)
        for path in sorted(Path(directory).iterdir()):
            if path.is_file():
                self.client.upload_file(str(path), bucket, f"{prefix}/{path.name}")
        return f"s3://{bucket}/{prefix}"


_server: S3Server | None = None
_lock = threading.Lock()


def s3_server() -> S3Server:
    """The session's server (started on first call; stopped at interpreter exit)."""
    global _server
    with _lock:
        if _server is None:
            _server = _start()
        return _server


def _start() -> S3Server:
    import atexit

    import boto3

    os.environ.update(s3_environment())
    moto_port = _free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(moto_port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    proxy = S3Proxy(("127.0.0.1", moto_port))
    httpd = ThreadingHTTPServer(("127.0.0.1", PROXY_PORT), _handler(proxy))
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()

    def stop() -> None:
        httpd.shutdown()
        process.terminate()
        process.wait(10)

    atexit.register(stop)
    direct = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{moto_port}")
    deadline = time.monotonic() + 30
    while True:
        try:
            direct.list_buckets()
            break
        except Exception:
            if time.monotonic() > deadline or process.poll() is not None:
                raise RuntimeError("moto's S3 server did not start") from None
            time.sleep(0.1)
    proxy.client = direct
    return S3Server(proxy, boto3.client("s3", endpoint_url=ENDPOINT), ENDPOINT)
