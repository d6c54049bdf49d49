"""A simulated worker's own SERVER span, exported with the OpenTelemetry SDK.

Theory of operation
-------------------
Export is on only when an endpoint is known: ``--otlp-endpoint`` (a base URL like
``http://127.0.0.1:4318``) or the standard ``OTEL_EXPORTER_OTLP_ENDPOINT`` /
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``; otherwise ``make_tracer`` returns None and
nothing is ever exported. The protocol comes from ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``
or ``OTEL_EXPORTER_OTLP_PROTOCOL`` (``http/protobuf`` by default, or ``grpc``); the
exporters read every other ``OTEL_*`` variable themselves. Each worker has its own
``TracerProvider`` (never the global one), so two workers in one process keep their
own service name. A span is started only for a request that carries a valid
``traceparent``: it is that span's child, named ``sglang.<role>``.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer, get_current_span
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

if TYPE_CHECKING:
    from .generation import Job

_PROPAGATOR = TraceContextTextMapPropagator()


def configured_endpoint(explicit: str | None) -> str | None:
    return (explicit or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
            or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or None)


def _exporter(explicit: str | None):
    protocol = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf")
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=explicit) if explicit else OTLPSpanExporter()
    if protocol != "http/protobuf":
        raise ValueError(f"unsupported OTLP protocol {protocol!r} (use http/protobuf or grpc)")
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    # Given explicitly the HTTP exporter takes the full URL; from the environment it
    # appends /v1/traces to OTEL_EXPORTER_OTLP_ENDPOINT itself.
    return OTLPSpanExporter(endpoint=f"{explicit.rstrip('/')}/v1/traces") if explicit else OTLPSpanExporter()


class WorkerTracing:
    def __init__(self, role: str, provider: TracerProvider) -> None:
        self.role = role
        self.provider = provider
        self.tracer: Tracer = provider.get_tracer("traceproxy.sim")

    def start(self, headers: Mapping[str, str], attributes: dict) -> Span | None:
        """A SERVER span under the request's ``traceparent``, or None without a valid one."""
        carrier = {k: v for k, v in headers.items() if k in ("traceparent", "tracestate")}
        context = _PROPAGATOR.extract(carrier)
        if not get_current_span(context).get_span_context().is_valid:
            return None
        return self.tracer.start_span(f"sglang.{self.role}", context=context, kind=SpanKind.SERVER,
                                      attributes=attributes)

    async def shutdown(self) -> None:
        # shutdown() flushes over the network: off the event loop.
        await asyncio.to_thread(self.provider.shutdown)


def make_tracing(role: str, explicit_endpoint: str | None) -> WorkerTracing | None:
    if configured_endpoint(explicit_endpoint) is None:
        return None
    service = os.environ.get("OTEL_SERVICE_NAME") or f"sim-sglang-{role}"
    provider = TracerProvider(resource=Resource.create({"service.name": service, "sglang.role": role}))
    provider.add_span_processor(BatchSpanProcessor(_exporter(explicit_endpoint), schedule_delay_millis=200))
    return WorkerTracing(role, provider)


def request_span(tracing: WorkerTracing, job: "Job") -> Span | None:
    """The worker's span for ``job``, or None when the request carries no trace context."""
    headers = job.request.headers
    attributes = {"http.request.method": "POST", "url.path": job.path, "sglang.rid": job.reply.rid,
                  "sglang.role": tracing.role, "gen_ai.request.model": job.reply.model,
                  "gen_ai.usage.input_tokens": job.reply.prompt_tokens}
    if job.room is not None:
        attributes["sglang.bootstrap_room"] = job.room
    if headers.get("x-request-id"):
        attributes["sglang.request_id"] = headers["x-request-id"]
    if job.faults:
        attributes["sim.faults"] = ",".join(str(f) for f in job.faults.values())
    return tracing.start(headers, attributes)


def end_request_span(span: Span | None, job: "Job") -> None:
    if span is None:
        return
    for name in job.events:
        span.add_event(name)
    span.set_attribute("gen_ai.usage.output_tokens", job.tokens)
    span.set_attribute("http.response.status_code", job.status)
    span.set_attribute("sim.result", job.result)
    if job.result != "ok":
        span.set_status(Status(StatusCode.ERROR, job.result))
    span.end()
