"""How a client reaches its server(s): the gRPC target of one address, a list of replicas or a resolvable
name, and the channel options that spread calls over the replicas that serve, keep long streams alive
and retry the read-only calls.

All of it is gRPC's own machinery, set through channel options: the ``round_robin`` load-balancing
policy (one connection per address, each call on the next ready one, a dead address skipped), client-side
health checking (a replica whose ``grpc.health.v1`` status is NOT_SERVING, such as one still loading
its model, gets no calls until it serves), and a service config whose ``retryPolicy`` retries, on
UNAVAILABLE, the read-only calls (see ``_RETRIED_METHODS``).
"""

from __future__ import annotations

import ipaddress
import json
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from cbserve_client.errors import CbserveError, UnavailableError

#: How many times a read-only call (model_info, cancel, results, admin status), or a generation that
#: failed before its first token, is tried on UNAVAILABLE.
DEFAULT_RETRY_ATTEMPTS = 4
#: gRPC caps a retry policy's maxAttempts at 5.
MAX_RETRY_ATTEMPTS = 5
DEFAULT_LOAD_BALANCING = "round_robin"
DEFAULT_KEEPALIVE_TIMEOUT_S = 20.0

# The calls gRPC retries on UNAVAILABLE, by the channel's retryPolicy. gRPC retries a call only until it
# is committed: once the first response message (or header) of an attempt has arrived, or its request
# outgrew the retry buffer (256 KiB), the call's outcome is that attempt's. Each try is a new pick of
# the load-balancing policy, so with several replicas it goes to the next ready one. All of these
# change nothing (Cancel nothing more the second time), so any try may be repeated.
# Two calls retry in the SDK instead, where a service config cannot say what is safe: AddRequest
# (submit: an ALREADY_EXISTS on a retry means the first try did queue it) and Generate (generate,
# stream: the server's first message, a "queued" status, commits the call at once, but a failure until
# the first token is still safe to retry; see GenerationRetry in _call.py).
_RETRIED_METHODS = (
    {"service": "cbserve.v1.GenerationService", "method": "GetModelInfo"},
    {"service": "cbserve.v1.GenerationService", "method": "Cancel"},
    {"service": "cbserve.v1.GenerationService", "method": "StreamResults"},
    {"service": "cbserve.v1.AdminService", "method": "GetStatus"},
)

# The grpc.health.v1 service name whose status the client watches on each connection: "" is the
# server's overall status, NOT_SERVING while the model loads and while the server drains, is stopped,
# sleeps or holds incomplete weights (service/server.py sets "" with the generation services).
_HEALTH_SERVICE_NAME = ""


@dataclass(frozen=True)
class ChannelSettings:
    """The connection keywords shared by Client, AsyncClient and AdminClient."""

    load_balancing: str = DEFAULT_LOAD_BALANCING
    retry_attempts: int = DEFAULT_RETRY_ATTEMPTS
    keepalive_s: float | None = None
    keepalive_timeout_s: float = DEFAULT_KEEPALIVE_TIMEOUT_S
    #: Watch each connection's grpc.health.v1 status and send calls only where it is SERVING. Off for
    #: the admin port, whose calls (status, wake_up, a weight update) must reach a server that does not
    #: serve generation.
    health_check: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.retry_attempts, int) or not 1 <= self.retry_attempts <= MAX_RETRY_ATTEMPTS:
            raise ValueError(
                f"retry_attempts must be an int in [1, {MAX_RETRY_ATTEMPTS}] (gRPC's cap; 1 turns retries "
                f"off), got {self.retry_attempts!r}"
            )
        # Below 10 s gRPC itself raises the interval to 10 s; say so rather than silently differ.
        if self.keepalive_s is not None and not self.keepalive_s >= 10:
            raise ValueError(f"keepalive_s must be >= 10 (gRPC's minimum) or None, got {self.keepalive_s!r}")
        if not self.keepalive_timeout_s > 0:
            raise ValueError(f"keepalive_timeout_s must be > 0, got {self.keepalive_timeout_s!r}")


DEFAULT_SETTINGS = ChannelSettings()


def service_config(settings: ChannelSettings) -> str:
    """The channel's default service config: its load-balancing policy, health checking and the retry
    policy."""
    method_config: dict[str, Any] = {"name": list(_RETRIED_METHODS)}
    if settings.retry_attempts > 1:
        method_config["retryPolicy"] = {
            "maxAttempts": settings.retry_attempts,
            "initialBackoff": "0.1s",
            "maxBackoff": "1s",
            "backoffMultiplier": 2,
            "retryableStatusCodes": ["UNAVAILABLE"],
        }
    config: dict[str, Any] = {
        "loadBalancingConfig": [{settings.load_balancing: {}}],
        "methodConfig": [method_config],
    }
    if settings.health_check:
        # round_robin then treats a connection whose server is not SERVING as not ready: a replica
        # still loading gets no calls, rather than answering them UNAVAILABLE. When no replica serves,
        # round_robin fails the call at once, and the client sends it again over a channel without
        # health checking (see Client._serving_first), so that a server says why it refuses it. A
        # server without the health service (UNIMPLEMENTED) counts as serving. pick_first ignores it.
        config["healthCheckConfig"] = {"serviceName": _HEALTH_SERVICE_NAME}
    return json.dumps(config)


def channel_options(settings: ChannelSettings, extra: Sequence[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """The SDK's channel options, then the caller's ``extra`` ones, which replace any of the same name
    (a ``grpc.service_config`` there replaces the load balancing and retry policy whole)."""
    options: dict[str, Any] = {
        "grpc.service_config": service_config(settings),
        # The policy above is the one in force: a DNS TXT record cannot replace it.
        "grpc.service_config_disable_resolution": 1,
        "grpc.enable_retries": 1 if settings.retry_attempts > 1 else 0,
    }
    if settings.keepalive_s is not None:
        timeout_ms = round(settings.keepalive_timeout_s * 1000)
        options["grpc.keepalive_time_ms"] = round(settings.keepalive_s * 1000)
        options["grpc.keepalive_timeout_ms"] = timeout_ms
        # gRPC waits this long for any ping's answer (a minute by default) before it gives the
        # connection up; keepalive_timeout_ms alone does not shorten it.
        options["grpc.http2.ping_timeout_ms"] = timeout_ms
    options.update(dict(extra))
    return list(options.items())


def split_host_port(address: str) -> tuple[str, int]:
    host, separator, port = address.rpartition(":")
    if not separator or not host or not port.isdigit():
        raise ValueError(f"address must be host:port (IPv6 as [addr]:port), got {address!r}")
    return host.removeprefix("[").removesuffix("]"), int(port)


def replica_targets(target: str) -> list[str]:
    """``"host:port"`` -> one ``"address:port"`` per address ``host`` resolves to, in resolver order
    (IPv6 addresses in brackets). Raises :class:`UnavailableError` when the name does not resolve."""
    host, port = split_host_port(target)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise UnavailableError(grpc.StatusCode.UNAVAILABLE, f"{host} does not resolve: {exc}") from exc
    targets: list[str] = []
    for family, _type, _proto, _name, address in infos:
        ip = str(address[0])
        formatted = f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}"
        if formatted not in targets:
            targets.append(formatted)
    return targets


def channel_target(target: str | Sequence[str]) -> str:
    """The gRPC target for ``target``: a string is gRPC's own (``"host:port"``, ``"dns:///name:port"``,
    ``"ipv4:a:p,b:p"``), except that a plain ``"host:port,host:port"`` list is read as a sequence of
    addresses. A sequence of addresses becomes gRPC's static ``ipv4:``/``ipv6:`` list; a host name in
    it is resolved here, once (use a ``dns:///`` target to follow a name's changes)."""
    if isinstance(target, str):
        if "," not in target or "/" in target or target.startswith(("ipv4:", "ipv6:", "unix:")):
            return target
        target = [address.strip() for address in target.split(",")]
    addresses = list(target)
    if not addresses or not all(isinstance(address, str) for address in addresses):
        raise ValueError(f"target must be a str or a non-empty sequence of 'host:port' str, got {target!r}")
    ipv4: list[str] = []
    ipv6: list[str] = []
    for address in addresses:
        host, port = split_host_port(address)
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:  # a host name: resolve it to its addresses
            for resolved in replica_targets(address):
                (ipv6 if resolved.startswith("[") else ipv4).append(resolved)
            continue
        (ipv4 if ip.version == 4 else ipv6).append(f"{ip}:{port}" if ip.version == 4 else f"[{ip}]:{port}")
    # One gRPC target holds one address family. Names such as "localhost" resolve to both: IPv4 then.
    if ipv4:
        return "ipv4:" + ",".join(dict.fromkeys(ipv4))
    return "ipv6:" + ",".join(dict.fromkeys(ipv6))


# How gRPC's load-balancing policies (pick_first, round_robin) fail a call when they had no connection
# to send it on; the rest of the text is "; last error: " and the last connection's failure.
_NO_CONNECTION = ("failed to connect to all addresses", "connections to all backends failing")
# What round_robin says of a connection whose server's health is NOT_SERVING.
_UNHEALTHY = "backend unhealthy"


def no_replica_serving(exc: grpc.RpcError) -> bool:
    """Whether ``exc`` is round_robin's failure of a call that it had no replica to send to because each
    one it is connected to reports NOT_SERVING. It comes at once: no server saw the call."""
    code_fn, details_fn = getattr(exc, "code", None), getattr(exc, "details", None)
    if not callable(code_fn) or not callable(details_fn) or code_fn() != grpc.StatusCode.UNAVAILABLE:
        return False
    details = details_fn()
    return isinstance(details, str) and details.startswith(_NO_CONNECTION) and details.endswith(_UNHEALTHY)


def explain_unreachable(error: CbserveError, target: str, port_flag: str) -> CbserveError:
    """``error``, reworded when it is gRPC's UNAVAILABLE for a call that no server received: gRPC's
    text ("failed to connect to all addresses; last error: UNKNOWN: ...") names neither the target as
    given nor what to check. ``port_flag``: the server's flag for the port the client calls, and its
    default."""
    if error.code != grpc.StatusCode.UNAVAILABLE or not error.details.startswith(_NO_CONNECTION):
        return error
    # gRPC files a refused or timed-out connection under UNKNOWN, which says nothing: drop it.
    last = error.details.partition("last error: ")[2].removeprefix("UNKNOWN: ")
    explained = UnavailableError(
        error.code,
        f"nothing answered at {target}, so the call was not sent (last connection attempt: {last}). "
        f"Check that `cbserve serve` runs there and listens on that port ({port_flag}), that this "
        "host can reach it, and that credentials= matches the server (TLS or plaintext)",
    )
    explained.__cause__ = error.__cause__
    return explained


def describe_target(target: str | Sequence[str]) -> str:
    """The target as the caller gave it, for ``client.target`` and error messages."""
    return target if isinstance(target, str) else ",".join(target)


__all__ = [
    "DEFAULT_KEEPALIVE_TIMEOUT_S",
    "DEFAULT_LOAD_BALANCING",
    "DEFAULT_RETRY_ATTEMPTS",
    "DEFAULT_SETTINGS",
    "ChannelSettings",
    "channel_options",
    "channel_target",
    "describe_target",
    "explain_unreachable",
    "no_replica_serving",
    "replica_targets",
    "service_config",
    "split_host_port",
]
