"""The GenerationService: queue requests, stream their outputs, cancel them, describe the model."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator
from typing import TypeVar

import grpc
from cbserve_client.proto import generation_pb2, generation_pb2_grpc, types_pb2
from opentelemetry.context import Context

from service.engine_host import EngineHost
from service.host_slot import HostSlot
from service.metrics import NO_METRICS, MetricsObserver
from service.request_intake import RequestIntake
from service.sequence_group import SequenceGroup
from service.tracing import RequestTracer, parent_context, span_attributes
from service.validation import RequestRejected, invalid, prepare

T = TypeVar("T")

# Marks the end of a Generate stream's output queue.
_END = object()

# Serialized bytes of chunks above which a stream with batch_chunks starts another message: well under
# the 4 MiB that gRPC clients accept by default. A larger single chunk still goes, alone.
BATCH_BYTES = 1 << 20

logger = logging.getLogger(__name__)


class GenerationServicer(generation_pb2_grpc.GenerationServiceServicer):
    def __init__(self, slot: HostSlot, tracer: RequestTracer, metrics: MetricsObserver = NO_METRICS) -> None:
        self.slot = slot
        self.intake = RequestIntake(tracer, metrics)

    async def AddRequest(
        self, request: generation_pb2.AddRequestRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.AddRequestResponse:
        if not request.HasField("request"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request must be set")
        host = await self.slot.require(context)
        trace_parent = parent_context(context.invocation_metadata())
        try:
            group = _submit(self.intake, host, request.request, trace_parent)
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
        # The first request is read before any refusal: a client still writing it when the call ends
        # would get grpc-core's INTERNAL "Internal error from Core" instead of this call's status.
        requests = aiter(request_iterator)
        first = await anext(requests, None)
        host = await self.slot.require(context)
        if first is None:
            return  # half-closed without a request: nothing to answer
        trace_parent = parent_context(context.invocation_metadata())
        stream = _GenerateStream(host, self.intake, trace_parent)
        reader = asyncio.create_task(stream.read(_prepended(first, requests)))
        try:
            while True:
                item = await stream.outbox.get()
                if item is _END:
                    break
                if isinstance(item, RequestRejected):
                    await context.abort(item.code, item.message)
                assert isinstance(item, types_pb2.GenerationChunk)
                if stream.batch_chunks:
                    yield generation_pb2.GenerateResponse(chunks=stream.outbox.take_chunks(item, BATCH_BYTES))
                else:
                    yield generation_pb2.GenerateResponse(chunk=item)
        finally:
            # Runs however the call ends (completion, client cancel, deadline, broken connection), so
            # the stream's unfinished requests never keep their KV blocks.
            reader.cancel()
            stream.close()


class _Outbox:
    """What a Generate call sends next, in order: chunks, then a rejection or the end. Used on the event
    loop only."""

    def __init__(self) -> None:
        self._items: deque[object] = deque()
        self._nonempty = asyncio.Event()

    def put(self, item: object) -> None:
        self._items.append(item)
        self._nonempty.set()

    async def get(self) -> object:
        while not self._items:
            self._nonempty.clear()
            await self._nonempty.wait()
        return self._items.popleft()

    def take_chunks(
        self, first: types_pb2.GenerationChunk, byte_limit: int
    ) -> list[types_pb2.GenerationChunk]:
        """``first`` and the chunks queued right behind it, up to ``byte_limit`` serialized bytes. A step's
        outputs wake every request's tail before the writer runs, so they are all queued by then."""
        chunks, size = [first], first.ByteSize()
        while self._items:
            chunk = self._items[0]
            if not isinstance(chunk, types_pb2.GenerationChunk):
                break
            size += chunk.ByteSize()
            if size > byte_limit:
                break
            chunks.append(chunk)
            self._items.popleft()
        return chunks


class _GenerateStream:
    """The requests of one Generate call, their readers, and the queue that interleaves their chunks."""

    def __init__(self, host: EngineHost, intake: RequestIntake, trace_parent: Context) -> None:
        self.host = host
        self.intake = intake
        # The caller's trace context, read from the call's metadata: the parent of every request's span.
        self.trace_parent = trace_parent
        self.outbox = _Outbox()
        # GenerateStreamOptions.batch_chunks, from the stream's first message.
        self.batch_chunks = False
        self.groups: dict[str, SequenceGroup] = {}
        self.tails: set[asyncio.Task[None]] = set()

    async def read(self, request_iterator: AsyncIterator[generation_pb2.GenerateRequest]) -> None:
        """Runs as its own task, so it must end the call itself when reading fails: nothing else would."""
        try:
            first = True
            async for message in request_iterator:
                action = message.WhichOneof("action")
                if action == "options":
                    if not first:
                        self.outbox.put(
                            invalid("GenerateRequest.options: only the stream's first message may set them")
                        )
                        return
                    self.batch_chunks = message.options.batch_chunks
                elif action == "add":
                    self._add(message.add)
                elif action == "cancel":
                    cancel = message.cancel
                    if cancel.request_id in self.groups:
                        self.host.cancel(
                            cancel.request_id, cancel.index if cancel.HasField("index") else None
                        )
                else:
                    self.outbox.put(
                        invalid("GenerateRequest.action: one of add, cancel or options must be set")
                    )
                    return
                first = False
        except RequestRejected as exc:  # a malformed message (service.message_decoding)
            self.outbox.put(exc)
            return
        except Exception as exc:
            logger.exception("Generate: reading the request stream failed")
            self.outbox.put(RequestRejected(grpc.StatusCode.INTERNAL, f"reading the stream failed: {exc}"))
            return
        # Half-closed: the call completes once every request made on it has ended.
        if self.tails:
            await asyncio.wait(set(self.tails))
        self.outbox.put(_END)

    def _add(self, request: types_pb2.GenerationRequest) -> None:
        try:
            group = _submit(self.intake, self.host, request, self.trace_parent)
        except RequestRejected as exc:
            self.outbox.put(_rejection(request.request_id, exc))
            return
        self.groups[group.request_id] = group
        for chunk in group.current_chunks():
            self.outbox.put(chunk)
        task = asyncio.create_task(self._tail(group))
        self.tails.add(task)
        task.add_done_callback(self.tails.discard)

    async def _tail(self, group: SequenceGroup) -> None:
        async for chunk in group.tail(0, send_current=False):
            self.outbox.put(chunk)

    def close(self) -> None:
        for task in list(self.tails):
            task.cancel()
        for request_id, group in self.groups.items():
            if not group.finished:
                self.host.cancel(request_id)


def _submit(
    intake: RequestIntake, host: EngineHost, request: types_pb2.GenerationRequest, trace_parent: Context
) -> SequenceGroup:
    """Checks and queues one of cbserve's requests; raises RequestRejected with the caller's status code."""
    return intake.submit(
        host, span_attributes(request), lambda: prepare(request, host.limits, host.tokenizer), trace_parent
    )


async def _prepended(first: T, rest: AsyncIterator[T]) -> AsyncIterator[T]:
    yield first
    async for item in rest:
        yield item


def _rejection(request_id: str, exc: RequestRejected) -> types_pb2.GenerationChunk:
    code = exc.code.value[0]
    return types_pb2.GenerationChunk(
        request_id=request_id,
        status=types_pb2.REQUEST_STATUS_FAILED,
        finish_reason=types_pb2.FINISH_REASON_ERROR,
        error=exc.message,
        error_code=code,
    )
