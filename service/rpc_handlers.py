"""Building a grpc method handler in place of another, for server interceptors."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

_FACTORIES = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def behavior_of(handler: grpc.RpcMethodHandler) -> Callable[..., Any]:
    """The servicer function `handler` calls, whatever its streaming kind."""
    functions = (handler.unary_unary, handler.unary_stream, handler.stream_unary, handler.stream_stream)
    return next(function for function in functions if function is not None)


def handler_like(
    handler: grpc.RpcMethodHandler,
    behavior: Callable[..., Any],
    request_deserializer: Callable[[bytes], Any] | None = None,
) -> grpc.RpcMethodHandler:
    """A handler of `handler`'s streaming kind and serializers that runs `behavior` instead, optionally
    decoding requests with `request_deserializer`."""
    factory = _FACTORIES[(handler.request_streaming, handler.response_streaming)]
    return factory(
        behavior,
        request_deserializer=request_deserializer or handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
