"""Bad input: over a thousand hypothesis-made requests against one server — random and extreme field
values, invalid UTF-8, huge token ids, empty and oversized prompts, unknown ids. Each gets the status
code the wire contract gives it, every request accepted runs to its end, and the server stays healthy.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from cbserve_client import AdminClient, Client
from cbserve_client.proto import generation_pb2, generation_pb2_grpc, types_pb2
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from tests.helpers.models import VOCAB_SIZE, tiny_model
from tests.helpers.reliability import PoolEntry, final_outcomes, mismatch, read_to_end, report
from tests.helpers.servers import (
    ADMIN_TOKEN,
    SERVING,
    ByteTokenizer,
    RunningServer,
    engine_config_for_tests,
    health_status,
    wait_all_blocks_free,
)

pytestmark = pytest.mark.reliability

MIN_EXAMPLES = 1_000
CONTEXT = 1024  # the tiny models' max_position_embeddings
MAX_REQUEST_ID_BYTES = 128
MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_LOGIT_BIAS_ENTRIES = 300
MAX_ABS_LOGIT_BIAS = 100.0
MAX_STOP_TOKEN_IDS = 64
MAX_PROMPT_LOGPROBS = 20
MAX_STRUCTURED_OUTPUT_CHARS = 65536
MAX_N = 128
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
# gRPC's default limit on a received message.
MAX_MESSAGE_BYTES = 4 * 2**20
UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1
FLOAT32_MAX = 3.4028234663852886e38
# Accepted requests generating more than this are cancelled at once, so the run stays short; the
# others run to their end, which must come.
RUN_TO_END_MAX_TOKENS = 20
# What a request that leaves max_new_tokens unset generates at most (the tiny models set no default).
DEFAULT_MAX_NEW_TOKENS = 20
CALL_TIMEOUT_S = 30.0
OK = grpc.StatusCode.OK
INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT
# Byte sequences that are not UTF-8: a stray continuation byte, a truncated pair, a surrogate, an
# overlong encoding, a 5-byte form and an invalid lead byte.
INVALID_UTF8 = (b"\x80", b"\xc3\x28", b"\xed\xa0\x80", b"\xc0\xaf", b"\xf8\x88\x80\x80\x80", b"\xff")
# A few fixed ids, so that later requests reuse the ids of live ones.
REUSED_IDS = ("dup-a", "dup-b")
# Replaced by an id never used before (hypothesis draws the same few strings over and over).
FRESH_ID = "<fresh>"


@dataclass
class Tally:
    """What the run saw: status codes by RPC, accepted requests left to run to their end, ids used."""

    codes: Counter[str] = field(default_factory=Counter)
    examples: int = 0
    used_ids: set[str] = field(default_factory=set)
    running_to_end: set[str] = field(default_factory=set)


@pytest.fixture(scope="module")
def served(prompt_pool: list[PoolEntry]) -> Iterator[RunningServer]:
    # 72 blocks of 16 hold a whole context (1024 tokens): any request the validation accepts can run.
    running = RunningServer(
        tiny_model("llama"), tokenizer=ByteTokenizer(), config=engine_config_for_tests(num_blocks=72)
    )
    try:
        running.load()
        yield running
    finally:
        running.close()


# ---------------------------------------------------------------------------------------------------
# Strategies. A request is valid with values up to the edges of what is allowed (it runs, so extreme
# sampling values reach the engine), or valid but for one field drawn from its whole wire range (so
# each check is met alone), or drawn from the whole wire range in every field.


def optional(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(st.none(), strategy)


def edges(*values: Any) -> st.SearchStrategy[Any]:
    return st.sampled_from(values)


VALID = {
    "prompt_kind": edges("token_ids", "text"),
    "request_id": st.one_of(
        st.just(""),
        st.sampled_from(REUSED_IDS),
        st.text(
            st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=MAX_REQUEST_ID_BYTES
        ),
    ),
    "token_ids": st.one_of(
        st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=40),
        st.builds(lambda token: [token] * (CONTEXT - 1), st.integers(0, VOCAB_SIZE - 1)),
    ),
    "text": st.text(min_size=1, max_size=40),
    "eos_token_id": st.integers(0, VOCAB_SIZE - 1),
    "max_new_tokens": st.one_of(st.integers(1, RUN_TO_END_MAX_TOKENS), edges(1, 17, 100)),
    "temperature": st.one_of(
        st.floats(0, FLOAT32_MAX, width=32), edges(0.0, -0.0, 1e-45, 1e-30, 1.0, FLOAT32_MAX)
    ),
    "top_k": st.one_of(st.integers(0, 300), edges(0, 1, VOCAB_SIZE, UINT32_MAX)),
    "top_p": st.one_of(st.floats(0, 1, exclude_min=True, width=32), edges(1e-45, 1.0)),
    "seed": st.one_of(st.integers(0, UINT64_MAX), edges(0, UINT64_MAX)),
    "top_logprobs": st.integers(0, MAX_TOP_LOGPROBS),
    "stop": st.lists(st.text(min_size=1, max_size=6), max_size=3),
    "repetition_penalty": st.one_of(st.floats(0.5, 3.0, width=32), edges(1e-45, 1.0, FLOAT32_MAX)),
    "presence_penalty": st.one_of(st.floats(-2.0, 2.0, width=32), edges(-2.0, 0.0, 2.0)),
    "frequency_penalty": st.one_of(st.floats(-2.0, 2.0, width=32), edges(-2.0, 0.0, 2.0)),
    "min_new_tokens": st.integers(0, 4),
    "min_p": st.one_of(st.floats(0, 1, width=32), edges(0.0, 1e-45, 1.0)),
    "skip_special_tokens": st.booleans(),
    "prompt_logprobs": st.integers(0, MAX_PROMPT_LOGPROBS),
    "stop_token_ids": st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=3),
    "priority": st.one_of(st.integers(-5, 5), edges(INT32_MIN, INT32_MAX)),
    "n": st.one_of(st.integers(1, 4), edges(1, 2)),
    # Left unset in valid requests: whether a schema compiles is the grammar library's to say.
    "structured_output": st.none(),
    "logit_bias": st.dictionaries(
        st.integers(0, VOCAB_SIZE - 1),
        st.floats(-MAX_ABS_LOGIT_BIAS, MAX_ABS_LOGIT_BIAS, width=32),
        max_size=4,
    ),
}
WILD = {
    "prompt_kind": edges("token_ids", "text", "messages", "none"),
    "request_id": st.one_of(
        st.text(max_size=MAX_REQUEST_ID_BYTES + 12),
        st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=120, max_size=135),
    ),
    "token_ids": st.one_of(
        st.lists(st.integers(0, UINT32_MAX), max_size=40),
        # Past the context, then past gRPC's message limit (5 bytes per id).
        st.builds(
            lambda length, token: [token] * length,
            edges(CONTEXT - 1, CONTEXT, 4096, 1_000_000),
            edges(3, VOCAB_SIZE, UINT32_MAX),
        ),
    ),
    "text": st.one_of(
        st.text(max_size=40),
        st.builds(lambda count, char: char * count, edges(511, 512, 700), edges("a", "é")),
    ),
    "eos_token_id": st.one_of(st.integers(0, UINT32_MAX), edges(VOCAB_SIZE, UINT32_MAX)),
    "max_new_tokens": st.one_of(st.integers(0, 24), edges(0, CONTEXT - 1, CONTEXT, UINT32_MAX)),
    "temperature": st.one_of(st.floats(width=32), edges(-1.0, -1e-45, math.inf, -math.inf, math.nan)),
    "top_k": st.integers(0, UINT32_MAX),
    "top_p": st.one_of(st.floats(width=32), edges(0.0, -0.0, 1.0000001, 2.0, math.inf, math.nan)),
    "seed": st.integers(0, UINT64_MAX),
    "top_logprobs": st.one_of(st.integers(0, MAX_TOP_LOGPROBS + 2), edges(UINT32_MAX)),
    "stop": st.one_of(
        st.lists(st.text(max_size=8), max_size=MAX_STOP_STRINGS + 2),
        st.builds(
            lambda count, length: ["x" * length] * count,
            edges(1, MAX_STOP_STRINGS, MAX_STOP_STRINGS + 1),
            edges(0, 1, MAX_STOP_STRING_CHARS, MAX_STOP_STRING_CHARS + 1),
        ),
    ),
    "repetition_penalty": st.one_of(st.floats(width=32), edges(0.0, -0.0, -1.0, math.inf, math.nan)),
    "presence_penalty": st.one_of(st.floats(width=32), edges(-2.0000002, 2.0000002, math.inf, math.nan)),
    "frequency_penalty": st.one_of(st.floats(width=32), edges(-2.0000002, 2.0000002, -math.inf, math.nan)),
    "min_new_tokens": st.one_of(st.integers(0, 40), edges(CONTEXT, UINT32_MAX)),
    "min_p": st.one_of(st.floats(width=32), edges(-1e-45, 1.0000001, 2.0, math.inf, math.nan)),
    "skip_special_tokens": st.booleans(),
    "prompt_logprobs": st.one_of(st.integers(0, MAX_PROMPT_LOGPROBS + 4), edges(UINT32_MAX)),
    "stop_token_ids": st.one_of(
        st.lists(st.integers(0, UINT32_MAX), max_size=4),
        st.builds(lambda count: [3] * count, edges(MAX_STOP_TOKEN_IDS, MAX_STOP_TOKEN_IDS + 1)),
    ),
    "priority": st.integers(INT32_MIN, INT32_MAX),
    "n": st.one_of(st.integers(0, 6), edges(0, MAX_N + 1, UINT32_MAX)),
    # Every one of these is refused before it reaches a grammar compiler.
    "structured_output": st.one_of(
        st.builds(
            lambda kind: types_pb2.StructuredOutput(**{kind: ""}), edges("json_schema", "regex", "grammar")
        ),
        st.just(types_pb2.StructuredOutput(json_object=False)),
        st.just(types_pb2.StructuredOutput(regex="a" * (MAX_STRUCTURED_OUTPUT_CHARS + 1))),
        st.just(types_pb2.StructuredOutput()),
    ),
    "logit_bias": st.one_of(
        st.dictionaries(st.integers(0, UINT32_MAX), st.floats(width=32), max_size=4),
        st.builds(
            lambda count, bias: dict.fromkeys(range(count), bias),
            edges(MAX_LOGIT_BIAS_ENTRIES, MAX_LOGIT_BIAS_ENTRIES + 1),
            edges(-MAX_ABS_LOGIT_BIAS, MAX_ABS_LOGIT_BIAS, 100.00001, math.nan),
        ),
    ),
}
# The optional scalar fields, from the proto: one added there without a strategy above fails here.
SAMPLING_FIELDS = tuple(
    field.name
    for field in types_pb2.SamplingParams.DESCRIPTOR.fields
    if field.has_presence and field.message_type is None
)


@st.composite
def generation_requests(draw: st.DrawFn) -> types_pb2.GenerationRequest:
    mode = draw(edges("valid", "one wild field", "all wild"))
    wild_field = draw(st.sampled_from(sorted(WILD))) if mode == "one wild field" else None

    def pick(name: str) -> st.SearchStrategy[Any]:
        return WILD[name] if mode == "all wild" or name == wild_field else VALID[name]

    request = types_pb2.GenerationRequest(
        request_id=draw(pick("request_id")),
        record_timestamps=draw(st.booleans()),
        priority=draw(pick("priority")),
    )
    kind = draw(pick("prompt_kind"))
    if kind == "token_ids":
        request.token_ids.ids.extend(draw(pick("token_ids")))
    elif kind == "text":
        request.text = draw(pick("text"))
    elif kind == "messages":
        chat = st.builds(types_pb2.ChatMessage, role=st.text(max_size=10), content=st.text(max_size=20))
        request.messages.messages.extend(draw(st.lists(chat, max_size=3)))
        add_generation_prompt = draw(optional(st.booleans()))
        if add_generation_prompt is not None:
            request.messages.add_generation_prompt = add_generation_prompt
    sampling = request.sampling
    for name in SAMPLING_FIELDS:
        value = draw(optional(pick(name)))
        if value is not None:
            setattr(sampling, name, value)
    sampling.eos_token_ids.extend(draw(st.lists(pick("eos_token_id"), max_size=3)))
    sampling.stop.extend(draw(pick("stop")))
    sampling.logit_bias.update(draw(pick("logit_bias")))
    sampling.stop_token_ids.extend(draw(pick("stop_token_ids")))
    structured_output = draw(pick("structured_output"))
    if structured_output is not None:
        sampling.structured_output.CopyFrom(structured_output)
    sampling.ignore_eos = draw(st.booleans())
    sampling.logprobs = draw(st.booleans())
    return request


@st.composite
def invalid_utf8_add_requests(draw: st.DrawFn) -> bytes:
    """An AddRequestRequest whose text, request_id or chat role carries bytes that are not UTF-8."""
    bad = (
        draw(st.text(max_size=5)).encode()
        + draw(st.sampled_from(INVALID_UTF8))
        + draw(st.text(max_size=5)).encode()
    )
    placeholder = "\x7f" * len(bad)  # no other byte of the message is 0x7f
    where = draw(st.sampled_from(["text", "request_id", "role"]))
    request = types_pb2.GenerationRequest(token_ids=types_pb2.TokenIds(ids=[5, 6, 7]))
    if where == "text":
        request.text = placeholder
    elif where == "request_id":
        request.request_id = placeholder
    else:
        request.messages.messages.add(role=placeholder, content="hi")
    payload = generation_pb2.AddRequestRequest(request=request).SerializeToString()
    return payload.replace(placeholder.encode(), bad, 1)


cases = st.one_of(
    st.tuples(st.just("AddRequest"), generation_requests()),
    st.tuples(st.just("AddRequest bytes"), st.one_of(invalid_utf8_add_requests(), st.binary(max_size=64))),
    st.tuples(st.just("Generate"), st.one_of(generation_requests(), st.text(max_size=20), st.none())),
    st.tuples(
        st.just("StreamResults"),
        st.tuples(
            st.one_of(st.none(), st.integers(0, 10**6)), st.text(max_size=20), st.integers(0, UINT32_MAX)
        ),
    ),
    st.tuples(st.just("Cancel"), st.text(max_size=MAX_REQUEST_ID_BYTES + 12)),
)


def _tokens(ids: list[int], **sampling: Any) -> types_pb2.GenerationRequest:
    return types_pb2.GenerationRequest(
        token_ids=types_pb2.TokenIds(ids=ids), sampling=types_pb2.SamplingParams(**sampling)
    )


def _invalid_utf8_text() -> bytes:
    request = types_pb2.GenerationRequest(text="\x7f\x7f")
    return (
        generation_pb2.AddRequestRequest(request=request)
        .SerializeToString()
        .replace(b"\x7f\x7f", b"\xc3\x28")
    )


# Always tried first, whatever the draw: the edges the issue names.
EXPLICIT_CASES = [
    ("AddRequest", _tokens([5, UINT32_MAX])),  # a huge token id
    ("AddRequest", _tokens([])),  # an empty prompt
    ("AddRequest", types_pb2.GenerationRequest(text="")),
    ("AddRequest", _tokens([7] * CONTEXT, max_new_tokens=1)),  # no room left to generate
    ("AddRequest", _tokens([UINT32_MAX] * 1_000_000)),  # over gRPC's message limit
    ("AddRequest", _tokens([7] * (CONTEXT - 1), max_new_tokens=1)),  # the longest prompt that fits
    ("AddRequest", _tokens([5, 6], max_new_tokens=4, temperature=1e-45, top_k=UINT32_MAX, seed=UINT64_MAX)),
    ("AddRequest", _tokens([5, 6], max_new_tokens=4, temperature=FLOAT32_MAX, top_p=1e-45)),
    ("AddRequest bytes", _invalid_utf8_text()),
    ("Generate", None),  # neither add nor cancel
    ("StreamResults", (None, "no-such-request", UINT32_MAX)),
    ("Cancel", "no-such-request"),
]


# ---------------------------------------------------------------------------------------------------
# The wire contract, restated from the proto's documentation: the codes a request may get.


def is_invalid(request: types_pb2.GenerationRequest) -> bool:
    """Whether the server must refuse `request` with INVALID_ARGUMENT (the served model has a byte
    tokenizer without a chat template, a vocabulary of 256 and a context of 1024)."""
    request_id = request.request_id
    if request_id and (
        len(request_id.encode()) > MAX_REQUEST_ID_BYTES or not all(" " < char <= "~" for char in request_id)
    ):
        return True
    kind = request.WhichOneof("prompt")
    if kind is None or kind == "messages":
        return True
    ids = list(request.token_ids.ids) if kind == "token_ids" else list(request.text.encode())
    if not ids or any(token >= VOCAB_SIZE for token in ids) or len(ids) >= CONTEXT:
        return True
    sampling = request.sampling
    if sampling.HasField("max_new_tokens") and not 1 <= sampling.max_new_tokens <= CONTEXT - len(ids):
        return True
    if sampling.HasField("temperature") and not (
        math.isfinite(sampling.temperature) and sampling.temperature >= 0
    ):
        return True
    if sampling.HasField("top_p") and not (math.isfinite(sampling.top_p) and 0 < sampling.top_p <= 1):
        return True
    if sampling.HasField("top_logprobs") and sampling.top_logprobs > MAX_TOP_LOGPROBS:
        return True
    if sampling.HasField("min_p") and not (math.isfinite(sampling.min_p) and 0 <= sampling.min_p <= 1):
        return True
    if sampling.HasField("prompt_logprobs") and sampling.prompt_logprobs > MAX_PROMPT_LOGPROBS:
        return True
    if sampling.HasField("n") and not 1 <= sampling.n <= MAX_N:
        return True
    if len(sampling.stop_token_ids) > MAX_STOP_TOKEN_IDS or any(
        token >= VOCAB_SIZE for token in sampling.stop_token_ids
    ):
        return True
    if sampling.HasField("structured_output"):  # the strategies draw only refusable ones
        return True
    if sampling.HasField("repetition_penalty") and not (
        math.isfinite(sampling.repetition_penalty) and sampling.repetition_penalty > 0
    ):
        return True
    for name in ("presence_penalty", "frequency_penalty"):
        if sampling.HasField(name) and not -2 <= getattr(sampling, name) <= 2:
            return True
    # What the server resolves an unset max_new_tokens to: its default, within the context.
    max_new_tokens = (
        sampling.max_new_tokens
        if sampling.HasField("max_new_tokens")
        else min(DEFAULT_MAX_NEW_TOKENS, CONTEXT - len(ids))
    )
    if sampling.HasField("min_new_tokens") and sampling.min_new_tokens > max_new_tokens:
        return True
    if len(sampling.logit_bias) > MAX_LOGIT_BIAS_ENTRIES or any(
        token >= VOCAB_SIZE or not -MAX_ABS_LOGIT_BIAS <= bias <= MAX_ABS_LOGIT_BIAS
        for token, bias in sampling.logit_bias.items()
    ):
        return True
    if len(sampling.stop) > MAX_STOP_STRINGS or any(
        not 1 <= len(stop) <= MAX_STOP_STRING_CHARS for stop in sampling.stop
    ):
        return True
    return not sampling.ignore_eos and any(token >= VOCAB_SIZE for token in sampling.eos_token_ids)


def expected_codes(request: types_pb2.GenerationRequest, tally: Tally) -> set[grpc.StatusCode]:
    if request.ByteSize() > MAX_MESSAGE_BYTES:
        return {grpc.StatusCode.RESOURCE_EXHAUSTED}
    if is_invalid(request):
        return {INVALID_ARGUMENT}
    if request.request_id in tally.used_ids:  # may still be live
        return {OK, grpc.StatusCode.ALREADY_EXISTS}
    return {OK}


def generated_at_most(request: types_pb2.GenerationRequest) -> int:
    sampling = request.sampling
    return sampling.max_new_tokens if sampling.HasField("max_new_tokens") else DEFAULT_MAX_NEW_TOKENS


# ---------------------------------------------------------------------------------------------------


def test_a_thousand_bad_requests_each_get_their_status_code_and_the_server_stays_healthy(
    served: RunningServer, prompt_pool: list[PoolEntry]
) -> None:
    tally = Tally()
    with (
        grpc.insecure_channel(served.target) as channel,
        Client(served.target, timeout=CALL_TIMEOUT_S) as client,
    ):
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        add_bytes = channel.unary_unary("/cbserve.v1.GenerationService/AddRequest")

        @settings(
            max_examples=MIN_EXAMPLES + 200,
            deadline=None,
            derandomize=True,
            database=None,
            phases=(Phase.explicit, Phase.generate),
            # Each example is a call to a live server, and a few carry a million token ids.
            suppress_health_check=[
                HealthCheck.too_slow,
                HealthCheck.data_too_large,
                HealthCheck.large_base_example,
            ],
        )
        @given(case=cases)
        @_explicit(EXPLICIT_CASES)
        def each_gets_its_code(case: tuple[str, Any]) -> None:
            rpc, value = case
            tally.examples += 1
            if isinstance(value, types_pb2.GenerationRequest) and value.request_id == FRESH_ID:
                value = _with_id(value, f"fresh-{tally.examples}")
            if rpc == "AddRequest":
                code = _add(stub, client, value, tally)
            elif rpc == "AddRequest bytes":
                code = _add_bytes(add_bytes, client, value, tally)
            elif rpc == "Generate":
                code = _generate(stub, value, tally)
            elif rpc == "StreamResults":
                code = _stream_results(stub, value, tally)
            else:
                code = _cancel(client, value)
            tally.codes[f"{rpc}: {code.name}"] += 1

        each_gets_its_code()

        assert tally.examples >= MIN_EXAMPLES
        unfinished = [
            (request_id, index, outcome.status, outcome.error)
            for request_id in sorted(tally.running_to_end)
            for index, outcome in final_outcomes(client, request_id).items()
            if outcome.status != "finished"
        ]
        assert not unfinished, f"accepted requests that did not finish: {unfinished[:5]}"
        assert health_status(served.target) == SERVING
        canary = prompt_pool[9]
        stream = client.stream(canary.prompt, max_new_tokens=canary.max_new_tokens, ignore_eos=True)
        outcome = read_to_end(stream)
        assert mismatch(canary, outcome) is None, mismatch(canary, outcome)
    with AdminClient(served.admin_target, token=ADMIN_TOKEN, timeout=CALL_TIMEOUT_S) as admin:
        wait_all_blocks_free(admin)
        status = admin.status()
    assert status.counters["failed_steps"] == 0, "a request the server accepted made an engine step fail"
    report(
        "bad_input",
        examples=tally.examples,
        accepted_requests_run_to_their_end=len(tally.running_to_end),
        status_codes=dict(sorted(tally.codes.items())),
        failed_engine_steps=int(status.counters["failed_steps"]),
        kv_blocks_used_after=status.kv_blocks_used,
    )


def _explicit(explicit_cases: list[tuple[str, Any]]) -> Any:
    def apply(test: Any) -> Any:
        for case in reversed(explicit_cases):
            test = example(case=case)(test)
        return test

    return apply


def _with_id(request: types_pb2.GenerationRequest, request_id: str) -> types_pb2.GenerationRequest:
    renamed = types_pb2.GenerationRequest()
    renamed.CopyFrom(request)
    renamed.request_id = request_id
    return renamed


def _accepted(request_id: str, request: types_pb2.GenerationRequest, client: Client, tally: Tally) -> None:
    """Lets a short accepted request run to its end (checked after the run); cancels a long one."""
    tally.used_ids.add(request_id)
    tally.running_to_end.discard(request_id)  # the id now names this request
    if generated_at_most(request) <= RUN_TO_END_MAX_TOKENS:
        tally.running_to_end.add(request_id)
    else:
        client.cancel(request_id)


def _describe(request: Any) -> str:
    text = str(request)
    return text if len(text) < 400 else f"{text[:400]}... ({len(text)} characters)"


def _add(
    stub: generation_pb2_grpc.GenerationServiceStub,
    client: Client,
    request: types_pb2.GenerationRequest,
    tally: Tally,
) -> grpc.StatusCode:
    expected = expected_codes(request, tally)
    try:
        response = stub.AddRequest(generation_pb2.AddRequestRequest(request=request), timeout=CALL_TIMEOUT_S)
    except grpc.RpcError as error:
        code, details = error.code(), error.details()
    else:
        code, details = OK, ""
        _accepted(response.request_id, request, client, tally)
    assert code in expected, (
        f"AddRequest got {code.name} ({details}), want {expected} for {_describe(request)}"
    )
    return code


def _add_bytes(
    add_bytes: grpc.UnaryUnaryMultiCallable, client: Client, payload: bytes, tally: Tally
) -> grpc.StatusCode:
    try:
        message = generation_pb2.AddRequestRequest.FromString(payload)
    except DecodeError:
        message = None
    if message is None:
        # Not grpc-python's UNKNOWN ("Unexpected DecodeError"): service.message_decoding names the type.
        expected = {INVALID_ARGUMENT}
    elif not message.HasField("request"):
        expected = {INVALID_ARGUMENT}
    else:
        expected = expected_codes(message.request, tally)
    try:
        response = generation_pb2.AddRequestResponse.FromString(add_bytes(payload, timeout=CALL_TIMEOUT_S))
    except grpc.RpcError as error:
        code, details = error.code(), error.details()
    else:
        code, details = OK, ""
        assert message is not None
        _accepted(response.request_id, message.request, client, tally)
    assert code in expected, f"AddRequest got {code.name} ({details}), want {expected} for bytes {payload!r}"
    return code


def _generate(
    stub: generation_pb2_grpc.GenerationServiceStub,
    value: types_pb2.GenerationRequest | str | None,
    tally: Tally,
) -> grpc.StatusCode:
    """One Generate call with a single add, cancel (of an unknown id) or empty message."""
    if isinstance(value, types_pb2.GenerationRequest):
        message = generation_pb2.GenerateRequest(add=value)
        expected = expected_codes(value, tally)
    elif isinstance(value, str):
        message = generation_pb2.GenerateRequest(
            cancel=generation_pb2.GenerateCancel(request_id=f"unknown-{value}")
        )
        expected = {OK}
    else:
        message, expected = generation_pb2.GenerateRequest(), {INVALID_ARGUMENT}
    call = stub.Generate(iter([message]), timeout=CALL_TIMEOUT_S)
    try:
        first = next(call, None)
    except grpc.RpcError as error:
        code, details = error.code(), error.details()
    else:
        if first is None:
            code, details = OK, "(no message)"
        elif first.chunk.status == types_pb2.REQUEST_STATUS_FAILED:
            code, details = _status_code(first.chunk.error_code), first.chunk.error
        else:
            code, details = OK, ""
            tally.used_ids.add(first.chunk.request_id)
            tally.running_to_end.discard(first.chunk.request_id)
    finally:
        call.cancel()  # cancels the request, if one was queued
    assert code in expected, f"Generate got {code.name} ({details}), want {expected} for {_describe(message)}"
    return code


def _status_code(number: int) -> grpc.StatusCode:
    return next(code for code in grpc.StatusCode if code.value[0] == number)


def _stream_results(
    stub: generation_pb2_grpc.GenerationServiceStub, value: tuple[int | None, str, int], tally: Tally
) -> grpc.StatusCode:
    """StreamResults of a known request (from any token index), or of an unknown id."""
    known, unknown_id, from_index = value
    if known is not None and tally.used_ids:
        request_id = sorted(tally.used_ids)[known % len(tally.used_ids)]
    else:
        request_id = f"unknown-{unknown_id}"
    expected = {OK} if request_id in tally.used_ids else {grpc.StatusCode.NOT_FOUND}
    call = stub.StreamResults(
        generation_pb2.StreamResultsRequest(request_id=request_id, from_token_index=from_index),
        timeout=CALL_TIMEOUT_S,
    )
    try:
        next(call)
        code, details = OK, ""
    except grpc.RpcError as error:
        code, details = error.code(), error.details()
    finally:
        call.cancel()
    assert code in expected, f"StreamResults got {code.name} ({details}), want {expected} for {request_id!r}"
    return code


def _cancel(client: Client, unknown_id: str) -> grpc.StatusCode:
    assert client.cancel(f"unknown-{unknown_id}") is False, (
        f"cancelling unknown id {unknown_id!r} said it was live"
    )
    return OK
