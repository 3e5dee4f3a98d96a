"""One structured JSON log line per request, written when the response's last byte is sent.

`RequestLogMiddleware` (pure ASGI, so streams pass through untouched) opens a `RequestRecord`
(deployments/gateway/request_record.py) per HTTP request and makes it `current_record()` for the
handler and the stream it returns. It fills the record from what the response says (status,
`x-raylane-route` / `-pool` / `-tier` / `-fallback` headers, a 429's error code); the pool's
`RequestSummary`, relayed by the gateway with `note_summary`, adds tokens, TTFT and finish reason.
At completion the record goes to the gateway's metrics and to the log.

The request id is the `x-request-id` header: Ray Serve's proxy keeps the client's or makes one, and
echoes it on the response (so the handler's own `x-request-id` header is dropped here, or the client
would see two). The engine's id stays the gateway's own uuid, since a client's id need not be unique.

With tracing on (`observability.tracing`, raylane/tracing.py) the middleware also opens the
request's root span (deployments/gateway/spans.py), continuing the client's `traceparent`, ends it
when the response's last byte is sent, and puts its ids in the response (`x-raylane-trace-id`,
`traceparent`) and in the line (`trace_id`).

A line never holds the prompt, the completion or the API key. `RAYLANE_LOG_PROMPTS=1` adds the
request's `messages` / `prompt` (debugging only). Lines go to `RAYLANE_REQUEST_LOG` (a file path,
`stderr`, or `off`); by default to `raylane_requests_<pid>.jsonl` in Ray Serve's log folder
(/tmp/ray/session_latest/logs/serve/), next to the replica logs that log shippers already collect.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

from raylane import tracing
from raylane.deployments.gateway.request_record import CURRENT, RequestRecord
from raylane.deployments.metrics.gateway import gateway_metrics

REQUEST_ID_HEADER = "x-request-id"
TRACE_ID_HEADER = "x-raylane-trace-id"
CLIENT_CLOSED = 499  # the status of a request whose client went away before the response began
MAX_PROMPT_BODY = 1 << 20  # with RAYLANE_LOG_PROMPTS, bodies larger than this are not logged
# x-raylane-<field> -> RequestRecord
HEADER_FIELDS = ("route", "pool", "tier", "fallback", "decision", "adapter")


def log_prompts_enabled() -> bool:
    return os.environ.get("RAYLANE_LOG_PROMPTS", "").lower() in ("1", "true", "yes")


# -- the sink ------------------------------------------------------------------------------------


def default_log_path() -> str:
    try:
        from ray.serve._private.logging_utils import get_serve_logs_dir

        folder = get_serve_logs_dir()
    except Exception:  # not in a Ray worker
        folder = "/tmp/ray/session_latest/logs/serve"
    return os.path.join(folder, f"raylane_requests_{os.getpid()}.jsonl")


def request_logger() -> logging.Logger:
    """`raylane.requests`: message-only lines to the configured sink (set up once per process)."""
    logger = logging.getLogger("raylane.requests")
    if getattr(logger, "_raylane_configured", False):
        return logger
    target = os.environ.get("RAYLANE_REQUEST_LOG", "")
    if target.lower() == "off":
        handler: logging.Handler = logging.NullHandler()
    elif target.lower() in ("stderr", "stdout"):
        handler = logging.StreamHandler(getattr(sys, target.lower()))
    else:
        path = target or default_log_path()
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    logger._raylane_configured = True  # type: ignore[attr-defined]
    return logger


def write(record: RequestRecord) -> None:
    request_logger().info(record.to_json(include_prompt=log_prompts_enabled()))


# -- the middleware ------------------------------------------------------------------------------


class RequestLogMiddleware:
    """ASGI middleware: a `RequestRecord` per HTTP request, finished by `on_complete(record)`.

    Only paths under `log_prefix` are logged and counted (not /metrics scrapes, not health probes).
    """

    def __init__(
        self,
        app,
        on_complete: Callable[[RequestRecord], None] | None = None,
        log_prefix: str | tuple[str, ...] = ("/v1/", "/tokenize", "/detokenize"),
    ):
        self.app = app
        self.on_complete = on_complete or _default_complete
        self.log_prefix = log_prefix

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not _app_path(scope).startswith(self.log_prefix):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        given = headers.get(REQUEST_ID_HEADER)
        record = RequestRecord(
            request_id=given or uuid.uuid4().hex, method=scope["method"], path=scope["path"]
        )
        capture_prompt = log_prompts_enabled()
        body = bytearray()

        async def receive_wrapper():
            message = await receive()
            if capture_prompt and message["type"] == "http.request" and len(body) < MAX_PROMPT_BODY:
                body.extend(message.get("body", b""))
            return message

        async def send_wrapper(message) -> None:
            if message["type"] == "http.response.start":
                message = self._on_start(record, message, echo_id=given is None)
            elif (
                message["type"] == "http.response.body" and record.status == 429 and record.error_code is None
            ):
                self._on_error_body(record, message.get("body", b""))
            await send(message)

        token = CURRENT.set(record)
        span_token = _open_span(record, scope, headers) if tracing.enabled() else None
        try:
            await self.app(scope, receive_wrapper if capture_prompt else receive, send_wrapper)
        except BaseException as e:
            # Serve cancels the handler when its client hangs up: before a response began that is the
            # client's doing (nginx's 499, "client closed request"), not a server error on the 5xx
            # rate an on-call watches.
            record.status = record.status or (CLIENT_CLOSED if _client_went_away(e) else 500)
            raise
        finally:
            CURRENT.reset(token)
            record.latency_s = time.monotonic() - record.started
            route = scope.get("route")
            record.endpoint = getattr(route, "path", None) or "other"
            if record.span is not None:
                tracing.detach(span_token)
                _close_span(record)
            if capture_prompt:
                record.prompt = _prompt_of(bytes(body))
            try:
                self.on_complete(record)
            except Exception:
                logging.getLogger(__name__).exception("request log failed")

    @staticmethod
    def _on_start(record: RequestRecord, message: dict, echo_id: bool) -> dict:
        record.status = message["status"]
        raw = [(k, v) for k, v in message.get("headers", []) if k.lower() != REQUEST_ID_HEADER.encode()]
        for key, value in raw:
            name = key.decode("latin-1").lower()
            if name.startswith("x-raylane-"):
                attr = name.removeprefix("x-raylane-")
                if attr in HEADER_FIELDS and getattr(record, attr) is None:
                    setattr(record, attr, value.decode("latin-1") or None)
        if echo_id:  # behind Serve's proxy the header arrives and the proxy echoes it
            raw.append((REQUEST_ID_HEADER.encode(), record.request_id.encode("latin-1")))
        if record.trace_id is not None:
            raw.append((TRACE_ID_HEADER.encode(), record.trace_id.encode()))
            raw.append((b"traceparent", tracing.traceparent(record.span).encode()))
        return {**message, "headers": raw}

    @staticmethod
    def _on_error_body(record: RequestRecord, body: bytes) -> None:
        try:
            record.error_code = json.loads(body)["error"]["code"]
        except (ValueError, KeyError, TypeError):
            return
        if record.error_code == "overloaded":  # the router's load shedding (rate limits are not)
            record.shed = True


def _open_span(record: RequestRecord, scope, headers: dict[str, str]) -> Any:
    """Start the request's root span, current for the handler and its stream: a child of the client's
    `traceparent` if it sent one, else a new trace (sampled by `sample_ratio`)."""
    carrier = {k: headers[k] for k in ("traceparent", "tracestate") if k in headers}
    span = tracing.start(
        f"{record.method} {_app_path(scope)}",
        parent=carrier or None,
        kind="server",
        attributes={
            "http.request.method": record.method,
            "url.path": _app_path(scope),
            "raylane.request_id": record.request_id,
        },
    )
    record.span, record.trace_id = span, tracing.trace_id(span)
    return tracing.attach(span)


def _close_span(record: RequestRecord) -> None:
    """End the root span with what the response said (the record is complete by now)."""
    span = record.span
    if record.endpoint != "other":
        span.update_name(f"{record.method} {record.endpoint}")
    attributes = {
        "http.route": record.endpoint,
        "http.response.status_code": record.status,
        "raylane.route": record.route,
        "raylane.pool": record.pool,
        "raylane.tier": record.tier,
        "raylane.fallback": record.fallback,
        "raylane.route.decision": record.decision,
        "raylane.adapter": record.adapter,
        "raylane.resumptions": len(record.resumptions) or None,
        "raylane.error_code": record.error_code,
        "gen_ai.usage.input_tokens": record.prompt_tokens,
        "gen_ai.usage.output_tokens": record.completion_tokens,
        "gen_ai.response.finish_reasons": record.finish_reason.split(",") if record.finish_reason else None,
    }
    error = f"HTTP {record.status}" if record.status is None or record.status >= 500 else None
    tracing.end(span, error=error, **attributes)


def _client_went_away(error: BaseException) -> bool:
    return isinstance(error, asyncio.CancelledError) or type(error).__name__ == "RequestCancelledError"


def _app_path(scope) -> str:
    """The path below the app's route prefix (Serve mounts an app at its `route_prefix`)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


def _prompt_of(body: bytes) -> Any:
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    return data.get("messages", data.get("prompt", data.get("input")))


def _default_complete(record: RequestRecord) -> None:
    gateway_metrics().observe(record)
    write(record)
