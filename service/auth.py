"""Bearer-token authentication of the Admin service, as a grpc.aio server interceptor."""

from __future__ import annotations

import hmac
import os
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from service.rpc_handlers import handler_like

TOKEN_ENV = "CBSERVE_ADMIN_TOKEN"
ADMIN_METHOD_PREFIX = "/cbserve.v1.AdminService/"


def load_admin_token(token_file: str | None) -> str | None:
    """The configured token: the file's first line when a file is given, else $CBSERVE_ADMIN_TOKEN."""
    if token_file:
        with open(token_file, encoding="utf-8") as handle:
            token = handle.readline().strip()
    else:
        token = os.environ.get(TOKEN_ENV, "").strip()
    return token or None


def refusal_reason(token: str | None, authorization: str | bytes | None) -> str | None:
    """Why a call whose `authorization` value (gRPC metadata or the HTTP header; None when absent) is
    refused, saying what to fix, or None when it is `Bearer <token>`. With no token configured every call
    is refused: an open admin port would let anyone stop the server or swap its weights."""
    if token is None:
        return (
            "no admin token is configured on the server, so every admin call is refused: start it with "
            f"{TOKEN_ENV}=<token> in its environment or --admin-token-file FILE"
        )
    if authorization is None:
        return (
            "admin token missing: pass the server's token (the SDKs' token argument; on the wire, "
            "`authorization: Bearer <token>` metadata or HTTP header)"
        )
    given = authorization.encode() if isinstance(authorization, str) else bytes(authorization)
    if hmac.compare_digest(given, f"Bearer {token}".encode()):
        return None
    return f"wrong admin token: it differs from the server's (${TOKEN_ENV} or --admin-token-file)"


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every AdminService call whose `authorization` metadata is not `Bearer <token>`
    (`refusal_reason`). Other services on the port (health, reflection) stay open."""

    def __init__(self, token: str | None) -> None:
        self._token = token

    def _refusal_reason(self, metadata: Any) -> str | None:
        given = next((value for key, value in metadata or () if key == "authorization"), None)
        return refusal_reason(self._token, given)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method: str = handler_call_details.method
        if handler is None or not method.startswith(ADMIN_METHOD_PREFIX):
            return handler
        reason = self._refusal_reason(handler_call_details.invocation_metadata)
        if reason is None:
            return handler
        return _refusal(handler, reason)


def _refusal(handler: grpc.RpcMethodHandler, reason: str) -> grpc.RpcMethodHandler:
    """A handler of the same streaming kind as `handler` that fails with UNAUTHENTICATED."""

    async def abort(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

    return handler_like(handler, abort)
