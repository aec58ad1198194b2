"""Every bad input gets its status code before the engine sees it, and the server keeps serving."""

from __future__ import annotations

import grpc
import pytest
import torch
from cbserve_client import AdminClient, Client, ResourceExhaustedError
from cbserve_client.proto import generation_pb2, generation_pb2_grpc, types_pb2

from engine import DuplicateRequestError
from tests.helpers.servers import ADMIN_TOKEN, RunningServer, engine_config_for_tests

OK_PROMPT = types_pb2.TokenIds(ids=[5, 6, 7])


def _request(**fields: object) -> types_pb2.GenerationRequest:
    if not {"token_ids", "text", "messages"} & set(fields):
        fields["token_ids"] = OK_PROMPT
    return types_pb2.GenerationRequest(**fields)  # type: ignore[arg-type]


def _sampling(**fields: object) -> types_pb2.GenerationRequest:
    return _request(sampling=types_pb2.SamplingParams(**fields))  # type: ignore[arg-type]


BAD_REQUESTS = {
    "no prompt": (types_pb2.GenerationRequest(), "prompt"),
    "empty token ids": (_request(token_ids=types_pb2.TokenIds(ids=[])), "token_ids"),
    "token id >= vocab": (_request(token_ids=types_pb2.TokenIds(ids=[5, 256])), "vocab"),
    "empty text": (_request(text=""), "text"),
    "chat without template": (
        _request(
            messages=types_pb2.ChatMessages(messages=[types_pb2.ChatMessage(role="user", content="hi")])
        ),
        "messages",
    ),
    "kv_on_weight_update unknown": (_request(kv_on_weight_update=7), "kv_on_weight_update"),
    "max_new_tokens 0": (_sampling(max_new_tokens=0), "max_new_tokens"),
    "max_new_tokens past the context": (_sampling(max_new_tokens=1022), "max_new_tokens"),
    # 3 + 1010 tokens fit the model's 1024 positions but not the test cache's 63 blocks of 16.
    "max_new_tokens past the KV cache": (_sampling(max_new_tokens=1010), "the whole cache holds 1008 tokens"),
    "temperature < 0": (_sampling(temperature=-0.5), "temperature"),
    "temperature NaN": (_sampling(temperature=float("nan")), "temperature"),
    "top_p 0": (_sampling(top_p=0.0), "top_p"),
    "top_p > 1": (_sampling(top_p=1.5), "top_p"),
    "top_logprobs too many": (_sampling(top_logprobs=21), "top_logprobs"),
    "eos id >= vocab": (_sampling(eos_token_ids=[300]), "eos_token_ids"),
    "request id not printable": (_request(request_id="a b\n"), "request_id"),
    "17 stop strings": (_sampling(stop=[f"s{i}" for i in range(17)]), "sampling.stop: at most 16"),
    "empty stop string": (_sampling(stop=["ok", ""]), "sampling.stop[1] must be 1 to 256"),
    "stop string too long": (_sampling(stop=["x" * 257]), "sampling.stop[0] must be 1 to 256"),
    "repetition_penalty 0": (_sampling(repetition_penalty=0.0), "sampling.repetition_penalty"),
    "repetition_penalty inf": (_sampling(repetition_penalty=float("inf")), "sampling.repetition_penalty"),
    "presence_penalty > 2": (
        _sampling(presence_penalty=2.5),
        "sampling.presence_penalty must be a finite number in [-2, 2]",
    ),
    "frequency_penalty NaN": (_sampling(frequency_penalty=float("nan")), "sampling.frequency_penalty"),
    "logit_bias id >= vocab": (_sampling(logit_bias={256: 1.0}), "sampling.logit_bias: token id 256"),
    "logit_bias > 100": (
        _sampling(logit_bias={5: 100.5}),
        "sampling.logit_bias[5] must be a finite number in [-100, 100]",
    ),
    "logit_bias NaN": (_sampling(logit_bias={5: float("nan")}), "sampling.logit_bias[5]"),
    "301 logit_bias entries": (
        _sampling(logit_bias={token: 1.0 for token in range(301)}),
        "sampling.logit_bias: at most 300 entries",
    ),
    "min_new_tokens > max_new_tokens": (
        _sampling(max_new_tokens=4, min_new_tokens=5),
        "sampling.min_new_tokens (5) must not exceed max_new_tokens (4)",
    ),
}


@pytest.mark.parametrize("name", BAD_REQUESTS)
def test_bad_field_is_invalid_argument_naming_it(served: RunningServer, client: Client, name: str) -> None:
    request, field = BAD_REQUESTS[name]
    with grpc.insecure_channel(served.target) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            stub.AddRequest(generation_pb2.AddRequestRequest(request=request), timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in caught.value.details()
    assert client.generate([5, 6, 7], max_new_tokens=2).token_ids  # still serving


# Bytes that are no protobuf message (a field key of 0xff.. runs past the varint limit).
CORRUPT_BYTES = b"\xff\xff\xff\xff"
AUTHORIZED = (("authorization", f"Bearer {ADMIN_TOKEN}"),)


def _call_with_corrupt_bytes(
    channel: grpc.Channel, method: str, kind: str, metadata: tuple[tuple[str, str], ...] = ()
) -> grpc.RpcError:
    """Sends bytes that do not decode to `method` (no serializer: the bytes go out as they are)."""
    multi_callable = getattr(channel, kind)(method)
    request = CORRUPT_BYTES if kind.startswith("unary") else iter([CORRUPT_BYTES])
    with pytest.raises(grpc.RpcError) as caught:
        response = multi_callable(request, timeout=10, metadata=metadata)
        if kind.endswith("stream"):
            list(response)
    return caught.value


@pytest.mark.parametrize(
    ("method", "kind", "message_type"),
    [
        ("GenerationService/AddRequest", "unary_unary", "AddRequestRequest"),
        ("GenerationService/StreamResults", "unary_stream", "StreamResultsRequest"),
        ("GenerationService/Generate", "stream_stream", "GenerateRequest"),
        ("AdminService/GetStatus", "unary_unary", "GetStatusRequest"),
        ("AdminService/UpdateWeights", "stream_unary", "UpdateWeightsRequest"),
    ],
)
def test_bytes_that_are_no_message_are_invalid_argument_naming_the_type(
    served: RunningServer, client: Client, method: str, kind: str, message_type: str
) -> None:
    """Not UNKNOWN, and a Generate stream ends at once instead of waiting for its deadline."""
    admin = method.startswith("AdminService")
    with grpc.insecure_channel(served.admin_target if admin else served.target) as channel:
        error = _call_with_corrupt_bytes(
            channel, f"/cbserve.v1.{method}", kind, metadata=AUTHORIZED if admin else ()
        )
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert f"cbserve.v1.{message_type}" in error.details()
    assert client.generate([5, 6, 7], max_new_tokens=2).token_ids  # still serving


def test_a_caller_without_the_admin_token_is_unauthenticated_before_its_message_is_read(
    served: RunningServer,
) -> None:
    with grpc.insecure_channel(served.admin_target) as channel:
        error = _call_with_corrupt_bytes(channel, "/cbserve.v1.AdminService/GetStatus", "unary_unary")
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED


def test_duplicate_live_id_is_already_exists_and_rejection_on_generate_is_a_failed_chunk(
    served: RunningServer, client: Client
) -> None:
    with grpc.insecure_channel(served.target) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        long = _sampling(max_new_tokens=900, ignore_eos=True)
        long.request_id = "dup"
        stub.AddRequest(generation_pb2.AddRequestRequest(request=long), timeout=10)
        with pytest.raises(grpc.RpcError) as caught:
            stub.AddRequest(generation_pb2.AddRequestRequest(request=long), timeout=10)
        assert caught.value.code() == grpc.StatusCode.ALREADY_EXISTS
        first = next(stub.Generate(iter([generation_pb2.GenerateRequest(add=long)]), timeout=10))
        assert first.chunk.status == types_pb2.REQUEST_STATUS_FAILED
        assert first.chunk.error_code == grpc.StatusCode.ALREADY_EXISTS.value[0]
    assert client.cancel("dup") is True


def test_an_id_the_engine_still_holds_is_already_exists_even_once_its_record_here_ended(
    served: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stop string ends a request's record at once, and the engine lets the id go only when the cancel
    reaches its loop: a new request with that id in between is refused by the engine, with the same code
    a live record gets (it was INVALID_ARGUMENT, seen beside a busy neighbour process)."""
    host = served.server.slot.host
    assert host is not None

    def still_in_flight(*args: object, **kwargs: object) -> None:
        raise DuplicateRequestError("request_id 'dup-held' is already in flight")

    monkeypatch.setattr(host.manager, "add_request", still_in_flight)
    with grpc.insecure_channel(served.target) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        request = _sampling(max_new_tokens=4)
        request.request_id = "dup-held"
        with pytest.raises(grpc.RpcError) as caught:
            stub.AddRequest(generation_pb2.AddRequestRequest(request=request), timeout=10)
    assert caught.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "already in flight" in (caught.value.details() or "")


def test_full_queue_is_resource_exhausted(model: torch.nn.Module) -> None:
    running = RunningServer(model, config=engine_config_for_tests(max_queue_size=1))
    try:
        running.load()
        with Client(running.target) as client, AdminClient(running.admin_target, token=ADMIN_TOKEN) as admin:
            with admin.paused():  # nothing gets scheduled, so the queue fills
                first = client.submit([5, 6, 7], max_new_tokens=2)
                with pytest.raises(ResourceExhaustedError):
                    client.submit([5, 6, 7], max_new_tokens=2, timeout=3)
            assert [chunk for chunk in client.results(first)][-1].status == "finished"
    finally:
        running.close()
