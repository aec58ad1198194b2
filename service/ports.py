"""Binding the server's TCP ports, with a refusal that names the port and the flag that sets it.

gRPC turns SO_REUSEPORT on by default, so a second server on a port already served would start without a
word and take a share of its connections. cbserve's servers turn it off (unless `--reuse-port`) and try
each port with a plain socket first, so a port in use is refused in one line rather than in gRPC's log of
a failed bind.
"""

from __future__ import annotations

import errno
import socket

import grpc


class PortError(RuntimeError):
    """A port the server cannot listen on; the message says which, why, and the flag to change."""


def port_error(host: str, port: int, flag: str, error: OSError) -> PortError:
    """The refusal for `error`, raised when binding `host:port` (set by `flag`)."""
    if error.errno == errno.EADDRINUSE:
        return PortError(f"port {port} is already in use (another cbserve serve?); pick another with {flag}")
    if isinstance(error, socket.gaierror):
        return PortError(f"--host {host}: {error.strerror}; pass an address or name of this machine")
    return PortError(f"cannot listen on {host}:{port}: {error.strerror or error}; check --host and {flag}")


def check_port_free(host: str, port: int, flag: str) -> None:
    """Raises PortError unless a listener could bind `host:port` now (port 0 picks a free port: no check).

    The probe sets SO_REUSEADDR, as gRPC's listeners do, so a port that only has connections in TIME_WAIT
    counts as free, and a port with a listener (with or without SO_REUSEPORT) as taken.
    """
    if port == 0:
        return
    try:
        addresses = socket.getaddrinfo(
            host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except OSError as error:
        raise port_error(host, port, flag, error) from None
    failures: list[OSError] = []
    for family, kind, protocol, _, address in addresses:
        try:
            with socket.socket(family, kind, protocol) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind(address)
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                raise port_error(host, port, flag, error) from None
            failures.append(error)
    # gRPC listens on the addresses it can bind ("localhost" without IPv6: 127.0.0.1 only).
    if failures and len(failures) == len(addresses):
        raise port_error(host, port, flag, failures[0])


def bind_grpc_port(
    server: grpc.aio.Server,
    host: str,
    port: int,
    flag: str,
    credentials: grpc.ServerCredentials | None,
    shared: bool,
) -> int:
    """Adds `host:port` to `server` (TLS when `credentials`); returns the port bound (the free port chosen,
    for 0). Unless `shared` (a server built with SO_REUSEPORT on), a port in use raises PortError."""
    if not shared:
        check_port_free(host, port, flag)
    address = f"{host}:{port}"
    try:
        if credentials is None:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, credentials)
    except RuntimeError:
        # Taken between the probe and the bind, or, when shared, by a listener that does not share it.
        check_port_free(host, port, flag)
        raise PortError(f"cannot listen on {address}; pick another port with {flag}") from None
