"""OpenTelemetry tracing in one process: set up once, then spans that cost nothing while it is off.

Every process a request crosses (the gateway replica, the pool replica, the engine core process)
calls `configure` with the cluster's `observability.tracing` fields (config/observability.py) as a
dict: this module imports nothing of raylane, so every part may import it. Without an endpoint
(there or in `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` / `OTEL_EXPORTER_OTLP_ENDPOINT`) tracing stays off:
OpenTelemetry is not even imported, `span()` hands back one shared no-op context, `start()` None,
and callers test `enabled()` or the None before doing any work for a span.

The process keeps its own `TracerProvider` (OTLP over HTTP behind a `BatchSpanProcessor`, sampled
by `ParentBased(TraceIdRatioBased)`), not OpenTelemetry's global one, which Ray or a user's code may
own. Context crosses processes as a W3C carrier, a plain dict with `traceparent` (and `tracestate`):
`carrier(span)` writes it, `context_of(carrier)` reads it (TraceContextTextMapPropagator).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from typing import Any

_tracer: Any = None  # the process's Tracer once configured with an endpoint; None: off
_settings: dict[str, Any] | None = None  # what it was configured with (handed to an engine core)
_provider: Any = None
_instance = ""  # this process's `service.instance.id`
_NOOP = contextlib.nullcontext()

# Span kinds by name, so callers need not import OpenTelemetry.
KINDS = ("internal", "server", "client")


def configure(settings: Mapping[str, Any] | None, instance: str, exporter: Any = None) -> bool:
    """Set this process up from a `TracingConfig`'s fields (`settings`; None: only the `OTEL_*`
    variables), naming it `instance` (`service.instance.id`: its role and replica). Whether tracing
    is on. The first call that turns it on wins: a process has one exporter. `exporter`: a span
    exporter to use instead of OTLP (tests), which turns tracing on without an endpoint."""
    global _tracer, _settings, _provider, _instance
    if _tracer is not None:
        return True
    settings = dict(settings or {})
    endpoint = _endpoint(settings.get("endpoint"))
    if exporter is None and (endpoint is None or _disabled_by_env()):
        return False
    if exporter is None:
        exporter = _otlp_exporter(endpoint, settings.get("headers"))
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    ratio = settings.get("sample_ratio")
    if ratio is None:
        ratio = float(os.environ.get("OTEL_TRACES_SAMPLER_ARG", "1") or 1)
    service = settings.get("service_name") or os.environ.get("OTEL_SERVICE_NAME") or "raylane"
    resource = Resource.create(
        {"service.name": service, "service.instance.id": instance, "process.pid": os.getpid()}
    )
    delay = settings.get("export_delay_ms") or float(os.environ.get("OTEL_BSP_SCHEDULE_DELAY", "5000"))
    _provider = TracerProvider(sampler=ParentBased(TraceIdRatioBased(ratio)), resource=resource)
    _provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=delay))
    _tracer = _provider.get_tracer("raylane")
    _settings = settings | {"endpoint": endpoint} if endpoint else settings
    _instance = instance
    return True


def _otlp_exporter(endpoint: str, headers: Mapping[str, str] | None) -> Any:
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError:
        raise RuntimeError(
            "observability.tracing is on but the OTLP exporter is not installed: "
            "pip install 'raylane[tracing]' (opentelemetry-exporter-otlp-proto-http)"
        ) from None
    # The config's headers go over OTEL_EXPORTER_OTLP_(TRACES_)HEADERS, which the exporter reads.
    return OTLPSpanExporter(endpoint=endpoint, headers=dict(headers) if headers else None)


def _endpoint(configured: str | None) -> str | None:
    if configured:
        return configured
    if traces := os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return traces
    if base := os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return f"{base.removesuffix('/')}/v1/traces"
    return None


def _disabled_by_env() -> bool:
    return (
        os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"
        or os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none"
    )


def enabled() -> bool:
    return _tracer is not None


def settings() -> dict[str, Any] | None:
    """The settings this process traces with (None: off), for a child process to take."""
    return _settings


def instance() -> str:
    """This process's `service.instance.id` ("" while off): a child process names itself after it."""
    return _instance


def include_content() -> bool:
    """Whether spans may hold prompt and completion text (`tracing.include_content`)."""
    return bool(_settings and _settings.get("include_content"))


def flush(timeout_ms: int = 5000) -> None:
    """Export what has ended (a process about to exit)."""
    if _provider is not None:
        _provider.force_flush(timeout_ms)


def shutdown() -> None:
    """Flush and stop exporting (the engine core process's last act); tracing is off after it."""
    global _tracer, _settings, _provider, _instance
    if _provider is not None:
        _provider.shutdown()
    _tracer = _settings = _provider = None
    _instance = ""


# -- spans -----------------------------------------------------------------------------------------


def start(
    name: str,
    parent: Any = None,
    kind: str = "internal",
    attributes: Mapping[str, Any] | None = None,
    start_ns: int | None = None,
) -> Any:
    """A started span (end it with `end`), child of `parent` (a span, a carrier dict, or None: the
    current context); None while tracing is off."""
    if _tracer is None:
        return None
    from opentelemetry.trace import SpanKind

    return _tracer.start_span(
        name,
        context=_context(parent),
        kind=SpanKind[kind.upper()],
        attributes=_clean(attributes),
        start_time=start_ns,
    )


@contextlib.contextmanager
def _current(name: str, kind: str, attributes: Mapping[str, Any] | None) -> Iterator[Any]:
    from opentelemetry import trace

    with _tracer.start_as_current_span(
        name, kind=trace.SpanKind[kind.upper()], attributes=_clean(attributes)
    ) as span:
        yield span


def span(name: str, kind: str = "internal", **attributes: Any):
    """A context manager: a child of the current span, current while it is open (it records an
    exception that leaves it). Yields the span, or None while tracing is off or the request is not
    sampled (no span is made for an unsampled request's steps)."""
    if _tracer is None or not recording(current()):
        return _NOOP
    return _current(name, kind, attributes)


def end(span: Any, error: str | None = None, end_ns: int | None = None, **attributes: Any) -> None:
    """End `span` (None: nothing), with `attributes` and, given `error`, an error status."""
    if span is None:
        return
    if attributes:
        span.set_attributes(_clean(attributes))
    if error is not None:
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, error))
    span.end(end_time=end_ns)


def set_attributes(span: Any, **attributes: Any) -> None:
    if span is not None:
        span.set_attributes(_clean(attributes))


def event(span: Any, name: str, timestamp_ns: int | None = None, **attributes: Any) -> None:
    if span is not None:
        span.add_event(name, _clean(attributes), timestamp=timestamp_ns)


def current() -> Any:
    """The current span (None while tracing is off)."""
    if _tracer is None:
        return None
    from opentelemetry import trace

    return trace.get_current_span()


def recording(span: Any) -> bool:
    return span is not None and span.is_recording()


def attach(span: Any) -> Any:
    """Make `span` current in this context; the token for `detach` (None for no span)."""
    if span is None:
        return None
    from opentelemetry import context, trace

    return context.attach(trace.set_span_in_context(span))


def detach(token: Any) -> None:
    if token is not None:
        from opentelemetry import context

        context.detach(token)


# -- crossing processes ------------------------------------------------------------------------------


def carrier(span: Any = None) -> dict[str, str] | None:
    """The W3C carrier (`traceparent`, `tracestate`) of `span` (None: the current span), for the next
    process to continue; None when off or when the span records nothing (an unsampled request: the
    processes after this one then make no spans either)."""
    span = span if span is not None else current()
    if not recording(span):
        return None
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    out: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(out, context=trace.set_span_in_context(span))
    return out


def context_of(carrier: Mapping[str, str] | None) -> Any:
    """The context a W3C carrier (a client's headers, a `PoolRequest`'s) continues; None: a new trace."""
    if _tracer is None or not carrier:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract(carrier)


def _context(parent: Any) -> Any:
    if parent is None:
        return None  # the current context
    if isinstance(parent, Mapping):
        return context_of(parent)
    from opentelemetry import trace

    return trace.set_span_in_context(parent)


def trace_id(span: Any) -> str | None:
    """The span's trace id as 32 hex digits (None for no span or an invalid one)."""
    if span is None:
        return None
    context = span.get_span_context()
    return format(context.trace_id, "032x") if context.is_valid else None


def traceparent(span: Any) -> str | None:
    """The W3C `traceparent` value of `span`, for a response header."""
    if span is None:
        return None
    context = span.get_span_context()
    if not context.is_valid:
        return None
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


def _clean(attributes: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Attributes without the None values (OpenTelemetry drops them with a warning each)."""
    if not attributes:
        return None
    return {k: v for k, v in attributes.items() if v is not None}
