"""Real OTLP receivers on 127.0.0.1 for exporter tests, and endpoints that never answer.

* :class:`GrpcReceiver`: the generated ``TraceServiceServicer`` on a grpc server.
* :class:`HttpReceiver`: ``POST /v1/traces`` (OTLP/HTTP protobuf, gzip aware) on
  ``http.server``.
* :class:`BlackHole`: accepts TCP connections and never sends a byte.
* :func:`closed_port` (fixture ``unused_port``): a port with nothing listening.

Both receivers keep every ``ExportTraceServiceRequest`` and decode its spans with
``rayload.tracing.decode`` (the same code path as the driver's merge). Loaded by
``tests/tracing/conftest.py``; another test package can load the fixtures the same way
(``importlib.util.spec_from_file_location`` on this file).
"""

from __future__ import annotations

import gzip
import socket
import threading
import zlib
from collections.abc import Iterator
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace import ReadableSpan

from rayload.tracing.decode import spans_from_request


class _Received:
    """The requests a receiver got; safe to read from the test thread."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []

    def add(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        with self._lock:
            self.requests.append(request)
            self._lock.notify_all()

    def spans(self) -> list[ReadableSpan]:
        """Every span received so far, decoded with its resource."""
        with self._lock:
            requests = list(self.requests)
        return [span for request in requests for span in spans_from_request(request)]

    def wait_for_requests(self, count: int, timeout_s: float = 10.0) -> bool:
        with self._lock:
            return self._lock.wait_for(lambda: len(self.requests) >= count, timeout_s)


class GrpcReceiver(_Received):
    """An OTLP/gRPC trace receiver on an ephemeral port of 127.0.0.1."""

    def __init__(self) -> None:
        super().__init__()
        receiver = self

        class _Servicer(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(
                self,
                request: trace_service_pb2.ExportTraceServiceRequest,
                context: grpc.ServicerContext,
            ) -> trace_service_pb2.ExportTraceServiceResponse:
                receiver.add(request)
                return trace_service_pb2.ExportTraceServiceResponse()

        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Servicer(), self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()

    @property
    def endpoint(self) -> str:
        """``http://127.0.0.1:PORT``: plaintext gRPC, as ``--otlp-endpoint`` takes it."""
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self._server.stop(grace=None)


class HttpReceiver(_Received):
    """An OTLP/HTTP (protobuf) trace receiver at ``http://127.0.0.1:PORT/v1/traces``."""

    def __init__(self) -> None:
        super().__init__()
        receiver = self

        class _Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                if self.path != "/v1/traces":
                    self.send_error(404, "OTLP traces are served at /v1/traces")
                    return
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                encoding = self.headers.get("Content-Encoding", "")
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding == "deflate":
                    body = zlib.decompress(body)
                request = trace_service_pb2.ExportTraceServiceRequest()
                request.ParseFromString(body)
                receiver.add(request)
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, format: str, *args: object) -> None:
                """Keep test output quiet."""

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1/traces"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


class BlackHole:
    """Accepts connections on 127.0.0.1 and never answers: the stalled-collector case."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._held: list[socket.socket] = []
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        self._listener.settimeout(0.1)
        while not self._stopped.is_set():
            try:
                connection, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self._held.append(connection)

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=5)
        for connection in self._held:
            connection.close()
        self._listener.close()


def closed_port() -> int:
    """A port of 127.0.0.1 that nothing listens on (bound, then released)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def otlp_grpc_receiver() -> Iterator[GrpcReceiver]:
    receiver = GrpcReceiver()
    yield receiver
    receiver.stop()


@pytest.fixture
def otlp_http_receiver() -> Iterator[HttpReceiver]:
    receiver = HttpReceiver()
    yield receiver
    receiver.stop()


@pytest.fixture
def unused_port() -> int:
    return closed_port()


@pytest.fixture
def black_hole() -> Iterator[BlackHole]:
    hole = BlackHole()
    yield hole
    hole.stop()
