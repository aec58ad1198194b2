"""Request spans: one SERVER span per request after the GenAI conventions, parented to the caller's span.

The server gets a TracerProvider with an in-memory exporter; the client side has its own provider (neither
is the global one) and the SDK sends the current span's W3C trace context as gRPC metadata.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
import torch
from cbserve_client import AdminClient, Client
from cbserve_client.errors import InvalidArgumentError
from cbserve_client.proto import generation_pb2, generation_pb2_grpc, types_pb2
from opentelemetry import propagate, trace
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from service import tracing
from tests.helpers.servers import ADMIN_TOKEN, ByteTokenizer, RunningServer, wait_until

EVENTS = ["queued", "scheduled", "first_token"]


class ChatByteTokenizer(ByteTokenizer):
    """ByteTokenizer plus a trivial chat template, so chat prompts can be traced too."""

    chat_template = "<role>content"

    def apply_chat_template(self, messages: list[dict[str, str]], **kwargs: Any) -> dict[str, list[int]]:
        rendered = "".join(f"<{message['role']}>{message['content']}" for message in messages)
        return {"input_ids": list(rendered.encode())}


@pytest.fixture(scope="module")
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture(scope="module")
def traced(model: torch.nn.Module, exporter: InMemorySpanExporter) -> Iterator[RunningServer]:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    running = RunningServer(model, tokenizer=ChatByteTokenizer(), tracer_provider=provider)
    try:
        running.load()
        yield running
    finally:
        running.close()
        provider.shutdown()


@pytest.fixture
def spans(exporter: InMemorySpanExporter) -> InMemorySpanExporter:
    exporter.clear()
    return exporter


@pytest.fixture(scope="module")
def client_tracer() -> Iterator[trace.Tracer]:
    """The caller's tracer: an SDK provider of its own (so spans have real ids), not the global one."""
    provider = TracerProvider()
    yield provider.get_tracer("cbserve-tests-client")
    provider.shutdown()


@pytest.fixture
def client(traced: RunningServer) -> Iterator[Client]:
    with Client(traced.target, timeout=30) as connected:
        yield connected


def _children(exporter: InMemorySpanExporter, parent: trace.Span, count: int) -> list[ReadableSpan]:
    """The `count` server spans whose parent is `parent` (waits for them to end), checking their trace."""
    parent_context = parent.get_span_context()

    def found() -> list[ReadableSpan]:
        return [
            span
            for span in exporter.get_finished_spans()
            if span.parent is not None and span.parent.span_id == parent_context.span_id
        ]

    wait_until(lambda: len(found()) >= count, timeout=20, what=f"{count} server span(s)")
    time.sleep(0.05)  # a span too many would show up now
    children = found()
    assert len(children) == count
    for span in children:
        assert span.kind == SpanKind.SERVER
        assert span.parent is not None and span.parent.is_remote
        assert span.context.trace_id == parent_context.trace_id
    return children


def _by_id(spans: list[ReadableSpan]) -> dict[str, ReadableSpan]:
    return {str(span.attributes["gen_ai.response.id"]): span for span in spans}  # type: ignore[index]


def _event_names(span: ReadableSpan) -> list[str]:
    return [event.name for event in span.events]


def _check_events(span: ReadableSpan, names: list[str]) -> None:
    assert _event_names(span) == names
    stamps = [event.timestamp for event in span.events]
    assert stamps == sorted(stamps)
    assert span.end_time is not None and stamps[-1] <= span.end_time


def test_generate_makes_one_span_with_the_genai_attributes(
    client: Client, spans: InMemorySpanExporter, client_tracer: trace.Tracer
) -> None:
    with client_tracer.start_as_current_span("caller") as caller:
        first = client.generate("Hello", max_new_tokens=5, ignore_eos=True, temperature=0.0, top_k=7)
        # The first token as the only EOS id: the second request ends after one token, by EOS.
        stopped = client.generate("Hello", max_new_tokens=5, eos_token_ids=[first.token_ids[0]])
    by_id = _by_id(_children(spans, caller, 2))
    assert first.finish_reason == "length" and stopped.finish_reason == "eos"

    span = by_id[first.request_id]
    assert span.name == "text_completion tiny"
    assert span.status.status_code == StatusCode.UNSET
    assert dict(span.attributes or {}) == {
        "gen_ai.operation.name": "text_completion",
        "gen_ai.request.model": "tiny",
        "gen_ai.request.max_tokens": 5,
        "gen_ai.request.temperature": 0.0,
        "gen_ai.request.top_k": 7,
        "gen_ai.response.id": first.request_id,
        "gen_ai.response.model": "tiny",
        "gen_ai.response.finish_reasons": ("length",),
        "gen_ai.usage.input_tokens": len(b"Hello"),
        "gen_ai.usage.output_tokens": 5,
        "gen_ai.usage.cache_read.input_tokens": first.usage.cached_tokens,
    }
    _check_events(span, EVENTS)

    span = by_id[stopped.request_id]
    attributes = span.attributes or {}
    assert attributes["gen_ai.response.finish_reasons"] == ("stop",)  # the conventions' name for EOS
    assert attributes["gen_ai.usage.output_tokens"] == 1
    assert attributes["gen_ai.request.max_tokens"] == 5
    for unset in ("gen_ai.request.temperature", "gen_ai.request.top_k", "gen_ai.request.top_p"):
        assert unset not in attributes
    _check_events(span, EVENTS)


def test_an_add_request_span_ends_when_the_request_ends(
    traced: RunningServer, client: Client, spans: InMemorySpanExporter, client_tracer: trace.Tracer
) -> None:
    with AdminClient(traced.admin_target, token=ADMIN_TOKEN, timeout=30) as admin:
        with admin.paused(), client_tracer.start_as_current_span("caller") as caller:
            # A stop string longer than 3 tokens of a byte tokenizer can decode to: it never matches.
            request_id = client.submit(
                [5, 6, 7], max_new_tokens=3, top_p=0.9, seed=11, temperature=0.7, stop=["no such text"]
            )
            time.sleep(0.2)
            assert spans.get_finished_spans() == ()  # the call returned; the request is still queued
        chunks = list(client.results(request_id))
    assert chunks[-1].finish_reason == "length"
    (span,) = _children(spans, caller, 1)
    attributes = span.attributes or {}
    assert attributes["gen_ai.response.id"] == request_id
    assert attributes["gen_ai.operation.name"] == "text_completion"
    assert attributes["gen_ai.request.top_p"] == 0.9
    assert attributes["gen_ai.request.temperature"] == 0.7
    assert attributes["gen_ai.request.seed"] == 11
    assert attributes["gen_ai.request.stop_sequences"] == ("no such text",)
    assert attributes["gen_ai.usage.input_tokens"] == 3 and attributes["gen_ai.usage.output_tokens"] == 3
    assert attributes["gen_ai.response.finish_reasons"] == ("length",)
    _check_events(span, EVENTS)


def test_each_request_on_a_generate_stream_gets_its_own_span(
    traced: RunningServer, spans: InMemorySpanExporter, client_tracer: trace.Tracer
) -> None:
    chat = types_pb2.GenerationRequest(
        request_id="chat-1",
        messages=types_pb2.ChatMessages(messages=[types_pb2.ChatMessage(role="user", content="Hi")]),
        sampling=types_pb2.SamplingParams(max_new_tokens=2, ignore_eos=True),
    )
    tokens = types_pb2.GenerationRequest(
        request_id="tokens-1",
        token_ids=types_pb2.TokenIds(ids=[9, 8, 7, 6]),
        sampling=types_pb2.SamplingParams(max_new_tokens=3, ignore_eos=True),
    )
    adds = [generation_pb2.GenerateRequest(add=request) for request in (chat, tokens)]
    with grpc.insecure_channel(traced.target) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        with client_tracer.start_as_current_span("caller") as caller:
            carrier: dict[str, str] = {}
            propagate.inject(carrier)
            responses = stub.Generate(iter(adds), metadata=list(carrier.items()), timeout=30)
            finished = {
                r.chunk.request_id for r in responses if r.chunk.status >= types_pb2.REQUEST_STATUS_FINISHED
            }
    assert finished == {"chat-1", "tokens-1"}
    by_id = _by_id(_children(spans, caller, 2))

    span = by_id["chat-1"]
    assert span.name == "chat tiny"
    assert (span.attributes or {})["gen_ai.operation.name"] == "chat"
    assert (span.attributes or {})["gen_ai.usage.input_tokens"] == len(b"<user>Hi")
    assert (span.attributes or {})["gen_ai.usage.output_tokens"] == 2
    span = by_id["tokens-1"]
    assert span.name == "text_completion tiny"
    assert (span.attributes or {})["gen_ai.usage.output_tokens"] == 3
    for span in by_id.values():
        _check_events(span, EVENTS)


def test_cancelled_requests_end_their_spans(
    traced: RunningServer, client: Client, spans: InMemorySpanExporter, client_tracer: trace.Tracer
) -> None:
    with client_tracer.start_as_current_span("caller") as caller:
        stream = client.stream([3, 4, 5], max_new_tokens=500, ignore_eos=True)
        with stream:  # leaving the block closes the Generate stream: the server cancels the request
            next(chunk for chunk in stream if chunk.token_ids)
        with AdminClient(traced.admin_target, token=ADMIN_TOKEN, timeout=30) as admin, admin.paused():
            queued = client.submit([3, 4, 5], max_new_tokens=5)
            assert client.cancel(queued) is True
    by_id = _by_id(_children(spans, caller, 2))

    span = by_id[stream.request_id]
    attributes = span.attributes or {}
    assert attributes["gen_ai.response.finish_reasons"] == ("cancelled",)
    assert 1 <= int(attributes["gen_ai.usage.output_tokens"]) < 500  # type: ignore[arg-type]
    assert span.status.status_code == StatusCode.UNSET
    _check_events(span, EVENTS)

    span = by_id[queued]
    assert (span.attributes or {})["gen_ai.response.finish_reasons"] == ("cancelled",)
    assert (span.attributes or {})["gen_ai.usage.output_tokens"] == 0
    _check_events(span, ["queued"])  # cancelled before it was ever scheduled


def test_a_rejected_request_gets_an_error_span(
    client: Client, spans: InMemorySpanExporter, client_tracer: trace.Tracer
) -> None:
    # Past the model's context: a bound only the server knows (the SDK checks the others itself).
    with client_tracer.start_as_current_span("caller") as caller, pytest.raises(InvalidArgumentError):
        client.generate("Hello", max_new_tokens=5000)
    (span,) = _children(spans, caller, 1)
    assert span.status.status_code == StatusCode.ERROR
    assert "sampling.max_new_tokens" in (span.status.description or "")
    attributes = span.attributes or {}
    assert attributes["error.type"] == "INVALID_ARGUMENT"
    assert attributes["gen_ai.request.max_tokens"] == 5000
    assert "gen_ai.response.id" not in attributes
    assert span.events == ()


def test_a_request_failed_by_a_hard_stop_gets_an_error_span(
    model: torch.nn.Module, client_tracer: trace.Tracer
) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    running = RunningServer(model, tracer_provider=provider)
    try:
        running.load()
        with (
            Client(running.target, timeout=30) as client,
            AdminClient(running.admin_target, token=ADMIN_TOKEN, timeout=30) as admin,
        ):
            with admin.paused(), client_tracer.start_as_current_span("caller") as caller:
                request_id = client.submit([5, 6, 7], max_new_tokens=5)
                stopped = admin.stop(hard=True)
            assert stopped.failed_requests == 1
            chunks = list(client.results(request_id))
        assert chunks[-1].finish_reason == "error"
        (span,) = _children(exporter, caller, 1)
        assert span.status.status_code == StatusCode.ERROR
        assert span.status.description
        attributes = span.attributes or {}
        assert attributes["error.type"] == "INTERNAL"
        assert attributes["gen_ai.response.finish_reasons"] == ("error",)
    finally:
        running.close()
        provider.shutdown()


def test_the_server_never_sets_the_global_tracer_provider(traced: RunningServer) -> None:
    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
    assert traced.server.tracer_provider is not trace.get_tracer_provider()


def test_nothing_is_exported_without_an_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in tracing.OTLP_ENDPOINT_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    provider = tracing.build_tracer_provider()
    try:
        assert provider._active_span_processor._span_processors == ()
        assert provider.resource.attributes["service.name"] == "cbserve"
    finally:
        provider.shutdown()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    provider = tracing.build_tracer_provider()
    try:
        assert len(provider._active_span_processor._span_processors) == 1
    finally:
        provider.shutdown()


class _Collector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self.received = threading.Event()

    def Export(self, request: Any, context: Any) -> trace_service_pb2.ExportTraceServiceResponse:
        self.requests.append(request)
        self.received.set()
        return trace_service_pb2.ExportTraceServiceResponse()


def test_spans_are_exported_over_otlp_when_an_endpoint_is_given(
    model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server that builds its own provider exports through OTLP/gRPC and flushes it on shutdown."""
    for name in tracing.OTLP_ENDPOINT_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    collector = _Collector()
    grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, grpc_server)
    port = grpc_server.add_insecure_port("127.0.0.1:0")
    grpc_server.start()
    try:
        running = RunningServer(model, otlp_endpoint=f"http://127.0.0.1:{port}")
        try:
            running.load()
            with Client(running.target, timeout=30) as client:
                completion = client.generate([1, 2, 3], max_new_tokens=2)
        finally:
            running.close()  # shuts the server's provider down, which flushes the batch
        assert collector.received.wait(10)
        exported = [
            (resource_spans.resource, span)
            for request in collector.requests
            for resource_spans in request.resource_spans
            for scope_spans in resource_spans.scope_spans
            for span in scope_spans.spans
        ]
        assert len(exported) == 1
        resource, span = exported[0]
        assert span.name == "text_completion tiny"
        assert {"key": "service.name", "value": "cbserve"} in [
            {"key": attribute.key, "value": attribute.value.string_value} for attribute in resource.attributes
        ]
        ids = [a.value.string_value for a in span.attributes if a.key == "gen_ai.response.id"]
        assert ids == [completion.request_id]
    finally:
        grpc_server.stop(grace=0).wait(5)  # bounded, unlike stop(None) (tests/sdk/conftest.py)
