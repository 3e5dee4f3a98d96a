"""`observability`: what the cluster tells the outside about its requests besides metrics and logs.

Today that is tracing (OpenTelemetry, OTLP over HTTP): one trace per request from the gateway to the
engine core (raylane/tracing.py sets a process up from `TracingConfig`). Off unless an endpoint is
set here or in the standard `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` / `OTEL_EXPORTER_OTLP_ENDPOINT`.
"""

from __future__ import annotations

from pydantic import Field

from raylane.config.base import StrictModel


class TracingConfig(StrictModel):
    """OpenTelemetry traces. A field left unset takes its standard `OTEL_*` environment variable (on
    each node: the gateway's, the pools' and their engine cores' processes read their own), then
    OpenTelemetry's default; a field set here wins over the variable."""

    endpoint: str | None = Field(
        None,
        description="OTLP/HTTP traces URL, e.g. http://otel-collector:4318/v1/traces (an OpenTelemetry "
        "Collector, Jaeger or Tempo with OTLP on). Unset: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, or "
        "OTEL_EXPORTER_OTLP_ENDPOINT + /v1/traces; neither set: tracing is off and costs nothing.",
    )
    sample_ratio: float | None = Field(
        None,
        ge=0,
        le=1,
        description="Share of requests traced, by trace id (OpenTelemetry's parentbased_traceidratio: a "
        "client's `traceparent` decides for its own requests). Unset: OTEL_TRACES_SAMPLER_ARG, else 1.",
    )
    service_name: str | None = Field(
        None,
        description="The `service.name` of every span (each process adds its role as "
        "`service.instance.id`: gateway, pool replica, engine core). Unset: OTEL_SERVICE_NAME, else "
        "`raylane`.",
    )
    headers: dict[str, str] = Field(
        default_factory=dict,
        description="HTTP headers sent with each export (a collector's auth token), over "
        "OTEL_EXPORTER_OTLP_HEADERS. The config travels to Ray's GCS: prefer the environment variable "
        "for secrets.",
    )
    include_content: bool = Field(
        False,
        description="Put the prompt and completion text in spans (`gen_ai.input.messages`, "
        "`gen_ai.output.messages`). Off: spans hold counts, ids and timings, never what the client "
        "sent or got; API keys never (a key's id at most).",
    )
    export_delay_ms: int | None = Field(
        None,
        ge=1,
        description="Longest a finished span waits in its process before it is exported "
        "(BatchSpanProcessor's schedule delay). Unset: OTEL_BSP_SCHEDULE_DELAY, else 5000.",
    )


class ObservabilityConfig(StrictModel):
    """Signals about requests for outside systems."""

    tracing: TracingConfig = Field(
        default_factory=TracingConfig, description="OpenTelemetry traces (off by default)."
    )
