"""The HTTP control port (`cbserve serve --control-port`): HTTP/1.1 on the server's own event loop, parsed by
h11, every route behind the admin bearer token. The routes themselves are service.control_routes; this
module is the transport: authentication, routing, JSON, and the status each error is answered with."""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.parse
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import h11

from engine import WeightTransferError, WeightTransferTimeout
from service.admin_operations import ModelStillLoading
from service.auth import refusal_reason
from service.ports import port_error

logger = logging.getLogger(__name__)

# The largest body read: a weight announcement of a model with tens of thousands of tensors fits.
MAX_BODY_BYTES = 16 * 2**20
MAX_HEADER_BYTES = 64 * 2**10
READ_CHUNK_BYTES = 2**16


class BadRequest(ValueError):
    """Input the route cannot take: answered 400, naming the field (`field`) and what it accepts."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass
class ControlRequest:
    method: str
    path: str
    query: dict[str, list[str]]
    body: bytes
    _json: dict[str, Any] | None = field(default=None, repr=False)

    def json(self) -> dict[str, Any]:
        """The body as a JSON object; an empty body is `{}` (SMG sends bodyless calls without one)."""
        if self._json is None:
            if not self.body.strip():
                self._json = {}
            else:
                try:
                    parsed = json.loads(self.body)
                except ValueError as exc:
                    raise BadRequest("body", f"malformed JSON ({exc})") from None
                if not isinstance(parsed, dict):
                    raise BadRequest("body", f"a JSON object is expected, got {type(parsed).__name__}")
                self._json = parsed
        return self._json

    def value(self, name: str) -> Any:
        """Parameter `name` from the query string (its last value), else from the JSON body; None if absent.
        vLLM's routes take theirs in the query, SGLang-style callers (smg.rl) in the body: both reach it."""
        if name in self.query:
            return self.query[name][-1]
        return self.json().get(name)


Handler = Callable[[ControlRequest], Awaitable[dict[str, Any]]]


@dataclass(frozen=True)
class Route:
    method: str
    handler: Handler


def http_status_of(exc: Exception) -> int | None:
    """The status a failed operation is answered with (as the gRPC admin port's codes map them); None for
    an exception that is a server bug (500)."""
    if isinstance(exc, ModelStillLoading):
        return 503
    if isinstance(exc, ValueError):
        return 400
    if isinstance(exc, WeightTransferTimeout):
        return 504
    if isinstance(exc, WeightTransferError):
        return 502
    if isinstance(exc, RuntimeError):  # a state that forbids the call (already in a group, destroyed)
        return 409
    return None


class ControlServer:
    """Serves `routes` (path -> Route) to callers that send `Authorization: Bearer <token>`."""

    def __init__(self, routes: dict[str, Route], token: str | None) -> None:
        self.routes = routes
        self.token = token
        self.port: int | None = None
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[Any]] = set()

    async def start(self, host: str, port: int) -> int:
        """Listens on host:port (0: a free port); returns the port. A port in use raises PortError."""
        try:
            self._server = await asyncio.start_server(self._serve_connection, host, port)
        except OSError as error:
            raise port_error(host, port, "--control-port", error) from None
        self.port = int(self._server.sockets[0].getsockname()[1])
        logger.info("HTTP control routes on http://%s:%d", host, self.port)
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for connection in list(self._connections):
            connection.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)

    async def answer(
        self, method: str, target: str, authorization: str | None, body: bytes
    ) -> tuple[int, dict[str, Any]]:
        """(status, JSON reply) for one request. Authentication answers first: a caller without the token
        learns nothing, not even which routes exist."""
        reason = refusal_reason(self.token, authorization)
        if reason is not None:
            return 401, {"error": reason}
        split = urllib.parse.urlsplit(target)
        route = self.routes.get(split.path)
        if route is None:
            return 404, {"error": f"no route {split.path}", "routes": self.route_list()}
        if method != route.method:
            return 405, {"error": f"{split.path} takes {route.method}, not {method}"}
        query = urllib.parse.parse_qs(split.query, keep_blank_values=True)
        request = ControlRequest(method, split.path, query, body)
        try:
            return 200, await route.handler(request)
        except BadRequest as exc:
            return 400, {"error": str(exc), "field": exc.field}
        except Exception as exc:
            status = http_status_of(exc)
            if status is None:
                logger.exception("%s %s failed", method, split.path)
                return 500, {"error": f"{type(exc).__name__}: {exc}"}
            return status, {"error": str(exc)}

    def route_list(self) -> list[str]:
        return [f"{route.method} {path}" for path, route in sorted(self.routes.items())]

    async def _serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        connection = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEADER_BYTES)
        try:
            while await self._serve_one(connection, reader, writer):
                connection.start_next_cycle()
        except h11.RemoteProtocolError as exc:
            if connection.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                await _send(connection, writer, exc.error_status_hint, {"error": f"malformed HTTP: {exc}"})
        except (ConnectionError, asyncio.CancelledError):
            pass  # the caller went away, or the server is stopping
        finally:
            self._connections.discard(task)
            writer.close()

    async def _serve_one(
        self, connection: h11.Connection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        """Reads one request and answers it; False when the connection is done."""
        request = await _next_event(connection, reader)
        if not isinstance(request, h11.Request):
            return False
        body = bytearray()
        while not isinstance(event := await _next_event(connection, reader), h11.EndOfMessage):
            if not isinstance(event, h11.Data):
                return False
            body += event.data
            if len(body) > MAX_BODY_BYTES:
                await _send(connection, writer, 413, {"error": f"body: larger than {MAX_BODY_BYTES} bytes"})
                return False
        # h11 gives header names lowercased; a repeated header counts by its first value.
        authorization = next(
            (value.decode("latin-1") for name, value in request.headers if name == b"authorization"), None
        )
        status, reply = await self.answer(
            request.method.decode("ascii"), request.target.decode("ascii"), authorization, bytes(body)
        )
        await _send(connection, writer, status, reply)
        return connection.our_state is h11.DONE and connection.their_state is h11.DONE


async def _next_event(connection: h11.Connection, reader: asyncio.StreamReader) -> Any:
    """The next h11 event, reading from the socket as it needs (an empty read is the caller closing)."""
    while (event := connection.next_event()) is h11.NEED_DATA:
        connection.receive_data(await reader.read(READ_CHUNK_BYTES))
    return event


async def _send(connection: h11.Connection, writer: asyncio.StreamWriter, status: int, reply: Any) -> None:
    body = json.dumps(reply).encode()
    headers = [("content-type", "application/json"), ("content-length", str(len(body)))]
    writer.write(connection.send(h11.Response(status_code=status, headers=headers)))
    writer.write(connection.send(h11.Data(data=body)))
    writer.write(connection.send(h11.EndOfMessage()))
    await writer.drain()
