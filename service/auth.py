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


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every AdminService call whose `authorization` metadata is not `Bearer <token>`.

    With no token configured every admin call is refused: an open admin port would let anyone stop the
    server or swap its weights. Other services on the port (health, reflection) stay open.
    """

    def __init__(self, token: str | None) -> None:
        self._expected = f"Bearer {token}".encode() if token else None

    def _refusal_reason(self, metadata: Any) -> str | None:
        """Why the call is refused (what to fix, for the caller), or None when its token is right."""
        if self._expected is None:
            return (
                "no admin token is configured on the server, so every admin call is refused: start it with "
                f"{TOKEN_ENV}=<token> in its environment or --admin-token-file FILE"
            )
        for key, value in metadata or ():
            if key == "authorization":
                given = value.encode() if isinstance(value, str) else bytes(value)
                if hmac.compare_digest(given, self._expected):
                    return None
                return f"wrong admin token: it differs from the server's (${TOKEN_ENV} or --admin-token-file)"
        return (
            "admin token missing: pass the server's token (the SDKs' token argument; on the wire, "
            "`authorization: Bearer <token>` metadata)"
        )

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
