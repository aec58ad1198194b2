"""Malformed request messages end their call with INVALID_ARGUMENT, naming the message type.

gRPC decodes each request with the handler's deserializer. When the bytes are not a valid message it
raises, and grpc.aio ends a unary call with UNKNOWN ("Unexpected DecodeError"); for a streaming request
the error surfaces wherever the servicer iterates (for Generate, in a reader task, which left the call
open until its deadline). This interceptor instead decodes to a `MalformedMessage` marker and rejects it
where the servicer would see it: a unary request before the servicer runs, a streamed one as the
iteration reaches it, by raising `RequestRejected`. A `RequestRejected` that escapes a servicer ends the
call with its status code, so a servicer never has to catch it just to abort.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from service.rpc_handlers import behavior_of, handler_like
from service.validation import RequestRejected, invalid


@dataclass(frozen=True)
class MalformedMessage:
    """Bytes that did not decode as the expected message."""

    description: str


def _tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except DecodeError as error:
            return MalformedMessage(f"the request is not a valid message: {error}")

    return deserialize


def _checked(request: Any) -> Any:
    if isinstance(request, MalformedMessage):
        raise invalid(request.description)
    return request


async def _checked_stream(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for request in requests:
        yield _checked(request)


def _guarded(behavior: Callable[..., Any], request_streaming: bool) -> Callable[..., Any]:
    """`behavior` with its request(s) checked and an escaping `RequestRejected` turned into its status."""

    def requests_of(request: Any) -> Any:
        return _checked_stream(request) if request_streaming else _checked(request)

    if inspect.isasyncgenfunction(behavior):

        async def streaming(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            try:
                async for response in behavior(requests_of(request), context):
                    yield response
            except RequestRejected as rejected:
                await context.abort(rejected.code, rejected.message)

        return streaming

    async def single(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await behavior(requests_of(request), context)
        except RequestRejected as rejected:
            await context.abort(rejected.code, rejected.message)

    return single


class MalformedMessageInterceptor(grpc.aio.ServerInterceptor):
    """Put it after interceptors that refuse calls by themselves (authentication): they answer first, and
    their refusal handlers decode through the tolerant deserializer it installs."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        return handler_like(
            handler,
            _guarded(behavior_of(handler), handler.request_streaming),
            _tolerant(handler.request_deserializer),
        )
