"""Several replicas, deadlines and retries, all through gRPC's own machinery: the target a client is
given, its service config (round_robin, retries of the idempotent unary calls), the default deadline of
streams, and two real `cbserve serve` replicas, one of them killed."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from cbserve_client import AdminClient, AsyncClient, Client, errors
from cbserve_client._connection import ChannelSettings, channel_options, channel_target, service_config
from cbserve_client.proto import admin_pb2, admin_pb2_grpc, generation_pb2, generation_pb2_grpc

from tests.conftest import tiny_model
from tests.service.service_harness import ADMIN_TOKEN, ServerProcess, serving_replicas

# -- the target and the channel options --------------------------------------------------------------


def test_a_list_of_addresses_becomes_gRPC_s_static_list() -> None:
    assert channel_target(["127.0.0.1:5001", "127.0.0.1:5002"]) == "ipv4:127.0.0.1:5001,127.0.0.1:5002"
    assert channel_target("127.0.0.1:5001, 127.0.0.1:5002") == "ipv4:127.0.0.1:5001,127.0.0.1:5002"
    assert channel_target(["[::1]:5001", "[::1]:5002"]) == "ipv6:[::1]:5001,[::1]:5002"


def test_host_names_in_a_list_are_resolved_once() -> None:
    assert channel_target(["localhost:5001", "localhost:5002"]) == "ipv4:127.0.0.1:5001,127.0.0.1:5002"


def test_gRPC_targets_pass_unchanged() -> None:
    for target in (
        "localhost:50051",
        "dns:///cbserve.ns.svc.cluster.local:50051",
        "ipv4:10.0.0.1:1,10.0.0.2:1",
    ):
        assert channel_target(target) == target


def test_a_malformed_address_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="'nohost'"):
        channel_target(["127.0.0.1:5001", "nohost"])


def test_service_config_balances_round_robin_and_retries_only_idempotent_calls() -> None:
    config = json.loads(service_config(ChannelSettings()))
    assert config["loadBalancingConfig"] == [{"round_robin": {}}]
    (method,) = config["methodConfig"]
    assert {name["method"] for name in method["name"]} == {"GetModelInfo", "Cancel", "GetStatus"}
    assert method["retryPolicy"]["maxAttempts"] == 4
    assert method["retryPolicy"]["retryableStatusCodes"] == ["UNAVAILABLE"]
    assert (
        "retryPolicy" not in json.loads(service_config(ChannelSettings(retry_attempts=1)))["methodConfig"][0]
    )


def test_keepalive_is_off_unless_asked_and_caller_options_win() -> None:
    assert "grpc.keepalive_time_ms" not in dict(channel_options(ChannelSettings(), ()))
    options = dict(channel_options(ChannelSettings(keepalive_s=30), [("grpc.service_config", "{}")]))
    assert options["grpc.keepalive_time_ms"] == 30_000
    assert options["grpc.http2.ping_timeout_ms"] == options["grpc.keepalive_timeout_ms"] == 20_000
    assert options["grpc.service_config"] == "{}"


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"retry_attempts": 6}, r"retry_attempts must be an int in \[1, 5\]"),
        ({"retry_attempts": 0}, r"retry_attempts must be an int in \[1, 5\]"),
        ({"keepalive_s": 1}, "keepalive_s must be >= 10"),
    ],
)
def test_bad_connection_settings_are_refused(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Client("127.0.0.1:1", **settings)


# -- retries and deadlines against a flaky, stalling server ------------------------------------------


class FlakyGenerationService(generation_pb2_grpc.GenerationServiceServicer):
    """GetModelInfo and Cancel answer UNAVAILABLE `failures` times, then succeed; Generate always
    answers UNAVAILABLE for token prompt [1], and otherwise stalls (sends nothing) until cancelled."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls: dict[str, int] = {}

    def _flaky(self, method: str, context: grpc.ServicerContext) -> None:
        self.calls[method] = self.calls.get(method, 0) + 1
        if self.calls[method] <= self.failures:
            context.abort(grpc.StatusCode.UNAVAILABLE, "replica restarting")

    def GetModelInfo(self, request: Any, context: Any) -> generation_pb2.GetModelInfoResponse:
        self._flaky("GetModelInfo", context)
        return generation_pb2.GetModelInfoResponse(model_name="flaky")

    def Cancel(self, request: Any, context: Any) -> generation_pb2.CancelResponse:
        self._flaky("Cancel", context)
        return generation_pb2.CancelResponse(cancelled=True)

    def Generate(self, request_iterator: Any, context: Any) -> Iterator[generation_pb2.GenerateResponse]:
        self.calls["Generate"] = self.calls.get("Generate", 0) + 1
        message = next(request_iterator)
        if list(message.add.token_ids.ids) == [1]:
            context.abort(grpc.StatusCode.UNAVAILABLE, "replica restarting")
        while context.is_active():
            time.sleep(0.01)
        yield from ()


class FlakyAdminService(admin_pb2_grpc.AdminServiceServicer):
    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls = 0

    def GetStatus(self, request: Any, context: Any) -> admin_pb2.GetStatusResponse:
        self.calls += 1
        if self.calls <= self.failures:
            context.abort(grpc.StatusCode.UNAVAILABLE, "replica restarting")
        return admin_pb2.GetStatusResponse(running=True)


@pytest.fixture
def flaky() -> Iterator[tuple[str, FlakyGenerationService, FlakyAdminService]]:
    generation, admin = FlakyGenerationService(failures=2), FlakyAdminService(failures=2)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    generation_pb2_grpc.add_GenerationServiceServicer_to_server(generation, server)
    admin_pb2_grpc.add_AdminServiceServicer_to_server(admin, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", generation, admin
    finally:
        server.stop(grace=None).wait(5)


def test_idempotent_unary_calls_are_retried_by_the_channel(flaky: Any) -> None:
    target, generation, admin = flaky
    with Client(target) as client, AdminClient(target, token=ADMIN_TOKEN) as admin_client:
        assert client.model_info().model_name == "flaky"
        assert client.cancel("r") is True
        assert admin_client.status().running
    assert generation.calls["GetModelInfo"] == generation.calls["Cancel"] == 3 and admin.calls == 3


def test_retries_stop_at_retry_attempts(flaky: Any) -> None:
    target, generation, _admin = flaky
    with Client(target, retry_attempts=2) as client, pytest.raises(errors.UnavailableError):
        client.model_info()
    assert generation.calls["GetModelInfo"] == 2


def test_streams_are_not_retried(flaky: Any) -> None:
    target, generation, _admin = flaky
    with Client(target) as client, pytest.raises(errors.UnavailableError):
        client.generate([1])
    assert generation.calls["Generate"] == 1


def test_a_stalled_stream_ends_at_the_client_s_stream_timeout(flaky: Any) -> None:
    target, _generation, _admin = flaky
    started = time.monotonic()
    with Client(target, stream_timeout=0.5) as client, pytest.raises(errors.DeadlineExceededError) as late:
        client.generate([5, 6])
    assert time.monotonic() - started < 10
    assert "deadline of 0.5 s" in late.value.details and "stream_timeout=" in late.value.details


def test_a_call_s_timeout_replaces_the_client_s(flaky: Any) -> None:
    target, _generation, _admin = flaky
    started = time.monotonic()
    with Client(target, stream_timeout=None) as client, pytest.raises(errors.DeadlineExceededError):
        list(client.stream([5, 6], timeout=0.3))
    assert time.monotonic() - started < 10


def test_the_async_client_has_the_same_stream_timeout(flaky: Any) -> None:
    target, _generation, _admin = flaky

    async def main() -> None:
        async with AsyncClient(target, stream_timeout=0.5) as client:
            with pytest.raises(errors.DeadlineExceededError, match=r"deadline of 0\.5 s"):
                await client.generate([5, 6])
            assert (await client.model_info()).model_name == "flaky"  # after two retried UNAVAILABLEs

    asyncio.run(asyncio.wait_for(main(), timeout=30))


# -- two real replicas -------------------------------------------------------------------------------

ENGINE_FLAGS = ("--num-blocks", "64", "--page-size", "16")
CALLS = 8
CALL_TIMEOUT_S = 30.0


@pytest.fixture
def two_replicas(tmp_path: Path) -> Iterator[list[ServerProcess]]:
    tiny_model("llama").save_pretrained(tmp_path / "model")
    with serving_replicas(tmp_path / "model", tmp_path, 2, *ENGINE_FLAGS, timeout=180) as replicas:
        yield replicas


def _finished_requests(replica: ServerProcess) -> int:
    with AdminClient(replica.admin_target, token=ADMIN_TOKEN) as admin:
        return admin.status().finished_requests


def test_calls_spread_over_two_replicas_and_survive_one_killed(two_replicas: list[ServerProcess]) -> None:
    first, second = two_replicas
    with Client(
        [first.target, second.target], timeout=CALL_TIMEOUT_S, stream_timeout=CALL_TIMEOUT_S
    ) as client:
        # round_robin takes the connections that are ready, and the second may be ready a moment after
        # the first: calls keep coming until both replicas have served some (at most 50).
        calls = 0
        served = [0, 0]
        while calls < max(CALLS, 2) or not all(served):
            assert calls < 50, f"{calls} calls did not reach both replicas: {served}"
            assert client.generate([5, 6, 7], max_new_tokens=4, ignore_eos=True).finish_reason == "length"
            calls += 1
            served = [_finished_requests(replica) for replica in two_replicas]
        assert sum(served) == calls, f"{calls} calls, per replica: {served}"

        first.process.send_signal(signal.SIGKILL)
        first.process.wait(timeout=30)
        started = time.monotonic()
        for _ in range(CALLS):
            assert client.generate([5, 6, 7], max_new_tokens=4, ignore_eos=True).finish_reason == "length"
            assert client.model_info().max_context_length > 0
        elapsed = time.monotonic() - started
    assert _finished_requests(second) == served[1] + CALLS
    assert elapsed < CALL_TIMEOUT_S, f"{CALLS} calls after the kill took {elapsed:.1f} s"
