"""Several replicas, deadlines and retries: the target a client is given, its service config (round_robin
over the replicas whose health says SERVING, retries of the read-only calls), the retries of a generation
that failed before its first token, the default deadline of streams, what a call that reached no server
says, and real `cbserve serve` replicas, one joining while calls flow and one killed."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from cbserve_client import AdminClient, AsyncClient, Client, errors
from cbserve_client._connection import ChannelSettings, channel_options, channel_target, service_config
from cbserve_client.proto import admin_pb2, admin_pb2_grpc, generation_pb2, generation_pb2_grpc, types_pb2
from grpc_health.v1 import health_pb2_grpc

from bench.ports import free_ports
from tests.helpers.models import tiny_model
from tests.helpers.sdk_fakes import WatchableHealth
from tests.helpers.servers import ADMIN_TOKEN, NOT_SERVING, SERVING, ServerProcess, wait_until

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


def test_service_config_balances_round_robin_over_healthy_replicas_and_retries_read_only_calls() -> None:
    config = json.loads(service_config(ChannelSettings()))
    assert config["loadBalancingConfig"] == [{"round_robin": {}}]
    assert config["healthCheckConfig"] == {"serviceName": ""}
    (method,) = config["methodConfig"]
    assert {name["method"] for name in method["name"]} == {
        "GetModelInfo",
        "Cancel",
        "StreamResults",
        "GetStatus",
    }
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
    """GetModelInfo and Cancel answer UNAVAILABLE `failures` times, then succeed. Generate fails its
    first `failures` calls of a token prompt in one way (FAILURES), then finishes it with one token;
    prompt [4] sends a token then fails, every time; any other prompt stalls (sends nothing) until
    cancelled."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls: dict[str, int] = {}

    def _flaky(self, method: str, context: grpc.ServicerContext) -> bool:
        """Counts a call of `method`; True while it is to fail."""
        self.calls[method] = self.calls.get(method, 0) + 1
        return self.calls[method] <= self.failures

    def GetModelInfo(self, request: Any, context: Any) -> generation_pb2.GetModelInfoResponse:
        if self._flaky("GetModelInfo", context):
            context.abort(grpc.StatusCode.UNAVAILABLE, "replica restarting")
        return generation_pb2.GetModelInfoResponse(model_name="flaky")

    def Cancel(self, request: Any, context: Any) -> generation_pb2.CancelResponse:
        if self._flaky("Cancel", context):
            context.abort(grpc.StatusCode.UNAVAILABLE, "replica restarting")
        return generation_pb2.CancelResponse(cancelled=True)

    def Generate(self, request_iterator: Any, context: Any) -> Iterator[generation_pb2.GenerateResponse]:
        self.calls["Generate"] = self.calls.get("Generate", 0) + 1
        add = next(request_iterator).add
        prompt = list(add.token_ids.ids)
        queued = types_pb2.GenerationChunk(request_id=add.request_id, status=types_pb2.REQUEST_STATUS_QUEUED)
        token = types_pb2.GenerationChunk(
            request_id=add.request_id, token_ids=[9], status=types_pb2.REQUEST_STATUS_DECODING
        )
        if prompt == [4]:
            yield generation_pb2.GenerateResponse(chunk=token)
            context.abort(grpc.StatusCode.UNAVAILABLE, "Stream removed")
        if tuple(prompt) in FAILURES:
            if self._flaky(f"Generate{prompt}", context):
                yield from FAILURES[tuple(prompt)](add.request_id, queued, context)
                return
            token.status, token.finish_reason = (
                types_pb2.REQUEST_STATUS_FINISHED,
                types_pb2.FINISH_REASON_LENGTH,
            )
            yield generation_pb2.GenerateResponse(chunk=token)
            return
        while context.is_active():
            time.sleep(0.01)
        yield from ()


def _refused_while_loading(
    request_id: str, queued: types_pb2.GenerationChunk, context: Any
) -> Iterator[generation_pb2.GenerateResponse]:
    context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading")
    yield from ()


def _broken_after_queued(
    request_id: str, queued: types_pb2.GenerationChunk, context: Any
) -> Iterator[generation_pb2.GenerateResponse]:
    yield generation_pb2.GenerateResponse(chunk=queued)
    context.abort(grpc.StatusCode.UNAVAILABLE, "Stream removed")


def _rejected_as_draining(
    request_id: str, queued: types_pb2.GenerationChunk, context: Any
) -> Iterator[generation_pb2.GenerateResponse]:
    rejection = types_pb2.GenerationChunk(
        request_id=request_id,
        status=types_pb2.REQUEST_STATUS_FAILED,
        finish_reason=types_pb2.FINISH_REASON_ERROR,
        error="the server is stopped or draining",
        error_code=grpc.StatusCode.UNAVAILABLE.value[0],
    )
    yield generation_pb2.GenerateResponse(chunk=rejection)


# How Generate fails a token prompt, as a cbserve server does: [1] refused before any message (the model
# still loading); [2] after the "queued" status, before any token (the connection broke: a replica
# killed); [3] with a rejection chunk (a draining server).
FAILURES = {(1,): _refused_while_loading, (2,): _broken_after_queued, (3,): _rejected_as_draining}


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
        server.stop(grace=0).wait(5)


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


@pytest.mark.parametrize("prompt", [[1], [2], [3]], ids=["still-loading", "reset-after-queued", "draining"])
def test_a_generation_that_failed_before_its_first_token_is_retried(flaky: Any, prompt: list[int]) -> None:
    target, generation, _admin = flaky
    with Client(target) as client:
        completion = client.generate(prompt)
    assert completion.token_ids == [9] and completion.finish_reason == "length"
    assert generation.calls[f"Generate{prompt}"] == 3, generation.calls


def test_generation_tries_stop_at_retry_attempts(flaky: Any) -> None:
    target, generation, _admin = flaky
    with Client(target, retry_attempts=2) as client, pytest.raises(errors.UnavailableError, match="loading"):
        client.generate([1])
    assert generation.calls["Generate[1]"] == 2


def test_a_generation_that_failed_after_a_token_is_not_retried(flaky: Any) -> None:
    target, generation, _admin = flaky
    with Client(target) as client:
        stream = client.stream([4])
        assert next(stream).token_ids == (9,)
        with pytest.raises(errors.UnavailableError, match="Stream removed"):
            next(stream)
        with pytest.raises(errors.UnavailableError):
            client.generate([4])
    assert generation.calls["Generate"] == 2


def test_the_async_client_retries_a_generation_that_failed_before_its_first_token(flaky: Any) -> None:
    target, generation, _admin = flaky

    async def main() -> None:
        async with AsyncClient(target) as client:
            assert (await client.generate([2])).token_ids == [9]
            assert (await client.generate([3])).token_ids == [9]
            with pytest.raises(errors.UnavailableError):
                await client.generate([4])

    asyncio.run(asyncio.wait_for(main(), timeout=30))
    assert generation.calls["Generate[2]"] == generation.calls["Generate[3]"] == 3


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


# -- health: a replica that does not serve gets no calls ----------------------------------------------


class NamedGenerationService(generation_pb2_grpc.GenerationServiceServicer):
    """Answers with its name; while not serving, refuses calls as a cbserve server whose model loads."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.serving = True

    def _refuse_unless_serving(self, context: Any) -> None:
        if not self.serving:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading")

    def GetModelInfo(self, request: Any, context: Any) -> generation_pb2.GetModelInfoResponse:
        self._refuse_unless_serving(context)
        return generation_pb2.GetModelInfoResponse(model_name=self.name)

    def Generate(self, request_iterator: Any, context: Any) -> Iterator[generation_pb2.GenerateResponse]:
        """Answers each add with one finished chunk, batched when the stream's options ask, until the client
        half-closes: a stream's one request, or a session's many."""
        # Refused before the request is read, racing the client's write of it (test_sdk_aio_refusals.py).
        self._refuse_unless_serving(context)
        batched = False
        for message in request_iterator:
            if message.HasField("options"):
                batched = message.options.batch_chunks
                continue
            chunk = types_pb2.GenerationChunk(
                request_id=message.add.request_id,
                text=self.name,
                status=types_pb2.REQUEST_STATUS_FINISHED,
                finish_reason=types_pb2.FINISH_REASON_LENGTH,
            )
            yield (
                generation_pb2.GenerateResponse(chunks=[chunk])
                if batched
                else generation_pb2.GenerateResponse(chunk=chunk)
            )


@dataclass
class FakeReplica:
    target: str
    health: WatchableHealth
    generation: NamedGenerationService

    def set_serving(self, serving: bool) -> None:
        self.generation.serving = serving
        self.health.set("", SERVING if serving else NOT_SERVING)


@pytest.fixture
def replicas_a_b() -> Iterator[list[FakeReplica]]:
    """Two servers, "a" and "b", with a GenerationService, an AdminService and grpc.health.v1 (SERVING)."""
    servers, replicas = [], []
    try:
        for name in ("a", "b"):
            # Each open Watch holds a worker: room for every client a test opens, and for its calls.
            server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
            generation = NamedGenerationService(name)
            generation_pb2_grpc.add_GenerationServiceServicer_to_server(generation, server)
            admin_pb2_grpc.add_AdminServiceServicer_to_server(FlakyAdminService(failures=0), server)
            servicer = WatchableHealth()
            health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
            port = server.add_insecure_port("127.0.0.1:0")
            server.start()
            servers.append(server)
            replicas.append(FakeReplica(f"127.0.0.1:{port}", servicer, generation))
            replicas[-1].set_serving(True)
        yield replicas
    finally:
        for server in servers:
            server.stop(grace=0).wait(5)  # bounded, unlike stop(None) (tests/sdk/conftest.py)


def _served_by(client: Client, calls: int = 6) -> list[str]:
    return [client.model_info().model_name for _ in range(calls)]


def test_a_replica_whose_health_is_not_serving_gets_no_calls(replicas_a_b: list[FakeReplica]) -> None:
    a, b = replicas_a_b
    a.set_serving(False)
    with Client([a.target, b.target]) as client:
        assert _served_by(client) == ["b"] * 6
        a.set_serving(True)  # its model loaded: calls reach it as soon as the client hears of it
        wait_until(lambda: "a" in _served_by(client, 2), timeout=10, what="calls reaching a again")


def test_the_async_client_skips_a_replica_that_does_not_serve(replicas_a_b: list[FakeReplica]) -> None:
    a, b = replicas_a_b
    b.set_serving(False)

    async def main() -> list[str]:
        async with AsyncClient([a.target, b.target]) as client:
            return [(await client.model_info()).model_name for _ in range(6)]

    assert asyncio.run(asyncio.wait_for(main(), timeout=30)) == ["a"] * 6


def test_with_no_replica_serving_a_replica_says_why_it_refuses_the_call(
    replicas_a_b: list[FakeReplica],
) -> None:
    """round_robin fails such a call at once, saying only "backend unhealthy": the client sends it again
    where health is not watched, and a server answers with its reason (or serves it, if it just became
    ready)."""
    for replica in replicas_a_b:
        replica.set_serving(False)
    targets = [replica.target for replica in replicas_a_b]
    with Client(targets, retry_attempts=1) as client:
        with pytest.raises(errors.UnavailableError, match=r"^UNAVAILABLE: the model is still loading$"):
            client.model_info()
        with pytest.raises(errors.UnavailableError, match=r"^UNAVAILABLE: the model is still loading$"):
            client.generate([5])
    replicas_a_b[1].generation.serving = True  # ready, though its health has not said so yet
    with Client(targets) as client:  # a try that reaches a is tried again, on b
        assert client.generate([5]).text == "b"
        assert client.model_info().model_name == "b"

    async def main() -> None:
        async with AsyncClient(targets) as client:
            assert (await client.generate([5])).text == "b"
            assert (await client.model_info()).model_name == "b"
            replicas_a_b[1].generation.serving = False
            with pytest.raises(errors.UnavailableError, match="the model is still loading"):
                await client.generate([5])

    asyncio.run(asyncio.wait_for(main(), timeout=30))


def test_with_no_replica_serving_a_session_goes_to_any_replica_as_a_stream_does(
    replicas_a_b: list[FakeReplica],
) -> None:
    """A session's call, too, is sent where health is not watched: a replica says why it refuses it, or
    serves every request the session sent before it answered."""
    for replica in replicas_a_b:
        replica.set_serving(False)
    targets = [replica.target for replica in replicas_a_b]
    refusal = r"^UNAVAILABLE: the model is still loading$"
    with Client(targets) as client:
        with client.session() as session, pytest.raises(errors.UnavailableError, match=refusal):
            session.generate([5])
        for replica in replicas_a_b:
            replica.generation.serving = True  # ready, though their health has not said so yet
        with client.session() as session:
            streams = [session.stream([5 + i]) for i in range(3)]
            texts = {"".join(chunk.text for chunk in stream) for stream in streams}
        assert len(texts) == 1 and texts <= {"a", "b"}, texts  # one call, to one replica

    async def main() -> set[str]:
        async with AsyncClient(targets) as client:
            async with client.session() as session:
                streams = [session.stream([5 + i]) for i in range(3)]
                texts = {"".join([chunk.text async for chunk in stream]) for stream in streams}
            for replica in replicas_a_b:
                replica.generation.serving = False
            async with client.session() as session:
                with pytest.raises(errors.UnavailableError, match=refusal):
                    await session.generate([5])
        return texts

    texts = asyncio.run(asyncio.wait_for(main(), timeout=30))
    assert len(texts) == 1 and texts <= {"a", "b"}, texts


def test_admin_calls_reach_a_server_whose_health_is_not_serving(replicas_a_b: list[FakeReplica]) -> None:
    """A server loading, asleep or stopped answers its admin calls (status, wake_up): no health check."""
    a, _b = replicas_a_b
    a.set_serving(False)
    with AdminClient(a.target, token=ADMIN_TOKEN) as admin:
        assert admin.status().running


# -- a call that reached no server -------------------------------------------------------------------


def test_a_call_that_reached_no_server_names_the_target_and_what_to_check() -> None:
    [port] = free_ports(1)  # nothing listens there
    target = f"127.0.0.1:{port}"
    with Client(target, retry_attempts=1) as client:
        for call in (client.model_info, lambda: client.generate([5])):
            with pytest.raises(errors.UnavailableError) as refused:
                call()
            details = refused.value.details
            assert details.startswith(f"nothing answered at {target}, so the call was not sent"), details
            assert "Connection refused" in details and "(--port, 50051 by default)" in details, details
            assert "UNKNOWN" not in details, details
    with AdminClient(target, token=ADMIN_TOKEN) as admin, pytest.raises(errors.UnavailableError) as refused:
        admin.status(timeout=5)
    assert "(--admin-port, 50052 by default)" in refused.value.details, refused.value.details

    async def main() -> None:
        async with AsyncClient(target, retry_attempts=1) as client:
            with pytest.raises(errors.UnavailableError, match=f"nothing answered at {target}"):
                await client.generate([5])

    asyncio.run(asyncio.wait_for(main(), timeout=30))


# -- real replicas: one joins while calls flow, one is killed ----------------------------------------

ENGINE_FLAGS = ("--num-blocks", "64", "--page-size", "16")
CALLS = 8
CALL_TIMEOUT_S = 30.0
STARTUP_TIMEOUT_S = 180.0
# gRPC tries an address that refused it again after 1 s, then 1.6 times longer each time: by the time a
# replica's ports open, the client may wait seconds more. A tenth of a second here, so that the client
# connects to the joining replica while its model still loads, which is what the test is about.
FAST_RECONNECT = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 100),
)


class CallPump:
    """Threads that stream short generations through one client until stopped, recording each outcome:
    a call that fails is kept with the number of tokens it had received."""

    def __init__(self, client: Client, threads: int = 2) -> None:
        self.client = client
        self.succeeded = 0
        self.failures: list[tuple[int, errors.CbserveError]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.threads = threads
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]

    def __enter__(self) -> CallPump:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=CALL_TIMEOUT_S)

    def _run(self) -> None:
        while not self._stop.is_set():
            tokens = 0
            try:
                for chunk in self.client.stream([5, 6, 7], max_new_tokens=4, ignore_eos=True):
                    tokens += len(chunk.token_ids)
            except errors.CbserveError as error:
                with self._lock:
                    self.failures.append((tokens, error))
            else:
                with self._lock:
                    self.succeeded += 1


def _finished_requests(replica: ServerProcess) -> int:
    with AdminClient(replica.admin_target, token=ADMIN_TOKEN) as admin:
        return admin.status().finished_requests


def _poll(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout:g} s waiting for {what}"
        time.sleep(0.2)


def test_a_replica_joining_and_one_killed_while_calls_flow_fail_no_call_a_retry_could_serve(
    tmp_path: Path,
) -> None:
    """The joining replica opens its port seconds before its model serves: health checking keeps calls
    off it until then (no "the model is still loading"). Calls on the killed one that had no token yet
    go to the other (no "Stream removed" / "Connection reset by peer"); only a call cut off after its
    first token fails, as designed (GenerationRetry)."""
    tiny_model("llama").save_pretrained(tmp_path / "model")
    first = ServerProcess(tmp_path / "model", tmp_path / "first.log", *ENGINE_FLAGS)
    second: ServerProcess | None = None
    try:
        first.wait_serving(timeout=STARTUP_TIMEOUT_S)
        second = ServerProcess(tmp_path / "model", tmp_path / "second.log", *ENGINE_FLAGS)
        targets = [first.target, second.target]
        with (
            Client(targets, stream_timeout=CALL_TIMEOUT_S, options=FAST_RECONNECT) as client,
            CallPump(client) as pump,
        ):
            second.wait_serving(timeout=STARTUP_TIMEOUT_S)
            _poll(lambda: _finished_requests(second) > 0, CALL_TIMEOUT_S, "calls on the joining replica")
            first.process.send_signal(signal.SIGKILL)
            first.process.wait(timeout=CALL_TIMEOUT_S)
            after_kill = pump.succeeded
            _poll(
                lambda: pump.succeeded >= after_kill + CALLS, CALL_TIMEOUT_S, f"{CALLS} calls after the kill"
            )
        calls = pump.succeeded + len(pump.failures)
        before_first_token = Counter(str(error) for tokens, error in pump.failures if tokens == 0)
        assert not before_first_token, (
            f"of {calls} calls, these failed before their first token: {before_first_token}"
        )
        # A call cut off after its first token fails (GenerationRetry): at most one per pump thread.
        assert len(pump.failures) <= pump.threads, f"of {calls} calls, these failed: {pump.failures}"
    finally:
        first.close()
        if second is not None:
            second.close()


def test_a_session_whose_server_is_killed_fails_every_open_request_at_once(tmp_path: Path) -> None:
    """A session's requests share one call: when its server dies mid-generation (SIGKILL), every open
    stream raises UnavailableError at once instead of waiting for chunks that cannot come, and the session
    takes no new request."""
    tiny_model("llama").save_pretrained(tmp_path / "model")
    server = ServerProcess(tmp_path / "model", tmp_path / "server.log", *ENGINE_FLAGS)
    try:
        server.wait_serving(timeout=STARTUP_TIMEOUT_S)
        with (
            Client(server.target, stream_timeout=CALL_TIMEOUT_S) as client,
            client.session() as session,
            AdminClient(server.admin_target, token=ADMIN_TOKEN) as admin,
        ):
            streams = [session.stream([5, 6, 7 + i], max_new_tokens=200, ignore_eos=True) for i in range(3)]
            for stream in streams:
                next(chunk for chunk in stream if chunk.token_ids)
            with admin.pause():  # no request can end before the kill
                server.process.send_signal(signal.SIGKILL)
                server.process.wait(timeout=CALL_TIMEOUT_S)
                killed_at = time.monotonic()
                for stream in streams:
                    with pytest.raises(errors.UnavailableError):
                        for _ in stream:
                            pass
                assert time.monotonic() - killed_at < CALL_TIMEOUT_S / 3
                with pytest.raises(errors.UnavailableError):
                    session.stream([5, 6, 7], max_new_tokens=2)
    finally:
        server.close()
