"""The Python SDK's gRPC idioms: per-call metadata, client interceptors (sync and asyncio), and the pause
lease as an object (``AdminClient.pause``) beside the ``with admin.paused()`` block."""

from __future__ import annotations

import asyncio
import datetime
import time
from collections.abc import Callable
from typing import Any

import grpc
import grpc.aio
import pytest
from cbserve_client import AdminClient, AdminFleet, AsyncClient, Client, PauseLease

from tests.helpers.sdk_fakes import ADMIN_TOKEN, FakeServer

# -- per-call metadata ------------------------------------------------------------------------------


def test_every_call_sends_its_metadata_after_the_token(fake_server: FakeServer) -> None:
    seen = fake_server.recorder.metadata
    tenant = {"x-tenant": "blue"}
    with Client(fake_server.target, token="t0k") as client:
        request_id = client.submit("hi", metadata=tenant)
        list(client.results(request_id, metadata=[("x-tenant", "blue")]))
        client.generate("hi", metadata=tenant)
        list(client.stream("hi", metadata=tenant))
        client.cancel(request_id, metadata=tenant)
        client.model_info(metadata=tenant)
    assert len(seen) == 6
    assert all(m["x-tenant"] == "blue" and m["authorization"] == "Bearer t0k" for m in seen), seen


def test_admin_calls_send_their_metadata(fake_server: FakeServer) -> None:
    seen = fake_server.recorder.metadata
    with AdminClient(fake_server.target, ADMIN_TOKEN) as admin:
        admin.status(metadata={"x-trainer": "run-7"})
        with admin.pause(metadata={"x-trainer": "run-7"}):
            pass
    assert [m.get("x-trainer") for m in seen] == ["run-7", "run-7"], seen


def test_binary_metadata_goes_under_a_bin_key(fake_server: FakeServer) -> None:
    with Client(fake_server.target) as client:
        client.model_info(metadata={"x-trace-bin": b"\x00\x01"})
    assert "x-trace-bin" not in fake_server.recorder.metadata[-1]  # bytes: the recorder keeps text only


@pytest.mark.parametrize(
    ("metadata", "message"),
    [
        ({"X-Tenant": "blue"}, r"metadata key 'X-Tenant': gRPC takes lowercase letters"),
        ({"grpc-timeout": "1S"}, r"metadata key 'grpc-timeout'.*not starting with 'grpc-'"),
        ({"x-tenant": "blue\n"}, r"metadata value of 'x-tenant': printable ASCII text"),
        ({"x-tenant": b"blue"}, r"bytes under a key ending in '-bin'"),
        (["x-tenant"], r"metadata must be \(key, value\) pairs or a dict, got 'x-tenant'"),
    ],
)
def test_metadata_gRPC_would_refuse_is_named_before_the_call(
    fake_server: FakeServer, metadata: Any, message: str
) -> None:
    with Client(fake_server.target) as client, pytest.raises(ValueError, match=message):
        client.model_info(metadata=metadata)
    assert fake_server.recorder.metadata == []


# -- interceptors -----------------------------------------------------------------------------------


class _CallDetails(grpc.ClientCallDetails):  # type: ignore[misc]
    def __init__(self, details: Any, metadata: list[tuple[str, str]]) -> None:
        self.method = details.method
        self.timeout = details.timeout
        self.metadata = metadata
        self.credentials = details.credentials
        self.wait_for_ready = details.wait_for_ready
        self.compression = details.compression


class HeaderInterceptor(
    grpc.UnaryUnaryClientInterceptor,  # type: ignore[misc]
    grpc.UnaryStreamClientInterceptor,  # type: ignore[misc]
    grpc.StreamUnaryClientInterceptor,  # type: ignore[misc]
    grpc.StreamStreamClientInterceptor,  # type: ignore[misc]
):
    """Adds ``x-via: interceptor`` to every call and records the methods called."""

    def __init__(self) -> None:
        self.methods: list[str] = []

    def _continue(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        self.methods.append(details.method.rsplit("/", 1)[-1])
        metadata = [*(details.metadata or ()), ("x-via", "interceptor")]
        return continuation(_CallDetails(details, metadata), request)

    intercept_unary_unary = _continue
    intercept_unary_stream = _continue
    intercept_stream_unary = _continue
    intercept_stream_stream = _continue


def test_interceptors_see_every_call_of_a_client(fake_server: FakeServer) -> None:
    interceptor = HeaderInterceptor()
    with Client(fake_server.target, interceptors=[interceptor]) as client:
        assert client.generate("hi").text == "Hello wörld"
        request_id = client.submit("hi")
        assert [c.token_ids for c in client.results(request_id)][-1] == (103,)
        client.model_info()
    with AdminClient(fake_server.target, ADMIN_TOKEN, interceptors=[interceptor]) as admin:
        admin.status()
    assert interceptor.methods == ["Generate", "AddRequest", "StreamResults", "GetModelInfo", "GetStatus"]
    assert all(m["x-via"] == "interceptor" for m in fake_server.recorder.metadata)


class AsyncHeaderInterceptor(
    grpc.aio.UnaryUnaryClientInterceptor,  # type: ignore[misc]
    grpc.aio.StreamStreamClientInterceptor,  # type: ignore[misc]
):
    def __init__(self) -> None:
        self.methods: list[str] = []

    async def _continue(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        self.methods.append(details.method.decode().rsplit("/", 1)[-1])  # bytes in grpc.aio
        details = details._replace(metadata=grpc.aio.Metadata(*(details.metadata or ()), ("x-via", "aio")))
        return await continuation(details, request)

    intercept_unary_unary = _continue
    intercept_stream_stream = _continue


def test_the_async_client_applies_an_aio_interceptor_to_every_kind_it_implements(
    fake_server: FakeServer,
) -> None:
    """grpc.aio alone would apply it to unary calls only: the first kind it is an instance of."""
    interceptor = AsyncHeaderInterceptor()

    async def main() -> None:
        async with AsyncClient(fake_server.target, interceptors=[interceptor]) as client:
            assert (await client.generate("hi")).text == "Hello wörld"
            await client.model_info()

    asyncio.run(asyncio.wait_for(main(), timeout=30))
    assert interceptor.methods == ["Generate", "GetModelInfo"]
    assert all(m["x-via"] == "aio" for m in fake_server.recorder.metadata)


# -- the pause lease --------------------------------------------------------------------------------


def test_a_pause_lease_holds_until_released(fake_server: FakeServer) -> None:
    released = fake_server.recorder.pause_released
    with AdminClient(fake_server.target, ADMIN_TOKEN) as admin:
        before = datetime.datetime.now(datetime.UTC)
        lease = admin.pause(lease_s=60)
        assert isinstance(lease, PauseLease) and lease.held and lease.holders == 1
        assert lease.lease_expires_at is not None
        assert (
            datetime.timedelta(seconds=55) < lease.lease_expires_at - before < datetime.timedelta(seconds=65)
        )
        assert lease.info.lease_expires_at == lease.lease_expires_at and lease.weight_version == 1
        time.sleep(0.2)
        assert not released.is_set()
        lease.release()
        assert not lease.held and released.wait(5), "release() did not end the Pause call"
        lease.release()  # idempotent


def test_a_pause_lease_is_a_context_manager(fake_server: FakeServer) -> None:
    with AdminClient(fake_server.target, ADMIN_TOKEN) as admin:
        with admin.pause() as lease:
            assert lease.held
        assert not lease.held
    assert fake_server.recorder.pause_released.wait(5)


def test_a_pause_lease_knows_when_the_server_let_it_expire(fake_server: FakeServer) -> None:
    with AdminClient(fake_server.target, ADMIN_TOKEN) as admin:
        lease = admin.pause(lease_s=0.3)
        assert lease.held
        assert lease.wait(timeout=10), "the lease did not end when the server's lease expired"
        assert not lease.held
        lease.release()


def test_a_dropped_lease_releases_its_hold(fake_server: FakeServer) -> None:
    with AdminClient(fake_server.target, ADMIN_TOKEN) as admin:
        admin.pause()  # never kept: collected at once
        assert fake_server.recorder.pause_released.wait(5)


def test_a_fleet_returns_one_lease_per_replica(fake_server: FakeServer) -> None:
    with AdminFleet([fake_server.target, fake_server.target], ADMIN_TOKEN) as fleet:
        leases = fleet.pause(lease_s=30)
        assert [lease.held for lease in leases] == [True, True]
        for lease in leases:
            lease.release()
        assert not any(lease.held for lease in leases)
