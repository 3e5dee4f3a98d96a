"""A real OTLP/HTTP trace receiver, for the tracing tests and `raylane bench cold-path`: POST
/v1/traces with an ExportTraceServiceRequest (protobuf, as OpenTelemetry's OTLP/HTTP exporter sends
it), parsed with `opentelemetry-proto` (the `tracing` extra) into `ReceivedSpan`s to wait for and walk."""

from __future__ import annotations

import gzip
import threading
import time
import zlib
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass
class ReceivedSpan:
    trace_id: str  # 32 hex digits
    span_id: str
    parent_span_id: str  # "" for a root
    name: str
    kind: int
    attributes: dict[str, Any]
    events: list[tuple[str, dict[str, Any]]]
    resource: dict[str, Any]  # service.name, service.instance.id, process.pid
    start_ns: int
    end_ns: int
    status_code: int = 0  # 2: error
    links: list = field(default_factory=list)

    @property
    def instance(self) -> str:
        return str(self.resource.get("service.instance.id", ""))


def _value(v) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind) if kind else None


def _attributes(kvs) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


class OtlpReceiver:
    """Listens on 127.0.0.1 (a free port) until `close`; `endpoint` is the URL to export to."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.requests = 0
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                encoding = self.headers.get("content-encoding", "")
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding == "deflate":
                    body = zlib.decompress(body)
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                receiver._take(ExportTraceServiceRequest.FromString(body))
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def _take(self, request: ExportTraceServiceRequest) -> None:
        spans = []
        for resource_spans in request.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    spans.append(
                        ReceivedSpan(
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_span_id=s.parent_span_id.hex(),
                            name=s.name,
                            kind=s.kind,
                            attributes=_attributes(s.attributes),
                            events=[(e.name, _attributes(e.attributes)) for e in s.events],
                            resource=resource,
                            start_ns=s.start_time_unix_nano,
                            end_ns=s.end_time_unix_nano,
                            status_code=s.status.code,
                        )
                    )
        with self._lock:
            self.requests += 1
            self.spans.extend(spans)

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(
        self, trace_id: str, predicate, timeout_s: float = 60, what: str = "spans"
    ) -> list[ReceivedSpan]:
        """The trace's spans once `predicate(spans)` holds; TimeoutError naming `what` otherwise."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.trace(trace_id)
            if predicate(spans):
                return spans
            if time.monotonic() > deadline:
                names = sorted(f"{s.name}@{s.instance}" for s in spans)
                raise TimeoutError(f"{what} of trace {trace_id} not received; got {names}")
            time.sleep(0.1)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
