"""OpenTelemetry traces: one SERVER span per generation request, after the GenAI semantic conventions.

The server owns its TracerProvider (never installed as the global one): it exports over OTLP/gRPC when
an endpoint is configured (`--otlp-endpoint` or `OTEL_EXPORTER_OTLP_ENDPOINT`) and exports nothing
otherwise. The caller's W3C trace context (`traceparent` / `tracestate` gRPC metadata) is the parent of
each request's span. A span starts when the request arrives and ends when the request ends: for
AddRequest that is long after the unary call returned.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from cbserve_client.proto import types_pb2
from opentelemetry import propagate
from opentelemetry.context import Context
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer

from engine import FinishReason, RequestStatus

if TYPE_CHECKING:
    from service.sequence_group import SequenceGroup

logger = logging.getLogger(__name__)

SERVICE = "cbserve"
INSTRUMENTATION_SCOPE = "cbserve.service"
# Environment variables that turn OTLP export on (the exporter reads them itself too).
OTLP_ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")

# GenAI semantic convention names.
OPERATION_NAME = "gen_ai.operation.name"
REQUEST_MODEL = "gen_ai.request.model"
REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
REQUEST_TEMPERATURE = "gen_ai.request.temperature"
REQUEST_TOP_P = "gen_ai.request.top_p"
REQUEST_TOP_K = "gen_ai.request.top_k"
REQUEST_SEED = "gen_ai.request.seed"
REQUEST_STOP_SEQUENCES = "gen_ai.request.stop_sequences"
REQUEST_PRESENCE_PENALTY = "gen_ai.request.presence_penalty"
REQUEST_FREQUENCY_PENALTY = "gen_ai.request.frequency_penalty"
RESPONSE_ID = "gen_ai.response.id"
RESPONSE_MODEL = "gen_ai.response.model"
RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
USAGE_CACHE_READ_INPUT_TOKENS = "gen_ai.usage.cache_read.input_tokens"
ERROR_TYPE = "error.type"
OPERATION_CHAT = "chat"
OPERATION_TEXT_COMPLETION = "text_completion"
EVENT_QUEUED = "queued"
EVENT_SCHEDULED = "scheduled"
EVENT_FIRST_TOKEN = "first_token"

# The engine's finish reasons as the conventions spell them ("stop": the model ended the text itself).
FINISH_REASONS = {
    FinishReason.EOS: "stop",
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.CANCELLED: "cancelled",
    FinishReason.ERROR: "error",
}


def otlp_endpoint_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    environ = os.environ if environ is None else environ
    return next((environ[name] for name in OTLP_ENDPOINT_VARIABLES if environ.get(name)), None)


def build_tracer_provider(otlp_endpoint: str | None = None) -> TracerProvider:
    """The server's own provider (resource `service.name=cbserve`), never made the global one.

    Spans go to an OTLP/gRPC exporter through a BatchSpanProcessor when `otlp_endpoint` is given or the
    OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT environment variable is set; otherwise no processor is added and
    nothing is exported.
    """
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: SERVICE}))
    if otlp_endpoint or otlp_endpoint_from_env():
        # Imported only when used: the exporter pulls in a gRPC client stack of its own.
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_endpoint or None)))
        logger.info("exporting traces over OTLP to %s", otlp_endpoint or otlp_endpoint_from_env())
    return provider


def parent_context(metadata: Iterable[tuple[str, Any]] | None) -> Context:
    """The caller's trace context, extracted from gRPC invocation metadata with the global propagator
    (W3C TraceContext and Baggage unless OTEL_PROPAGATORS says otherwise)."""
    carrier: dict[str, str] = {}
    for key, value in metadata or ():
        if isinstance(value, str):  # binary (-bin) metadata carries no trace context
            carrier[key.lower()] = value
    try:
        return propagate.extract(carrier, context=Context())
    except Exception:  # a malformed header must never fail the request
        logger.debug("ignoring unreadable trace context", exc_info=True)
        return Context()


def float32(value: float) -> float:
    """A proto float field as the caller wrote it (0.7, not 0.699999988079071)."""
    return float(f"{value:.7g}")


class RequestTracer:
    """Starts the span of each generation request."""

    def __init__(self, provider: TracerProvider) -> None:
        self.provider = provider
        self.tracer: Tracer = provider.get_tracer(INSTRUMENTATION_SCOPE)

    def start(self, requested: Mapping[str, Any], model: str, parent: Context) -> RequestSpan:
        """The span of a request that just arrived; `requested` holds the operation and what the caller
        asked for (`span_attributes` of cbserve's request, or its twin for the gateways' protocol)."""
        attributes = {**requested, REQUEST_MODEL: model}
        span = self.tracer.start_span(
            f"{requested[OPERATION_NAME]} {model}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes=attributes,
        )
        return RequestSpan(span, model)


def span_attributes(request: types_pb2.GenerationRequest) -> dict[str, Any]:
    """What the caller of cbserve's GenerationService asked for, as the request's span records it."""
    chat = request.WhichOneof("prompt") == "messages"
    attributes: dict[str, Any] = {OPERATION_NAME: OPERATION_CHAT if chat else OPERATION_TEXT_COMPLETION}
    params = request.sampling
    if params.HasField("max_new_tokens"):
        attributes[REQUEST_MAX_TOKENS] = params.max_new_tokens
    if params.HasField("temperature"):
        attributes[REQUEST_TEMPERATURE] = float32(params.temperature)
    if params.HasField("top_p"):
        attributes[REQUEST_TOP_P] = float32(params.top_p)
    if params.HasField("top_k"):
        attributes[REQUEST_TOP_K] = params.top_k
    if params.HasField("seed"):
        attributes[REQUEST_SEED] = params.seed
    if params.stop:
        attributes[REQUEST_STOP_SEQUENCES] = list(params.stop)
    if params.HasField("presence_penalty"):
        attributes[REQUEST_PRESENCE_PENALTY] = float32(params.presence_penalty)
    if params.HasField("frequency_penalty"):
        attributes[REQUEST_FREQUENCY_PENALTY] = float32(params.frequency_penalty)
    return attributes


def _nanoseconds(seconds: float) -> int:
    return int(seconds * 1e9)


class RequestSpan:
    """One request's span: `reject` ends it for a request refused before the engine saw it, `attach`
    follows the queued request's record until it ends. Tracing errors are logged, never raised."""

    def __init__(self, span: Span, model: str) -> None:
        self.span = span
        self.model = model
        self._scheduled = False
        self._first_token = False
        self._ended = False

    def reject(self, code_name: str, message: str) -> None:
        if self._ended:
            return
        self._ended = True
        self.span.set_attribute(ERROR_TYPE, code_name)
        self.span.set_status(Status(StatusCode.ERROR, message))
        self.span.end()

    def attach(self, group: SequenceGroup) -> None:
        """Follows the request's sequences (on the event loop) and ends the span when the last ends: its
        events are the first sequence scheduled and the first token of any, its usage counts every
        sequence's tokens, and its finish reasons are each sequence's, in index order."""
        self.span.set_attributes(
            {
                RESPONSE_ID: group.request_id,
                RESPONSE_MODEL: self.model,
                USAGE_INPUT_TOKENS: group.prompt_len,
            }
        )
        self.span.add_event(EVENT_QUEUED, timestamp=_nanoseconds(group.queued_at))
        group.add_listener(self.update)
        self.update(group)

    def update(self, group: SequenceGroup) -> None:
        if self._ended:
            return
        scheduled = [record.scheduled_at for record in group.records if record.scheduled_at is not None]
        if scheduled and not self._scheduled:
            self._scheduled = True
            self.span.add_event(EVENT_SCHEDULED, timestamp=_nanoseconds(min(scheduled)))
        first_tokens = [
            record.first_token_at for record in group.records if record.first_token_at is not None
        ]
        if first_tokens and not self._first_token:
            self._first_token = True
            self.span.add_event(EVENT_FIRST_TOKEN, timestamp=_nanoseconds(min(first_tokens)))
        if group.finished:
            self._finish(group)

    def _finish(self, group: SequenceGroup) -> None:
        self._ended = True
        records = group.records
        self.span.set_attributes(
            {
                USAGE_OUTPUT_TOKENS: group.num_generated_tokens,
                USAGE_CACHE_READ_INPUT_TOKENS: records[0].num_cached_tokens,
                RESPONSE_FINISH_REASONS: [
                    FINISH_REASONS[record.finish_reason or FinishReason.ERROR] for record in records
                ],
            }
        )
        failed = [record for record in records if record.status == RequestStatus.FAILED]
        if failed:
            self.span.set_attribute(ERROR_TYPE, "INTERNAL")
            self.span.set_status(Status(StatusCode.ERROR, failed[0].error or "the request failed"))
        ends = [record.finished_at for record in records if record.finished_at is not None]
        end = max(ends) if ends else time.time()
        self.span.end(end_time=_nanoseconds(end))
