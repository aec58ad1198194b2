"""Port binding: a port in use is refused, naming it and its flag, unless the servers share it on purpose
(`--reuse-port`); gRPC's own default (SO_REUSEPORT on) would let a second server start silently."""

from __future__ import annotations

import asyncio
import socket

import pytest

from bench.ports import free_port, free_ports
from service.ports import PortError, check_port_free
from service.server import CbserveServer, ServerOptions


async def _start_and_stop(*options: ServerOptions) -> None:
    """Builds and starts a server for each of `options` in turn, then shuts down all those it built."""
    servers: list[CbserveServer] = []
    try:
        for each in options:
            server = CbserveServer(each)
            servers.append(server)
            await server.start()
    finally:
        for server in servers:
            await server.shutdown()


def test_a_second_server_on_the_same_port_is_refused_naming_the_port() -> None:
    port = free_port()
    first = ServerOptions(port=port, admin_port=0)
    with pytest.raises(PortError, match=rf"^port {port} is already in use .*pick another with --port$"):
        asyncio.run(_start_and_stop(first, ServerOptions(port=port, admin_port=0)))


def test_a_second_server_on_the_same_admin_port_is_refused_naming_the_flag() -> None:
    admin_port = free_port()
    first = ServerOptions(port=0, admin_port=admin_port)
    with pytest.raises(PortError, match=rf"port {admin_port} is already in use .*--admin-port$"):
        asyncio.run(_start_and_stop(first, ServerOptions(port=0, admin_port=admin_port)))


def test_servers_that_ask_for_it_share_a_port() -> None:
    port, admin_port = free_ports(2)
    shared = ServerOptions(port=port, admin_port=admin_port, reuse_port=True)
    asyncio.run(_start_and_stop(shared, shared))


def test_a_metrics_port_in_use_is_refused_naming_it() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(PortError, match=rf"port {port} is already in use .*--metrics-port$"):
            asyncio.run(_start_and_stop(ServerOptions(port=0, admin_port=0, metrics_port=port)))


def test_a_host_that_does_not_resolve_is_named() -> None:
    with pytest.raises(PortError, match=r"^--host no-such-host\.invalid: "):
        check_port_free("no-such-host.invalid", 50051, "--port")
