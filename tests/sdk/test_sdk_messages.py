"""Request construction from the client's keyword arguments; chunk conversion and assembly."""

from __future__ import annotations

import datetime as dt
from typing import Any

import grpc
import pytest
from cbserve_client import CbserveError, Chunk
from cbserve_client._convert import (
    CompletionBuilder,
    build_request,
    build_sampling,
    chunk_from_proto,
    pause_request,
    rejection_error,
)
from cbserve_client.errors import InvalidArgumentError
from cbserve_client.proto import admin_pb2, types_pb2

# Every field with presence: a field added to the proto is covered without editing this list.
OPTIONAL_SAMPLING_FIELDS = [
    field.name for field in types_pb2.SamplingParams.DESCRIPTOR.fields if field.has_presence
]
# The optional numbers: their zero is a value of its own. (skip_special_tokens is a bool, kept strict,
# and structured_output a message.)
OPTIONAL_NUMBER_FIELDS = [
    field.name
    for field in types_pb2.SamplingParams.DESCRIPTOR.fields
    if field.has_presence and field.message_type is None and field.type != field.TYPE_BOOL
]


def test_unset_sampling_kwargs_stay_unset() -> None:
    params = build_sampling()
    for name in OPTIONAL_SAMPLING_FIELDS:
        assert not params.HasField(name), name
    assert list(params.eos_token_ids) == []
    assert params.ignore_eos is False and params.logprobs is False
    assert params.ByteSize() == 0


# Fields whose zero the server refuses (test_sdk_validation.py): the SDK refuses it too.
ZERO_REFUSED = {"max_new_tokens", "top_p", "repetition_penalty", "n"}


@pytest.mark.parametrize("name", [name for name in OPTIONAL_NUMBER_FIELDS if name not in ZERO_REFUSED])
def test_explicit_zero_differs_from_unset(name: str) -> None:
    params = build_sampling(**{name: 0})
    assert params.HasField(name)
    assert getattr(params, name) == 0
    for other in OPTIONAL_SAMPLING_FIELDS:
        if other != name:
            assert not params.HasField(other)
    # ...and the presence survives the wire.
    assert types_pb2.SamplingParams.FromString(params.SerializeToString()).HasField(name)


@pytest.mark.parametrize("name", sorted(ZERO_REFUSED))
def test_explicit_zero_is_refused_where_the_server_refuses_it(name: str) -> None:
    with pytest.raises(InvalidArgumentError, match=f"sampling.{name} must be"):
        build_sampling(**{name: 0})


def test_all_sampling_kwargs() -> None:
    request = build_request(
        [1, 2, 3],
        max_new_tokens=16,
        temperature=0.7,
        top_k=50,
        top_p=0.9,
        seed=1234,
        eos_token_ids=[2, 32000],
        ignore_eos=True,
        logprobs=True,
        top_logprobs=5,
        stop=["\n\n", "User:"],
        repetition_penalty=1.2,
        presence_penalty=-0.5,
        frequency_penalty=0.25,
        min_new_tokens=4,
        logit_bias={7: -100.0, 9: 2.5},
        request_id="my-req",
        record_timestamps=True,
    )
    assert request.request_id == "my-req"
    assert request.WhichOneof("prompt") == "token_ids"
    assert list(request.token_ids.ids) == [1, 2, 3]
    assert request.record_timestamps is True
    s = request.sampling
    assert s.max_new_tokens == 16
    assert s.temperature == pytest.approx(0.7)
    assert (s.top_k, s.seed, s.top_logprobs) == (50, 1234, 5)
    assert s.top_p == pytest.approx(0.9)
    assert list(s.eos_token_ids) == [2, 32000]
    assert s.ignore_eos and s.logprobs
    assert list(s.stop) == ["\n\n", "User:"]
    assert s.repetition_penalty == pytest.approx(1.2)
    assert (s.presence_penalty, s.frequency_penalty, s.min_new_tokens) == (-0.5, 0.25, 4)
    assert dict(s.logit_bias) == {7: -100.0, 9: 2.5}


def test_text_prompt() -> None:
    request = build_request("Hello", temperature=0)
    assert request.WhichOneof("prompt") == "text"
    assert request.text == "Hello"
    assert request.request_id == ""  # the server picks one
    assert request.sampling.HasField("temperature") and request.sampling.temperature == 0.0


def test_chat_prompt() -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    request = build_request(messages)
    assert request.WhichOneof("prompt") == "messages"
    assert [(m.role, m.content) for m in request.messages.messages] == [
        ("system", "Be brief."),
        ("user", "Hi"),
    ]
    assert not request.messages.HasField("add_generation_prompt")  # server default: true
    request = build_request(messages, add_generation_prompt=False)
    assert request.messages.HasField("add_generation_prompt")
    assert request.messages.add_generation_prompt is False


@pytest.mark.parametrize(
    ("prompt", "kwargs"),
    [
        (b"bytes", {}),
        (42, {}),
        ([1, "2"], {}),
        ([1, True], {}),
        ([{"role": "user"}], {}),
        ([{"role": "user", "content": "x", "name": "bob"}], {}),
        ("text", {"max_new_tokens": 1.5}),
        ("text", {"max_new_tokens": True}),
        ("text", {"temperature": "hot"}),
        ("text", {"ignore_eos": 1}),
        ("text", {"eos_token_ids": 2}),
        ("text", {"stop": "User:"}),
        ("text", {"stop": ["ok", 3]}),
        ("text", {"presence_penalty": "high"}),
        ("text", {"min_new_tokens": 2.0}),
        ("text", {"logit_bias": [(7, 1.0)]}),
        ("text", {"logit_bias": {"7": 1.0}}),
        ("text", {"logit_bias": {7: "up"}}),
        ("text", {"request_id": 7}),
        ("text", {"add_generation_prompt": True}),
        ("text", {"top_n": 3}),
    ],
)
def test_trivial_type_checks(prompt: object, kwargs: dict[str, object]) -> None:
    with pytest.raises(TypeError):
        build_request(prompt, **kwargs)


def test_model_dependent_bounds_are_left_to_the_server() -> None:
    request = build_request([999_999], max_new_tokens=100_000, eos_token_ids=[999_999])
    assert request.sampling.max_new_tokens == 100_000


def test_pause_request_modes() -> None:
    assert pause_request("keep", None).mode == admin_pb2.PAUSE_MODE_KEEP
    assert pause_request("wait", None).mode == admin_pb2.PAUSE_MODE_WAIT
    abort = pause_request("abort", 30)
    assert abort.mode == admin_pb2.PAUSE_MODE_ABORT
    assert abort.HasField("lease_s") and abort.lease_s == 30.0
    assert not pause_request("keep", None).HasField("lease_s")
    with pytest.raises(ValueError):
        pause_request("freeze", None)


def _pb_chunk(index: int, ids: list[int], text: str | None, **kw: Any) -> types_pb2.GenerationChunk:
    chunk = types_pb2.GenerationChunk(request_id="r", token_index=index, token_ids=ids, **kw)
    if text is not None:
        chunk.text = text
    return chunk


def test_chunk_from_proto() -> None:
    pb = _pb_chunk(
        4,
        [10, 11],
        "ab",
        status=types_pb2.REQUEST_STATUS_FINISHED,
        finish_reason=types_pb2.FINISH_REASON_LENGTH,
        weight_version=3,
        token_timestamps=[1.0, 2.0],
    )
    pb.logprobs.add(logprob=-0.1).top_logprobs.add(token_id=10, logprob=-0.1)
    pb.logprobs.add(logprob=-0.2)
    pb.usage.prompt_tokens = 5
    pb.timings.queued_at.FromSeconds(1_700_000_000)
    pb.timings.time_to_first_token_s = 0.5
    chunk = chunk_from_proto(pb)
    assert chunk.request_id == "r" and chunk.token_index == 4 and chunk.token_ids == (10, 11)
    assert chunk.text == "ab"
    assert chunk.status == "finished" and chunk.finish_reason == "length" and chunk.finished
    assert chunk.weight_version == 3
    assert chunk.token_timestamps == (1.0, 2.0)
    assert [lp.token_id for lp in chunk.logprobs] == [10, 11]
    assert chunk.logprobs[0].top[0].token_id == 10
    assert chunk.logprobs[0].logprob == pytest.approx(-0.1)
    assert chunk.usage is not None and chunk.usage.prompt_tokens == 5
    assert chunk.timings is not None
    assert chunk.timings.queued_at == dt.datetime.fromtimestamp(1_700_000_000, tz=dt.UTC)
    assert chunk.timings.first_token_at is None
    assert chunk.timings.time_to_first_token_s == 0.5 and chunk.timings.queue_time_s is None


def test_chunk_text_unset_means_no_tokenizer() -> None:
    assert chunk_from_proto(_pb_chunk(0, [1], None)).text is None
    assert chunk_from_proto(_pb_chunk(0, [1], "")).text == ""
    pending = chunk_from_proto(_pb_chunk(0, [], None, status=types_pb2.REQUEST_STATUS_QUEUED))
    assert pending.status == "queued" and pending.finish_reason is None and not pending.finished


def _chunk(index: int, ids: tuple[int, ...], text: str | None, status: str = "decoding", **kw: Any) -> Chunk:
    return Chunk(request_id="r", token_index=index, token_ids=ids, text=text, status=status, **kw)


def test_completion_assembly_concatenates_deltas() -> None:
    builder = CompletionBuilder("r")
    builder.add(_chunk(0, (), "", status="queued"))
    builder.add(_chunk(0, (1, 2), "Hé", weight_version=1))
    # the server held back the first byte of "ö" with token 3, and sent it with token 4
    builder.add(_chunk(2, (3,), "", weight_version=1))
    builder.add(_chunk(3, (4,), "ö!", weight_version=2))
    assert not builder.done
    builder.add(_chunk(4, (), "", status="finished", finish_reason="eos"))
    completion = builder.build()
    assert completion.token_ids == [1, 2, 3, 4]
    assert completion.text == "Héö!"
    assert completion.finish_reason == "eos"
    assert completion.weight_version == 2 and completion.weight_versions == [1, 2]
    assert completion.logprobs is None and completion.token_timestamps is None


def test_completion_without_tokenizer_has_no_text() -> None:
    builder = CompletionBuilder("r")
    builder.add(_chunk(0, (1, 2), None))
    builder.add(_chunk(2, (3,), None, status="finished", finish_reason="length"))
    completion = builder.build()
    assert completion.text is None
    assert completion.token_ids == [1, 2, 3]


def test_completion_skips_resent_tokens_and_rejects_gaps() -> None:
    builder = CompletionBuilder("r", from_index=2)
    builder.add(_chunk(2, (3, 4), None))
    builder.add(_chunk(3, (4, 5), None))  # token 4 sent again (e.g. after a reconnect)
    assert builder.token_ids == [3, 4, 5]
    with pytest.raises(CbserveError) as info:
        builder.add(_chunk(7, (8,), None))
    assert info.value.code == grpc.StatusCode.DATA_LOSS


def test_completion_of_failed_request_carries_the_error() -> None:
    builder = CompletionBuilder("r")
    builder.add(_chunk(0, (1,), "a"))
    builder.add(_chunk(1, (), "", status="failed", finish_reason="error", error="boom", error_code=13))
    completion = builder.build()
    assert completion.finish_reason == "error" and completion.error == "boom"
    assert completion.token_ids == [1]


def test_stream_that_ends_early_is_an_error() -> None:
    builder = CompletionBuilder("r")
    builder.add(_chunk(0, (1,), "a"))
    with pytest.raises(CbserveError, match="ended before"):
        builder.build()


def test_rejection_error_only_for_rejection_codes() -> None:
    rejected = _chunk(0, (), None, status="failed", finish_reason="error", error="bad", error_code=3)
    error = rejection_error(rejected)
    assert isinstance(error, InvalidArgumentError) and error.details == "bad"
    crashed = _chunk(0, (), None, status="failed", finish_reason="error", error="oom", error_code=13)
    assert rejection_error(crashed) is None
    assert rejection_error(_chunk(0, (1,), None)) is None
