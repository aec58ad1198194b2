"""The Python SDK's newer request features against a live in-process server: min_p, stop_token_ids and
stop_reason, stop strings, skip_special_tokens, priority, prompt_logprobs and structured output (sync and
asyncio clients); and the client-side bounds of each new keyword, refused before any call.

The server runs the tiny random llama with a byte-level Hugging Face tokenizer whose ids 0, 1 and 2 are
the special tokens <pad>, <s> (the model's BOS) and </s> (its EOS), and every other id is the byte of the
same value, so text prompts are their UTF-8 bytes and special tokens have a text to show or hide.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import re
import time
from collections.abc import Iterator
from typing import Any

import pytest
from cbserve_client import (
    AdminClient,
    AsyncClient,
    Chunk,
    Client,
    Completion,
    InvalidArgumentError,
    PromptLogprob,
    TopLogprob,
    _bounds,
)
from cbserve_client._convert import CompletionBuilder, build_request, chunk_from_proto
from cbserve_client.proto import types_pb2
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from service import validation
from tests.helpers.models import tiny_model
from tests.helpers.servers import (
    ADMIN_TOKEN,
    RunningServer,
    engine_config_for_tests,
    loaded_server,
    wait_until,
)

PROMPT = "The capital of France is"
BOS, EOS = 1, 2
SPECIAL_TOKENS = {0: "<pad>", BOS: "<s>", EOS: "</s>"}
LOWERCASE = {token: 50.0 for token in range(ord("a"), ord("z") + 1)}
# Nothing listens there: a keyword that reached the network would fail with UnavailableError instead.
DEAD_TARGET = "127.0.0.1:9"


def _gpt2_byte_chars() -> dict[int, str]:
    """GPT-2's byte-to-character table (transformers' `bytes_to_unicode`): printable bytes stand for
    themselves, the others for the characters from U+0100 on, in byte order."""
    printable = {
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    }
    others = iter(range(256, 512))
    return {byte: chr(byte if byte in printable else next(others)) for byte in range(256)}


@functools.cache
def byte_tokenizer_with_special_tokens() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer over the tiny models' 256 ids: ids 0-2 are special, id b >= 3 is byte b."""
    byte_chars = _gpt2_byte_chars()
    vocab = {text: token for token, text in SPECIAL_TOKENS.items()}
    vocab.update({byte_chars[byte]: byte for byte in range(3, 256)})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )


@pytest.fixture(scope="module")
def served() -> Iterator[RunningServer]:
    running = loaded_server(tiny_model("llama"), tokenizer=byte_tokenizer_with_special_tokens())
    try:
        yield running
    finally:
        running.close()


@pytest.fixture
def client(served: RunningServer) -> Iterator[Client]:
    with Client(served.target, timeout=30, stream_timeout=120) as connected:
        yield connected


def greedy(client: Client, prompt: Any = PROMPT, max_new_tokens: int = 16, **sampling: Any) -> Completion:
    return client.generate(
        prompt, max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True, **sampling
    )


def first_new_token_after_the_start(token_ids: list[int]) -> int:
    """The index of the first token (not the first one, when possible) that does not occur before it and
    is not special: a stop token there ends the output at that very index."""
    for index, token in enumerate(token_ids):
        if index >= 1 and token not in token_ids[:index] and token not in SPECIAL_TOKENS:
            return index
    assert token_ids[0] not in SPECIAL_TOKENS, token_ids
    return 0


def test_status_counts_the_steps_and_the_seconds_of_each_phase(client: Client, served: RunningServer) -> None:
    """What a user reads to see where a workload's time went: two readings around it."""
    phases = ("schedule", "prepare_inputs", "forward", "sample", "update")
    with AdminClient(served.admin_target, token=ADMIN_TOKEN, timeout=30) as admin:
        before = admin.status().counters
        started = time.monotonic()
        client.generate(PROMPT, max_new_tokens=8, temperature=0.0, ignore_eos=True)
        elapsed = time.monotonic() - started
        after = admin.status().counters
    # One step computes the prompt and samples the first token, each later step one token.
    assert after["steps"] - before["steps"] >= 8, (before, after)
    spent = {phase: after[f"step_seconds.{phase}"] - before[f"step_seconds.{phase}"] for phase in phases}
    assert all(seconds >= 0 for seconds in spent.values()), spent
    assert spent["forward"] > 0, spent
    assert sum(spent.values()) <= elapsed, (spent, elapsed)


# -- n > 1: parallel sampling ---------------------------------------------------------------------------


def test_generate_n_returns_every_greedy_sequence_by_index(client: Client, served: RunningServer) -> None:
    expected = greedy(client)
    with AdminClient(served.admin_target, token=ADMIN_TOKEN, timeout=30) as admin:
        forked_before = admin.status().counters["forked_sequences"]
        completions = client.generate_n(PROMPT, 3, max_new_tokens=16, temperature=0.0, ignore_eos=True)
        # The prompt was computed once: the two other sequences were forked from its KV blocks.
        assert admin.status().counters["forked_sequences"] == forked_before + 2
    assert [completion.index for completion in completions] == [0, 1, 2]
    for completion in completions:
        assert completion.request_id == completions[0].request_id
        assert completion.token_ids == expected.token_ids and completion.text == expected.text
        assert completion.usage is not None and completion.usage.generated_tokens == 16


def test_each_seeded_sequence_equals_a_single_request_with_seed_plus_its_index(client: Client) -> None:
    sampling = dict(max_new_tokens=24, temperature=1.0, ignore_eos=True)
    completions = client.generate_n(PROMPT, 3, seed=41, **sampling)
    for completion in completions:
        alone = client.generate(PROMPT, seed=41 + completion.index, **sampling)
        assert completion.token_ids == alone.token_ids, (
            completion.index,
            completion.token_ids,
            alone.token_ids,
        )
    assert len({tuple(completion.token_ids) for completion in completions}) == 3


def test_stop_strings_end_each_sequence_on_its_own_text(client: Client) -> None:
    sampling = dict(max_new_tokens=40, temperature=1.0, seed=7, ignore_eos=True)
    free = client.generate_n(PROMPT, 4, **sampling)
    stop = next(text[5:7] for text in (completion.text or "" for completion in free) if len(text.strip()) > 8)
    stopped = client.generate_n(PROMPT, 4, stop=[stop], **sampling)
    for before, after in zip(free, stopped, strict=True):
        assert before.text is not None and after.text is not None
        if stop in before.text:
            assert after.finish_reason == "stop" and after.stop_reason == stop
            assert after.text == before.text[: before.text.index(stop)]
        else:
            assert after.finish_reason == "length" and after.text == before.text
    assert any(completion.finish_reason == "stop" for completion in stopped)


def test_one_sequence_is_cancelled_alone(client: Client) -> None:
    request_id = client.submit(PROMPT, n=3, max_new_tokens=400, temperature=0.0, ignore_eos=True)
    assert client.cancel(request_id, index=1)
    ends: dict[int, Chunk] = {}
    with client.results(request_id) as chunks:
        for chunk in chunks:
            if chunk.finished:
                ends[chunk.index] = chunk
    assert sorted(ends) == [0, 1, 2]
    assert ends[1].status == "cancelled"
    assert ends[0].finish_reason == ends[2].finish_reason == "length"
    assert not client.cancel(request_id, index=1)


def test_prompt_logprobs_come_with_every_sequence(client: Client) -> None:
    single = greedy(client, prompt_logprobs=1)
    completions = client.generate_n(
        PROMPT, 2, max_new_tokens=16, temperature=0.0, ignore_eos=True, prompt_logprobs=1
    )
    for completion in completions:
        assert completion.prompt_logprobs is not None and single.prompt_logprobs is not None
        assert [entry.token_id for entry in completion.prompt_logprobs] == [
            entry.token_id for entry in single.prompt_logprobs
        ]
        for mine, theirs in zip(completion.prompt_logprobs, single.prompt_logprobs, strict=True):
            assert math.isclose(mine.logprob, theirs.logprob, abs_tol=1e-5)


def test_generate_refuses_n_above_one_and_the_async_client_has_generate_n(served: RunningServer) -> None:
    with Client(served.target, timeout=30, stream_timeout=120) as connected:
        with pytest.raises(ValueError, match="generate_n"):
            connected.generate(PROMPT, n=2)
        expected = greedy(connected).token_ids

    async def main() -> list[Completion]:
        async with AsyncClient(served.target, timeout=30, stream_timeout=120) as aclient:
            with pytest.raises(ValueError, match="generate_n"):
                await aclient.generate(PROMPT, n=2)
            return await aclient.generate_n(PROMPT, 2, max_new_tokens=16, temperature=0.0, ignore_eos=True)

    completions = asyncio.run(main())
    assert [completion.index for completion in completions] == [0, 1]
    assert all(completion.token_ids == expected for completion in completions)


# -- the test tokenizer ------------------------------------------------------------------------------


def test_the_test_tokenizer_is_bytes_plus_three_special_tokens() -> None:
    tokenizer = byte_tokenizer_with_special_tokens()
    assert tokenizer("Hello, wörld!")["input_ids"] == list("Hello, wörld!".encode())
    assert tokenizer.decode([72, BOS, 105, EOS]) == "H<s>i</s>"
    assert tokenizer.decode([72, BOS, 105, EOS], skip_special_tokens=True) == "Hi"
    assert len(tokenizer) == 256 and tokenizer.eos_token_id == EOS


# -- min_p, stop_token_ids, stop strings, skip_special_tokens ------------------------------------------


def test_min_p_one_at_temperature_one_is_greedy(client: Client) -> None:
    expected = greedy(client).token_ids
    for seed in (0, 1):
        sampled = client.generate(
            PROMPT, max_new_tokens=16, temperature=1.0, min_p=1.0, seed=seed, ignore_eos=True
        )
        assert sampled.token_ids == expected, f"seed {seed}"
    # ...while sampling the same way without min_p does not follow the greedy path (the tiny model's
    # distributions are nearly flat), so the equality above is min_p's doing.
    unfiltered = client.generate(PROMPT, max_new_tokens=16, temperature=1.0, seed=0, ignore_eos=True)
    assert unfiltered.token_ids != expected


def test_a_stop_token_id_ends_the_output_there_with_stop_reason(client: Client) -> None:
    expected = greedy(client).token_ids
    index = first_new_token_after_the_start(expected)
    stop = expected[index]
    completion = greedy(client, stop_token_ids=[stop])
    assert completion.token_ids == expected[: index + 1]
    assert completion.finish_reason == "stop"
    assert completion.stop_reason == stop and type(completion.stop_reason) is int
    with client.stream(
        PROMPT, max_new_tokens=16, temperature=0.0, ignore_eos=True, stop_token_ids=[stop]
    ) as s:
        chunks = list(s)
    assert chunks[-1].finish_reason == "stop" and chunks[-1].stop_reason == stop
    assert all(chunk.stop_reason is None for chunk in chunks[:-1])
    # A request that ends otherwise has no stop_reason.
    assert greedy(client, max_new_tokens=2).stop_reason is None


def test_a_stop_string_is_the_stop_reason(client: Client) -> None:
    # Biased towards lowercase letters, so that the output is text a stop string can be taken from.
    text = greedy(client, logit_bias=LOWERCASE).text
    assert text is not None and re.fullmatch("[a-z]{16}", text), text
    at = next((k for k in range(1, len(text) - 1) if text.find(text[k : k + 2]) == k), 0)
    stop = text[at : at + 2]
    completion = greedy(client, logit_bias=LOWERCASE, stop=["NEVER", stop])
    assert completion.finish_reason == "stop"
    assert completion.stop_reason == stop
    assert completion.text == text[:at]


def test_skip_special_tokens_false_shows_what_the_default_hides(client: Client) -> None:
    forced_bos: dict[str, Any] = dict(max_new_tokens=3, temperature=0.0, logit_bias={BOS: 100.0})
    hidden = client.generate("Hi", **forced_bos)
    explicit = client.generate("Hi", skip_special_tokens=True, **forced_bos)
    shown = client.generate("Hi", skip_special_tokens=False, **forced_bos)
    assert hidden.token_ids == explicit.token_ids == shown.token_ids == [BOS] * 3
    assert hidden.text == explicit.text == ""
    assert shown.text == "<s><s><s>"
    # The EOS token that ends a request too: text of its own only when asked for.
    forced_eos: dict[str, Any] = dict(max_new_tokens=3, temperature=0.0, logit_bias={EOS: 100.0})
    ended = client.generate("Hi", **forced_eos)
    assert ended.token_ids == [EOS] and ended.finish_reason == "eos" and ended.text == ""
    assert client.generate("Hi", skip_special_tokens=False, **forced_eos).text == "</s>"


def test_the_async_client_takes_the_same_keywords(served: RunningServer) -> None:
    async def main() -> None:
        async with AsyncClient(served.target, timeout=30, stream_timeout=120) as aclient:
            base: dict[str, Any] = dict(max_new_tokens=16, temperature=0.0, ignore_eos=True)
            expected = (await aclient.generate(PROMPT, **base)).token_ids
            sampled = await aclient.generate(
                PROMPT, max_new_tokens=16, temperature=1.0, min_p=1.0, seed=3, ignore_eos=True
            )
            assert sampled.token_ids == expected
            index = first_new_token_after_the_start(expected)
            stopped = await aclient.generate(PROMPT, stop_token_ids=[expected[index]], **base)
            assert stopped.token_ids == expected[: index + 1]
            assert (stopped.finish_reason, stopped.stop_reason) == ("stop", expected[index])
            chunks = [
                chunk
                async for chunk in aclient.stream(
                    "Hi",
                    max_new_tokens=3,
                    temperature=0.0,
                    logit_bias={EOS: 100.0},
                    skip_special_tokens=False,
                )
            ]
            assert "".join(chunk.text or "" for chunk in chunks) == "</s>"
            assert chunks[-1].finish_reason == "eos" and chunks[-1].stop_reason is None
            with_logprobs = await aclient.generate("Hi there", max_new_tokens=1, prompt_logprobs=1)
            assert with_logprobs.prompt_logprobs is not None
            assert [entry.token_id for entry in with_logprobs.prompt_logprobs] == list(b"i there")

    asyncio.run(main())


# -- priority ------------------------------------------------------------------------------------------


def test_priority_orders_the_admission_of_waiting_requests() -> None:
    """Under the "priority" scheduler with one request per batch, requests queued during a pause are
    scheduled smallest priority first once it is released, whatever their arrival order."""
    config = engine_config_for_tests(scheduler_type="priority", max_requests_per_batch=1)
    running = loaded_server(tiny_model("qwen3"), config=config)
    try:
        with (
            Client(running.target, timeout=30, stream_timeout=120) as client,
            AdminClient(running.admin_target, token=ADMIN_TOKEN, timeout=30) as admin,
        ):
            priorities = [5, -3, _bounds.MAX_PRIORITY, 0, _bounds.MIN_PRIORITY, 1]
            with admin.paused():
                request_ids = {
                    client.submit([5, 6, 7], max_new_tokens=3, ignore_eos=True, priority=priority): priority
                    for priority in priorities
                }
                wait_until(
                    lambda: admin.status().queued_requests == len(priorities), what="every request queued"
                )
            scheduled = {}
            for request_id, priority in request_ids.items():
                builder = CompletionBuilder(request_id)
                with client.results(request_id) as stream:
                    for chunk in stream:
                        builder.add(chunk)
                completion = builder.build()
                assert completion.finish_reason == "length", completion
                assert completion.timings is not None and completion.timings.scheduled_at is not None
                scheduled[priority] = completion.timings.scheduled_at
            assert sorted(priorities, key=lambda priority: scheduled[priority]) == sorted(priorities)
    finally:
        running.close()


# -- prompt_logprobs (engine work in progress) ---------------------------------------------------------


def _check_logprob(value: float) -> None:
    assert math.isfinite(value) and value <= 0, value


def test_prompt_logprobs_cover_every_prompt_token_after_the_first(client: Client) -> None:
    prompt = "Hello there"
    ids = list(prompt.encode())
    completion = client.generate(prompt, max_new_tokens=2, temperature=0.0, prompt_logprobs=2)
    entries = completion.prompt_logprobs
    assert entries is not None and len(entries) == len(ids) - 1
    assert [entry.token_id for entry in entries] == ids[1:]
    for entry in entries:
        assert isinstance(entry, PromptLogprob)
        _check_logprob(entry.logprob)
        assert len(entry.top_logprobs) == 2
        for alternative in entry.top_logprobs:
            _check_logprob(alternative.logprob)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob  # most likely first
        assert entry.logprob <= entry.top_logprobs[0].logprob + 1e-5
    # The most likely token after the whole prompt but its last token is what greedy decoding of that
    # shorter prompt generates first, with the same logprob.
    shorter = client.generate(ids[:-1], max_new_tokens=1, temperature=0.0, top_logprobs=1)
    assert shorter.logprobs is not None
    assert shorter.token_ids[0] == entries[-1].top_logprobs[0].token_id
    assert shorter.logprobs[0].logprob == pytest.approx(entries[-1].top_logprobs[0].logprob, abs=1e-3)

    # Streamed, they come once, on the chunk of the first generated token.
    with client.stream(prompt, max_new_tokens=2, temperature=0.0, prompt_logprobs=2) as stream:
        chunks = list(stream)
    carrying = [chunk for chunk in chunks if chunk.prompt_logprobs]
    assert len(carrying) == 1 and carrying[0].token_index == 0 and carrying[0].token_ids
    assert [entry.token_id for entry in carrying[0].prompt_logprobs] == ids[1:]
    for streamed, whole in zip(carrying[0].prompt_logprobs, entries, strict=True):
        assert streamed.logprob == pytest.approx(whole.logprob, abs=1e-4)

    # 0: the prompt tokens' own logprobs only; unset: none at all.
    own_only = client.generate(prompt, max_new_tokens=1, prompt_logprobs=0).prompt_logprobs
    assert own_only is not None and [entry.token_id for entry in own_only] == ids[1:]
    assert all(entry.top_logprobs == () for entry in own_only)
    for mine, theirs in zip(own_only, entries, strict=True):
        assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-4)
    assert client.generate(prompt, max_new_tokens=1).prompt_logprobs is None


# -- structured output (engine work in progress) -------------------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}, "sure": {"type": "boolean"}},
    "required": ["answer", "sure"],
    "additionalProperties": False,
}


def test_json_schema_output_parses_and_matches(client: Client) -> None:
    completion = client.generate(PROMPT, json_schema=SCHEMA, max_new_tokens=64, temperature=0.0)
    assert completion.finish_reason == "eos", completion  # the grammar ends the request through EOS
    assert completion.text is not None
    value = json.loads(completion.text)
    assert set(value) == {"answer", "sure"}
    assert value["answer"] in ("yes", "no") and isinstance(value["sure"], bool)
    # The schema's JSON text is the same constraint as the dict.
    as_text = client.generate(PROMPT, json_schema=json.dumps(SCHEMA), max_new_tokens=64, temperature=0.0)
    assert as_text.token_ids == completion.token_ids


def test_json_object_regex_and_grammar_constrain_the_output(client: Client) -> None:
    # "}" is favoured whenever the grammar allows it: any JSON object closes at once.
    braces = client.generate(
        PROMPT, json_object=True, max_new_tokens=32, temperature=0.0, logit_bias={ord("}"): 100.0}
    )
    assert braces.text is not None and json.loads(braces.text) == {}, braces
    regex = client.generate(PROMPT, regex="(yes|no)-[0-9]", max_new_tokens=16, temperature=0.0)
    assert regex.text is not None and re.fullmatch("(yes|no)-[0-9]", regex.text), regex
    grammar = 'root ::= "a" ("b" | "c") "!"'
    derived = client.generate(PROMPT, grammar=grammar, max_new_tokens=16, temperature=0.0)
    assert derived.text in ("ab!", "ac!"), derived


def test_a_constraint_that_does_not_compile_is_refused(client: Client) -> None:
    with pytest.raises(InvalidArgumentError, match="structured_output: the regex does not compile: "):
        client.generate(PROMPT, regex="(unclosed", max_new_tokens=4)


# -- client-side checks: refused before any call -------------------------------------------------------

TOO_LONG = _bounds.MAX_STRUCTURED_OUTPUT_CHARS + 1

REFUSED: list[tuple[dict[str, Any], str]] = [
    ({"min_p": 1.5}, "sampling.min_p must be a finite number in [0, 1] (0 disables it), got 1.5"),
    ({"min_p": -0.1}, "sampling.min_p must be a finite number in [0, 1]"),
    ({"min_p": math.nan}, "sampling.min_p must be a finite number in [0, 1]"),
    (
        {"stop_token_ids": list(range(_bounds.MAX_STOP_TOKEN_IDS + 1))},
        f"sampling.stop_token_ids: at most {_bounds.MAX_STOP_TOKEN_IDS} token ids, got 65",
    ),
    ({"stop_token_ids": [7, -1]}, "sampling.stop_token_ids[1] must be an int >= 0, got -1"),
    ({"stop_token_ids": [2**32]}, "sampling.stop_token_ids[0] must be at most 4294967295"),
    (
        {"prompt_logprobs": _bounds.MAX_PROMPT_LOGPROBS + 1},
        f"sampling.prompt_logprobs must be an int in [0, {_bounds.MAX_PROMPT_LOGPROBS}]",
    ),
    ({"prompt_logprobs": -1}, "sampling.prompt_logprobs must be an int in [0, 20]"),
    (
        {"json_schema": "x" * TOO_LONG},
        f"sampling.structured_output.json_schema must be at most 65536 characters, got {TOO_LONG}",
    ),
    (
        {"json_schema": {"description": "x" * _bounds.MAX_STRUCTURED_OUTPUT_CHARS}},
        "sampling.structured_output.json_schema must be at most 65536 characters",
    ),
    ({"regex": "x" * TOO_LONG}, "sampling.structured_output.regex must be at most 65536 characters"),
    ({"grammar": "x" * TOO_LONG}, "sampling.structured_output.grammar must be at most 65536 characters"),
    ({"regex": ""}, "sampling.structured_output.regex must not be empty"),
    ({"json_schema": ""}, "sampling.structured_output.json_schema must not be empty"),
    (
        {"priority": _bounds.MAX_PRIORITY + 1},
        "priority must be an int in [-2147483648, 2147483647], got 2147483648",
    ),
    ({"priority": _bounds.MIN_PRIORITY - 1}, "priority must be an int in [-2147483648, 2147483647]"),
    ({"n": 0}, "sampling.n must be an int in [1, 128], got 0"),
    ({"n": _bounds.MAX_N + 1}, "sampling.n must be an int in [1, 128], got 129"),
]


@pytest.mark.parametrize(("values", "message"), REFUSED, ids=[",".join(values) for values, _ in REFUSED])
def test_a_new_keyword_out_of_bounds_is_refused_before_any_call(values: dict[str, Any], message: str) -> None:
    with Client(DEAD_TARGET, timeout=2) as dead:
        with pytest.raises(InvalidArgumentError) as refused:
            dead.generate(PROMPT, **values)
        assert refused.value.details.startswith(message), refused.value.details
        with pytest.raises(InvalidArgumentError):
            dead.submit(PROMPT, **values)
        with pytest.raises(InvalidArgumentError):
            dead.stream(PROMPT, **values)

    async def main() -> None:
        async with AsyncClient(DEAD_TARGET, timeout=2) as adead:
            with pytest.raises(InvalidArgumentError):
                await adead.generate(PROMPT, **values)
            with pytest.raises(InvalidArgumentError):
                await adead.submit(PROMPT, **values)

    asyncio.run(main())


@pytest.mark.parametrize(
    "values",
    [
        {"min_p": 1.5},
        {"stop_token_ids": list(range(_bounds.MAX_STOP_TOKEN_IDS + 1))},
        {"prompt_logprobs": _bounds.MAX_PROMPT_LOGPROBS + 1},
        {"n": _bounds.MAX_N + 1},
        {"n": 0},
    ],
    ids=lambda values: ",".join(values),
)
def test_the_client_s_message_is_the_server_s(values: dict[str, Any]) -> None:
    """For the fields the server checks with the same bound, the SDK refuses with its words."""
    request = types_pb2.GenerationRequest(
        token_ids=types_pb2.TokenIds(ids=[5, 6, 7]), sampling=types_pb2.SamplingParams(**values)
    )
    limits = validation.ModelLimits(vocab_size=1024, max_context_length=1024, default_max_new_tokens=20)
    with pytest.raises(validation.RequestRejected) as server:
        validation.prepare(request, limits, None)
    with pytest.raises(InvalidArgumentError) as client:
        build_request([5, 6, 7], **values)
    assert client.value.details.startswith(server.value.message), (client.value.details, server.value.message)


def test_values_at_the_bounds_pass() -> None:
    build_request(PROMPT, min_p=0.0)
    build_request(PROMPT, min_p=_bounds.MAX_MIN_P)
    build_request(PROMPT, stop_token_ids=list(range(_bounds.MAX_STOP_TOKEN_IDS)))
    build_request(PROMPT, prompt_logprobs=0)
    build_request(PROMPT, prompt_logprobs=_bounds.MAX_PROMPT_LOGPROBS)
    assert build_request(PROMPT, n=_bounds.MAX_N).sampling.n == _bounds.MAX_N
    build_request(PROMPT, regex="x" * _bounds.MAX_STRUCTURED_OUTPUT_CHARS)
    assert build_request(PROMPT, priority=_bounds.MIN_PRIORITY).priority == _bounds.MIN_PRIORITY
    assert build_request(PROMPT, priority=_bounds.MAX_PRIORITY).priority == _bounds.MAX_PRIORITY


def test_structured_output_takes_one_constraint_at_most() -> None:
    with pytest.raises(ValueError, match="at most one of json_schema, json_object, regex, grammar") as two:
        build_request(PROMPT, json_schema=SCHEMA, regex="a")
    assert "got json_schema and regex" in str(two.value)
    with pytest.raises(ValueError, match="got json_object and grammar"):
        build_request(PROMPT, json_object=True, grammar='root ::= "a"')
    with Client(DEAD_TARGET, timeout=2) as dead, pytest.raises(ValueError, match="at most one of"):
        dead.generate(PROMPT, regex="a", grammar='root ::= "a"')
    # json_object=False is no constraint at all.
    assert build_request(PROMPT, json_object=False, regex="a").sampling.structured_output.regex == "a"
    assert not build_request(PROMPT, json_object=False).sampling.HasField("structured_output")


@pytest.mark.parametrize(
    "values",
    [
        {"skip_special_tokens": "no"},
        {"skip_special_tokens": 0},
        {"json_object": 1},
        {"json_schema": 3},
        {"json_schema": {"default": {1, 2}}},  # not serializable as JSON
        {"regex": b"a+"},
        {"grammar": ["root ::= 'a'"]},
        {"min_p": "high"},
        {"stop_token_ids": 7},
        {"stop_token_ids": [7.0]},
        {"prompt_logprobs": 2.0},
        {"prompt_logprobs": True},
        {"priority": 1.5},
        {"priority": "high"},
    ],
    ids=lambda values: f"{next(iter(values))}={next(iter(values.values()))!r}"[:40],
)
def test_a_new_keyword_of_the_wrong_type_is_a_type_error(values: dict[str, Any]) -> None:
    with pytest.raises(TypeError):
        build_request(PROMPT, **values)


def test_the_new_keywords_on_the_wire() -> None:
    request = build_request(
        PROMPT,
        min_p=0.05,
        stop_token_ids=[7, 0],
        skip_special_tokens=False,
        prompt_logprobs=3,
        json_schema=SCHEMA,
        priority=-7,
    )
    sampling = request.sampling
    assert sampling.min_p == pytest.approx(0.05)
    assert list(sampling.stop_token_ids) == [7, 0]
    assert sampling.HasField("skip_special_tokens") and sampling.skip_special_tokens is False
    assert sampling.HasField("prompt_logprobs") and sampling.prompt_logprobs == 3
    assert sampling.structured_output.WhichOneof("constraint") == "json_schema"
    assert json.loads(sampling.structured_output.json_schema) == SCHEMA
    assert request.priority == -7
    unset = build_request(PROMPT)
    for name in ("min_p", "skip_special_tokens", "prompt_logprobs", "structured_output"):
        assert not unset.sampling.HasField(name), name
    assert list(unset.sampling.stop_token_ids) == [] and unset.priority == 0
    for kind, value in (("json_object", True), ("regex", "[0-9]+"), ("grammar", 'root ::= "a"')):
        constraint = build_request(PROMPT, **{kind: value}).sampling.structured_output
        assert constraint.WhichOneof("constraint") == kind and getattr(constraint, kind) == value
    assert build_request(PROMPT, json_schema='{"type": "string"}').sampling.structured_output.json_schema == (
        '{"type": "string"}'
    )


# -- the new result fields, from the wire ---------------------------------------------------------------


def test_chunks_carry_stop_reason_and_prompt_logprobs() -> None:
    by_token = types_pb2.GenerationChunk(
        request_id="r",
        token_ids=[0],
        status=types_pb2.REQUEST_STATUS_FINISHED,
        finish_reason=types_pb2.FINISH_REASON_STOP,
        stop_token_id=0,
    )
    assert chunk_from_proto(by_token).stop_reason == 0  # token id 0, not "no reason"
    by_text = types_pb2.GenerationChunk(
        request_id="r", finish_reason=types_pb2.FINISH_REASON_STOP, stop_string="\n\n"
    )
    assert chunk_from_proto(by_text).stop_reason == "\n\n"
    assert chunk_from_proto(types_pb2.GenerationChunk(request_id="r")).stop_reason is None
    first = types_pb2.GenerationChunk(request_id="r", token_ids=[9])
    entry = first.prompt_logprobs.add(token_id=4, logprob=-1.5)
    entry.top_logprobs.add(token_id=8, logprob=-0.5)
    entry.top_logprobs.add(token_id=4, logprob=-1.5)
    first.prompt_logprobs.add(token_id=5, logprob=-2.0)
    assert chunk_from_proto(first).prompt_logprobs == (
        PromptLogprob(4, -1.5, (TopLogprob(8, -0.5), TopLogprob(4, -1.5))),
        PromptLogprob(5, -2.0),
    )


def _chunk(index: int, ids: tuple[int, ...], status: str = "decoding", **fields: Any) -> Chunk:
    return Chunk(request_id="r", token_index=index, token_ids=ids, text=None, status=status, **fields)


def test_completion_assembles_stop_reason_and_prompt_logprobs() -> None:
    prompt_logprobs = (PromptLogprob(4, -1.0, (TopLogprob(4, -1.0),)),)
    builder = CompletionBuilder("r")
    builder.add(_chunk(0, (), status="queued"))
    builder.add(_chunk(0, (9,), prompt_logprobs=prompt_logprobs))
    builder.add(_chunk(1, (7,), status="finished", finish_reason="stop", stop_reason=7))
    completion = builder.build()
    assert completion.prompt_logprobs == list(prompt_logprobs)
    assert completion.stop_reason == 7 and completion.finish_reason == "stop"
    plain = CompletionBuilder("r")
    plain.add(_chunk(0, (9,), status="finished", finish_reason="length"))
    assert plain.build().prompt_logprobs is None and plain.build().stop_reason is None
    assert plain.build(prompt_logprobs_requested=True).prompt_logprobs == []
