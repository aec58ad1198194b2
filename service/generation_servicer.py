"""The GenerationService: queue requests, stream their outputs, cancel them, describe the model."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc
from cbserve_client.proto import generation_pb2, generation_pb2_grpc, types_pb2
from opentelemetry.context import Context

from service.engine_host import EngineHost
from service.host_slot import HostSlot
from service.metrics import NO_METRICS, MetricsObserver
from service.sequence_group import SequenceGroup
from service.tracing import RequestTracer, parent_context
from service.validation import RequestRejected, invalid, prepare

# Marks the end of a Generate stream's output queue.
_END = object()

logger = logging.getLogger(__name__)


class GenerationServicer(generation_pb2_grpc.GenerationServiceServicer):
    def __init__(self, slot: HostSlot, tracer: RequestTracer, metrics: MetricsObserver = NO_METRICS) -> None:
        self.slot = slot
        self.tracer = tracer
        self.metrics = metrics

    async def AddRequest(
        self, request: generation_pb2.AddRequestRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.AddRequestResponse:
        if not request.HasField("request"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request must be set")
        host = await self.slot.require(context)
        trace_parent = parent_context(context.invocation_metadata())
        try:
            group = submit(host, request.request, self.tracer, self.metrics, trace_parent)
        except RequestRejected as exc:
            await context.abort(exc.code, exc.message)
        return generation_pb2.AddRequestResponse(request_id=group.request_id)

    async def StreamResults(
        self, request: generation_pb2.StreamResultsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generation_pb2.StreamResultsResponse]:
        group = (await self.slot.require(context)).get(request.request_id)
        if group is None:
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"unknown or expired request_id {request.request_id!r}"
            )
        assert group is not None  # context.abort raised otherwise
        # Ending this call leaves the request running (the proto's contract): readers reconnect with
        # from_token_index and only Cancel stops it.
        async for chunk in group.tail(request.from_token_index, send_current=True):
            yield generation_pb2.StreamResultsResponse(chunk=chunk)

    async def Cancel(
        self, request: generation_pb2.CancelRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.CancelResponse:
        host = await self.slot.require(context)
        index = request.index if request.HasField("index") else None
        return generation_pb2.CancelResponse(cancelled=host.cancel(request.request_id, index))

    async def GetModelInfo(
        self, request: generation_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.GetModelInfoResponse:
        host = await self.slot.require(context)
        tokenizer = host.tokenizer
        return generation_pb2.GetModelInfoResponse(
            model_name=host.model_name,
            vocab_size=host.limits.vocab_size,
            max_context_length=host.limits.max_context_length,
            eos_token_ids=host.eos_token_ids,
            has_chat_template=bool(getattr(tokenizer, "chat_template", None)),
            has_tokenizer=tokenizer is not None,
            weight_version=host.weight_version,
        )

    async def Generate(
        self,
        request_iterator: AsyncIterator[generation_pb2.GenerateRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        host = await self.slot.require(context)
        trace_parent = parent_context(context.invocation_metadata())
        stream = _GenerateStream(host, self.tracer, self.metrics, trace_parent)
        reader = asyncio.create_task(stream.read(request_iterator))
        try:
            while True:
                item = await stream.outbox.get()
                if item is _END:
                    break
                if isinstance(item, RequestRejected):
                    await context.abort(item.code, item.message)
                assert isinstance(item, types_pb2.GenerationChunk)
                yield generation_pb2.GenerateResponse(chunk=item)
        finally:
            # Runs however the call ends (completion, client cancel, deadline, broken connection), so
            # the stream's unfinished requests never keep their KV blocks.
            reader.cancel()
            stream.close()


class _GenerateStream:
    """The requests of one Generate call, their readers, and the queue that interleaves their chunks."""

    def __init__(
        self, host: EngineHost, tracer: RequestTracer, metrics: MetricsObserver, trace_parent: Context
    ) -> None:
        self.host = host
        self.tracer = tracer
        self.metrics = metrics
        # The caller's trace context, read from the call's metadata: the parent of every request's span.
        self.trace_parent = trace_parent
        self.outbox: asyncio.Queue[object] = asyncio.Queue()
        self.groups: dict[str, SequenceGroup] = {}
        self.tails: set[asyncio.Task[None]] = set()

    async def read(self, request_iterator: AsyncIterator[generation_pb2.GenerateRequest]) -> None:
        """Runs as its own task, so it must end the call itself when reading fails: nothing else would."""
        try:
            async for message in request_iterator:
                action = message.WhichOneof("action")
                if action == "add":
                    self._add(message.add)
                elif action == "cancel":
                    cancel = message.cancel
                    if cancel.request_id in self.groups:
                        self.host.cancel(
                            cancel.request_id, cancel.index if cancel.HasField("index") else None
                        )
                else:
                    self.outbox.put_nowait(
                        invalid("GenerateRequest.action: one of add or cancel must be set")
                    )
                    return
        except RequestRejected as exc:  # a malformed message (service.message_decoding)
            self.outbox.put_nowait(exc)
            return
        except Exception as exc:
            logger.exception("Generate: reading the request stream failed")
            self.outbox.put_nowait(
                RequestRejected(grpc.StatusCode.INTERNAL, f"reading the stream failed: {exc}")
            )
            return
        # Half-closed: the call completes once every request made on it has ended.
        if self.tails:
            await asyncio.wait(set(self.tails))
        self.outbox.put_nowait(_END)

    def _add(self, request: types_pb2.GenerationRequest) -> None:
        try:
            group = submit(self.host, request, self.tracer, self.metrics, self.trace_parent)
        except RequestRejected as exc:
            self.outbox.put_nowait(_rejection(request.request_id, exc))
            return
        self.groups[group.request_id] = group
        for chunk in group.current_chunks():
            self.outbox.put_nowait(chunk)
        task = asyncio.create_task(self._tail(group))
        self.tails.add(task)
        task.add_done_callback(self.tails.discard)

    async def _tail(self, group: SequenceGroup) -> None:
        async for chunk in group.tail(0, send_current=False):
            self.outbox.put_nowait(chunk)

    def close(self) -> None:
        for task in list(self.tails):
            task.cancel()
        for request_id, group in self.groups.items():
            if not group.finished:
                self.host.cancel(request_id)


def submit(
    host: EngineHost,
    request: types_pb2.GenerationRequest,
    tracer: RequestTracer,
    metrics: MetricsObserver,
    trace_parent: Context,
    detokenize: bool = True,
) -> SequenceGroup:
    """Validates and queues one request; raises RequestRejected with the caller's status code.

    The request's span starts here and ends with the request (or now, with an error, if it is refused).
    `detokenize=False` leaves the output without text (stop strings still match on it), for callers
    that decode tokens themselves.
    """
    span = tracer.start(request, host.model_name, trace_parent)
    # Refusals are counted here because AddRequest and each request added on a Generate stream pass through
    # submit exactly once; a call refused before it carries a request (model loading, malformed message)
    # has no request to count.
    try:
        unavailable = host.unavailable_reason()
        if unavailable is not None:
            raise RequestRejected(grpc.StatusCode.UNAVAILABLE, unavailable)
        group = host.submit(prepare(request, host.limits, host.tokenizer), detokenize=detokenize)
    except RequestRejected as exc:
        metrics.observe_rejected(exc.code.name)
        span.reject(exc.code.name, exc.message)
        raise
    except Exception as exc:
        metrics.observe_rejected("INTERNAL")
        span.reject("INTERNAL", str(exc) or type(exc).__name__)
        raise
    span.attach(group)
    return group


def _rejection(request_id: str, exc: RequestRejected) -> types_pb2.GenerationChunk:
    code = exc.code.value[0]
    return types_pb2.GenerationChunk(
        request_id=request_id,
        status=types_pb2.REQUEST_STATUS_FAILED,
        finish_reason=types_pb2.FINISH_REASON_ERROR,
        error=exc.message,
        error_code=code,
    )
