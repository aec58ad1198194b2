"""Status code -> exception mapping, and retries (AddRequest, and a generation before its first token;
on safe codes only)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from cbserve_client import AsyncClient, Client, errors
from cbserve_client._call import RETRYABLE_CODES, backoff_delay, call_with_retry
from cbserve_client.proto import generation_pb2

from tests.helpers.sdk_fakes import FakeRpcError

EXPECTED = {
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidArgumentError,
    grpc.StatusCode.NOT_FOUND: errors.NotFoundError,
    grpc.StatusCode.ALREADY_EXISTS: errors.AlreadyExistsError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.ResourceExhaustedError,
    grpc.StatusCode.UNAVAILABLE: errors.UnavailableError,
    grpc.StatusCode.UNAUTHENTICATED: errors.UnauthenticatedError,
    grpc.StatusCode.CANCELLED: errors.CancelledError,
    grpc.StatusCode.DEADLINE_EXCEEDED: errors.DeadlineExceededError,
    grpc.StatusCode.FAILED_PRECONDITION: errors.FailedPreconditionError,
    grpc.StatusCode.PERMISSION_DENIED: errors.PermissionDeniedError,
    grpc.StatusCode.ABORTED: errors.AbortedError,
    grpc.StatusCode.OUT_OF_RANGE: errors.OutOfRangeError,
    grpc.StatusCode.UNIMPLEMENTED: errors.UnimplementedError,
    grpc.StatusCode.INTERNAL: errors.InternalError,
    grpc.StatusCode.UNKNOWN: errors.InternalError,
    grpc.StatusCode.DATA_LOSS: errors.InternalError,
}


@pytest.mark.parametrize("code", [code for code in grpc.StatusCode if code != grpc.StatusCode.OK])
def test_every_error_status_code_has_its_own_exception_type(code: grpc.StatusCode) -> None:
    rpc_error = FakeRpcError(code, "what happened")
    mapped = errors.from_rpc_error(rpc_error)
    expected = EXPECTED[code]
    assert type(mapped) is expected
    assert isinstance(mapped, errors.CbserveError)
    assert mapped.code == code and mapped.details == "what happened"
    assert mapped.__cause__ is rpc_error
    assert code.name in str(mapped)
    # the numeric form (GenerationChunk.error_code) maps the same way
    assert type(errors.error_from_code(code.value[0], "x")) is expected


def test_unknown_numbers_and_odd_errors() -> None:
    assert type(errors.error_from_code(999)) is errors.InternalError  # treated as UNKNOWN
    bare = errors.from_rpc_error(grpc.RpcError("no code"))
    assert bare.code == grpc.StatusCode.UNKNOWN


def test_backoff_is_exponential_with_jitter() -> None:
    assert backoff_delay(0, 0.1, lambda: 0.5) == pytest.approx(0.1)
    assert backoff_delay(1, 0.1, lambda: 0.5) == pytest.approx(0.2)
    assert backoff_delay(2, 0.1, lambda: 0.5) == pytest.approx(0.4)
    assert backoff_delay(0, 0.1, lambda: 0.0) == pytest.approx(0.05)
    assert backoff_delay(0, 0.1, lambda: 0.999) == pytest.approx(0.1499, abs=1e-3)


class FlakyCallable:
    """A stub method that raises the given codes, in order, then succeeds."""

    def __init__(self, codes: list[grpc.StatusCode], result: Any = "ok") -> None:
        self.codes = list(codes)
        self.calls = 0
        self.timeouts: list[float | None] = []
        self.result = result

    def __call__(self, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        self.calls += 1
        self.timeouts.append(timeout)
        if self.codes:
            raise FakeRpcError(self.codes.pop(0), "flaky")
        return self.result


@pytest.mark.parametrize("code", sorted(RETRYABLE_CODES, key=str))
def test_retries_safe_codes(code: grpc.StatusCode) -> None:
    fn = FlakyCallable([code, code])
    sleeps: list[float] = []
    assert call_with_retry(lambda t: fn(timeout=t), timeout=10, sleep=sleeps.append, rng=lambda: 0.5) == "ok"
    assert fn.calls == 3
    assert sleeps == pytest.approx([0.1, 0.2])
    assert all(t is not None and t <= 10 for t in fn.timeouts)


def test_gives_up_after_three_tries() -> None:
    fn = FlakyCallable([grpc.StatusCode.UNAVAILABLE] * 5)
    with pytest.raises(errors.UnavailableError):
        call_with_retry(lambda t: fn(timeout=t), timeout=None, sleep=lambda s: None)
    assert fn.calls == 3


@pytest.mark.parametrize(
    "code",
    [c for c in grpc.StatusCode if c not in RETRYABLE_CODES and c != grpc.StatusCode.OK],
)
def test_never_retries_other_codes(code: grpc.StatusCode) -> None:
    fn = FlakyCallable([code])
    with pytest.raises(errors.CbserveError) as info:
        call_with_retry(lambda t: fn(timeout=t), timeout=None, sleep=lambda s: None)
    assert info.value.code == code
    assert fn.calls == 1


def test_no_retry_past_the_deadline() -> None:
    fn = FlakyCallable([grpc.StatusCode.UNAVAILABLE] * 3)
    with pytest.raises(errors.UnavailableError):
        call_with_retry(lambda t: fn(timeout=t), timeout=0.01, sleep=lambda s: None, base_delay=1.0)
    assert fn.calls == 1


def test_already_exists_after_a_retry_means_the_first_try_worked() -> None:
    fn = FlakyCallable([grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ALREADY_EXISTS])
    result = call_with_retry(
        lambda t: fn(timeout=t), timeout=None, sleep=lambda s: None, on_already_exists=lambda: "req-1"
    )
    assert result == "req-1" and fn.calls == 2


class FakeStub:
    """Stands in for GenerationServiceStub: each attribute is a callable we control."""

    def __init__(self, **methods: Any) -> None:
        self.__dict__.update(methods)


def _client_with(stub: FakeStub, monkeypatch: pytest.MonkeyPatch) -> Client:
    monkeypatch.setattr("cbserve_client._call.time.sleep", lambda s: None)
    client = Client("127.0.0.1:1")  # never connected: the stub is replaced
    client._stub = stub
    return client


def test_submit_retries_and_keeps_its_request_id(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []

    def add_request(message: generation_pb2.AddRequestRequest, **kwargs: Any) -> Any:
        seen.append(message.request.request_id)
        if len(seen) < 3:
            raise FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")
        return generation_pb2.AddRequestResponse(request_id=message.request.request_id)

    with _client_with(FakeStub(AddRequest=add_request), monkeypatch) as client:
        request_id = client.submit("hi")
    assert len(seen) == 3 and len(set(seen)) == 1 and seen[0] == request_id != ""


def test_submit_does_not_retry_invalid_argument(monkeypatch: pytest.MonkeyPatch) -> None:
    add_request = FlakyCallable([grpc.StatusCode.INVALID_ARGUMENT])
    client = _client_with(FakeStub(AddRequest=add_request), monkeypatch)
    with client, pytest.raises(errors.InvalidArgumentError):
        client.submit([1, 2], max_new_tokens=100_000)  # past the model's context: the server refuses
    assert add_request.calls == 1


def test_no_unary_call_but_submit_loops_in_python(monkeypatch: pytest.MonkeyPatch) -> None:
    """cancel and model_info are retried by the channel's service config (test_sdk_replicas.py), never
    by a Python loop on top of it, which would multiply the tries."""
    cancel = FlakyCallable([grpc.StatusCode.UNAVAILABLE])
    info = FlakyCallable([grpc.StatusCode.UNAVAILABLE])
    with _client_with(FakeStub(Cancel=cancel, GetModelInfo=info), monkeypatch) as client:
        with pytest.raises(errors.UnavailableError):
            client.cancel("r")
        with pytest.raises(errors.UnavailableError):
            client.model_info()
    assert cancel.calls == 1 and info.calls == 1
    assert cancel.timeouts == [60.0]  # unary calls get the client's default deadline


class FailingStream:
    """A streaming call that fails on first read."""

    def __init__(self, code: grpc.StatusCode) -> None:
        self.code = code
        self.cancelled = False

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        raise FakeRpcError(self.code, "server going away")

    def cancel(self) -> bool:
        self.cancelled = True
        return True


@pytest.mark.parametrize("code", sorted(RETRYABLE_CODES, key=str))
def test_only_a_generation_refused_unavailable_is_retried_by_the_sdk(
    code: grpc.StatusCode, monkeypatch: pytest.MonkeyPatch
) -> None:
    """generate and stream are tried retry_attempts times on UNAVAILABLE before any token; results (gRPC
    retries it, in the channel) and any other code are tried once."""
    calls: dict[str, list[dict[str, Any]]] = {"Generate": [], "StreamResults": []}

    def opener(method: str) -> Any:
        def open_stream(*args: Any, **kwargs: Any) -> FailingStream:
            calls[method].append(kwargs)
            return FailingStream(code)

        return open_stream

    stub = FakeStub(Generate=opener("Generate"), StreamResults=opener("StreamResults"))
    with _client_with(stub, monkeypatch) as client:
        with pytest.raises(errors.CbserveError) as info:
            client.generate("hi")
        assert info.value.code == code
        with pytest.raises(errors.CbserveError):
            list(client.results("r"))
        with pytest.raises(errors.CbserveError):
            list(client.stream("hi"))
    tries = 4 if code == grpc.StatusCode.UNAVAILABLE else 1
    assert (len(calls["Generate"]), len(calls["StreamResults"])) == (2 * tries, 1)
    timeouts = [c["timeout"] for c in calls["Generate"] + calls["StreamResults"]]
    assert all(590 < timeout <= 600.0 for timeout in timeouts), "the client's stream_timeout, for all tries"


def test_async_submit_retries_only_safe_codes() -> None:
    async def main() -> None:
        outcomes = [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INVALID_ARGUMENT]
        seen: list[str] = []

        async def add_request(message: generation_pb2.AddRequestRequest, **kwargs: Any) -> Any:
            seen.append(message.request.request_id)
            raise FakeRpcError(outcomes[len(seen) - 1], "x")

        async with AsyncClient("127.0.0.1:1") as client:
            client._stub = FakeStub(AddRequest=add_request)
            with pytest.raises(errors.InvalidArgumentError):
                await client.submit("hi")
        assert len(seen) == 2 and seen[0] == seen[1]

    asyncio.run(main())
