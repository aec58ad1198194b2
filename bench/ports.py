"""Free loopback ports for the servers that benchmarks and tests start."""

from __future__ import annotations

import contextlib
import socket


def free_ports(count: int) -> list[int]:
    """`count` distinct TCP ports free on loopback now.

    Every probe stays bound until all are chosen: a probe closed before the next bind lets the kernel hand
    the same port out twice, and a server given one port for two listeners refuses to start.
    """
    with contextlib.ExitStack() as stack:
        probes = [stack.enter_context(socket.socket()) for _ in range(count)]
        for probe in probes:
            probe.bind(("127.0.0.1", 0))
        return [int(probe.getsockname()[1]) for probe in probes]


def free_port() -> int:
    """One TCP port free on loopback now (for servers whose port 0 means "off")."""
    (port,) = free_ports(1)
    return port
