"""The Python SDK refuses, before any call, exactly the request values the server refuses, with the
server's bound in the message (the bounds come from sdk/sampling_bounds.json via _bounds.py)."""

from __future__ import annotations

import math
from typing import Any

import pytest
from cbserve_client import _bounds
from cbserve_client._convert import build_request
from cbserve_client.errors import InvalidArgumentError
from cbserve_client.proto import types_pb2

from service import validation

PROMPT = [5, 6, 7]
LIMITS = validation.ModelLimits(vocab_size=1024, max_context_length=1024, default_max_new_tokens=20)


class AnyTokenizer:
    """Enough of a tokenizer for the server to accept stop strings."""

    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": list(text.encode())}


def _server_answer(request_id: str = "", **sampling: Any) -> str | None:
    """The server's INVALID_ARGUMENT message for these values on the wire, or None if it accepts them."""
    request = types_pb2.GenerationRequest(
        request_id=request_id,
        token_ids=types_pb2.TokenIds(ids=PROMPT),
        sampling=types_pb2.SamplingParams(**sampling),
    )
    try:
        validation.prepare(request, LIMITS, AnyTokenizer())
    except validation.RequestRejected as rejected:
        return rejected.message
    return None


PAST_THE_BOUNDS: list[dict[str, Any]] = [
    {"max_new_tokens": _bounds.MIN_MAX_NEW_TOKENS - 1},
    {"top_logprobs": _bounds.MAX_TOP_LOGPROBS + 1},
    {"presence_penalty": _bounds.MAX_ABS_PRESENCE_FREQUENCY_PENALTY + 0.5},
    {"frequency_penalty": -_bounds.MAX_ABS_PRESENCE_FREQUENCY_PENALTY - 0.5},
    {"repetition_penalty": 0.0},
    {"temperature": -1.0},
    {"temperature": math.inf},
    {"top_p": 0.0},
    {"top_p": 1.5},
    {"max_new_tokens": 3, "min_new_tokens": 4},
    {"logit_bias": {5: _bounds.MAX_ABS_LOGIT_BIAS + 1}},
    {"logit_bias": dict.fromkeys(range(_bounds.MAX_LOGIT_BIAS_ENTRIES + 1), 1.0)},
    {"stop": ["x"] * (_bounds.MAX_STOP_STRINGS + 1)},
    {"stop": ["x" * (_bounds.MAX_STOP_STRING_CHARS + 1)]},
    {"stop": [""]},
    {"request_id": "r" * (_bounds.MAX_REQUEST_ID_BYTES + 1)},
    {"request_id": "has space"},
    {"n": 0},
    {"n": _bounds.MAX_N + 1},
]

AT_THE_BOUNDS: list[dict[str, Any]] = [
    {"max_new_tokens": _bounds.MIN_MAX_NEW_TOKENS},
    {"top_logprobs": _bounds.MAX_TOP_LOGPROBS},
    {"presence_penalty": _bounds.MAX_ABS_PRESENCE_FREQUENCY_PENALTY},
    {"frequency_penalty": -_bounds.MAX_ABS_PRESENCE_FREQUENCY_PENALTY},
    {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "repetition_penalty": 0.5, "seed": 2**64 - 1},
    {"max_new_tokens": 4, "min_new_tokens": 4},
    {"logit_bias": {5: -_bounds.MAX_ABS_LOGIT_BIAS}},
    {"logit_bias": dict.fromkeys(range(_bounds.MAX_LOGIT_BIAS_ENTRIES), 1.0)},
    {"stop": ["x" * _bounds.MAX_STOP_STRING_CHARS] * _bounds.MAX_STOP_STRINGS},
    {"request_id": "r" * _bounds.MAX_REQUEST_ID_BYTES},
    {"n": 1},
    {"n": _bounds.MAX_N},
]


@pytest.mark.parametrize("values", PAST_THE_BOUNDS, ids=lambda values: ",".join(values))
def test_a_value_the_server_refuses_is_refused_first_with_the_server_s_message(
    values: dict[str, Any],
) -> None:
    server = _server_answer(**values)
    assert server is not None, f"the server accepts {values}: the test's case is wrong"
    with pytest.raises(InvalidArgumentError) as refused:
        build_request(PROMPT, **values)
    client = refused.value.details
    # The server's message, word for word; the SDK may add the value it got.
    assert client.startswith(server), f"SDK:    {client}\nserver: {server}"


@pytest.mark.parametrize("values", AT_THE_BOUNDS, ids=lambda values: ",".join(values))
def test_a_value_at_the_bound_passes_both(values: dict[str, Any]) -> None:
    assert _server_answer(**values) is None
    build_request(PROMPT, **values)


@pytest.mark.parametrize(
    ("prompt", "values", "message"),
    [
        (PROMPT, {"max_new_tokens": 2**32}, "sampling.max_new_tokens must be at most 4294967295"),
        (PROMPT, {"top_k": -1}, "sampling.top_k must be an int >= 0 (0 disables it), got -1"),
        (PROMPT, {"seed": -1}, "sampling.seed must be an int >= 0, got -1"),
        (PROMPT, {"eos_token_ids": [-2]}, "sampling.eos_token_ids[0] must be an int >= 0, got -2"),
        (PROMPT, {"logit_bias": {-1: 1.0}}, "sampling.logit_bias key must be an int >= 0, got -1"),
        ([1, -3], {}, "token_ids.ids[1] must be an int >= 0, got -3"),
        ([], {}, "token_ids.ids must not be empty"),
        ("", {}, "text must not be empty"),
    ],
)
def test_values_the_wire_cannot_carry_are_refused_by_name(
    prompt: Any, values: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidArgumentError) as refused:
        build_request(prompt, **values)
    assert refused.value.details.startswith(message), refused.value.details


def test_an_empty_request_id_gets_a_fresh_one_the_client_can_follow() -> None:
    from cbserve_client._convert import with_request_id

    assert len(with_request_id({"request_id": ""})["request_id"]) == 32
    assert with_request_id({"request_id": "mine"})["request_id"] == "mine"


@pytest.mark.parametrize("kind", ["json_schema", "regex", "grammar"])
def test_a_too_long_structured_output_spec_is_refused_by_both_naming_the_field_the_caller_set(
    kind: str,
) -> None:
    too_long = "x" * (_bounds.MAX_STRUCTURED_OUTPUT_CHARS + 1)
    server = _server_answer(structured_output=types_pb2.StructuredOutput(**{kind: too_long}))
    with pytest.raises(InvalidArgumentError) as refused:
        build_request(PROMPT, **{kind: too_long})
    expected = f"sampling.structured_output.{kind} must be at most 65536 characters, got 65537"
    assert (server, refused.value.details) == (expected, expected)
