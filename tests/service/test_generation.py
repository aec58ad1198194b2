"""Generation RPCs through the real SDK and gRPC stack: parity, resume, cancellation, text."""

from __future__ import annotations

import pytest
import torch
from cbserve_client import AdminClient, Client, DeadlineExceededError

from tests.helpers.models import fresh_tiny_model, random_prompt
from tests.helpers.oracle import reference_generate, reference_greedy
from tests.helpers.servers import ByteTokenizer, RunningServer, wait_all_blocks_free, wait_until

# Long enough that a request is still decoding when the test acts on it.
LONG = 900


@pytest.fixture(scope="module")
def references(model: torch.nn.Module) -> dict[int, tuple[list[int], list[int]]]:
    # Computed before the server takes the model (plain forwards are the oracle).
    prompts = {seed: random_prompt(12 + seed, seed) for seed in (1, 2, 3)}
    return {seed: (prompt, reference_greedy(model, prompt, 24)) for seed, prompt in prompts.items()}


def test_generate_equals_in_process_greedy(client: Client, references: dict) -> None:
    for prompt, expected in references.values():
        completion = client.generate(prompt, max_new_tokens=24, ignore_eos=True)
        assert completion.token_ids == expected
        assert completion.finish_reason == "length"
        assert completion.usage is not None and completion.usage.prompt_tokens == len(prompt)


def test_stream_chunks_concatenate_to_the_greedy_output(client: Client, references: dict) -> None:
    prompt, expected = references[1]
    tokens: list[int] = []
    with client.stream(prompt, max_new_tokens=24, ignore_eos=True) as stream:
        for chunk in stream:
            assert chunk.token_index == len(tokens)
            tokens.extend(chunk.token_ids)
            if chunk.finished:
                break
    assert tokens == expected


def test_usage_and_timings_ride_on_the_first_token_and_the_last_chunk_only(
    client: Client, references: dict
) -> None:
    prompt, _expected = references[3]
    with client.stream(prompt, max_new_tokens=24, ignore_eos=True) as stream:
        chunks = list(stream)
    first = next(chunk for chunk in chunks if chunk.token_ids)
    assert first.token_index == 0
    assert first.usage is not None and first.usage.generated_tokens == len(first.token_ids)
    assert first.timings is not None and first.timings.first_token_at is not None
    later = [chunk for chunk in chunks if chunk.token_index > 0 and chunk.token_ids and not chunk.finished]
    assert later, f"every token came in the first or the last chunk: {chunks}"
    assert all(chunk.usage is None and chunk.timings is None for chunk in later), later
    last = chunks[-1]
    assert last.finished and last.usage is not None and last.usage.generated_tokens == 24
    assert last.timings is not None and last.timings.finished_at is not None


def test_results_resumed_from_k_returns_exactly_the_tokens_from_k(client: Client, references: dict) -> None:
    prompt, expected = references[2]
    request_id = client.submit(prompt, max_new_tokens=24, ignore_eos=True)
    for k in (0, 5, 23, 24):
        tokens: list[int] = []
        for chunk in client.results(request_id, from_index=k):
            tokens.extend(chunk.token_ids)
            last = chunk
        assert tokens == expected[k:]
        assert last.status == "finished" and last.finish_reason == "length"


def test_results_of_an_unknown_id_is_not_found(client: Client) -> None:
    from cbserve_client import NotFoundError

    with pytest.raises(NotFoundError):
        list(client.results("no-such-request"))


def test_text_deltas_never_split_a_character(client: Client) -> None:
    # The byte tokenizer turns "é" into two tokens: the first alone must not produce text.
    completion = client.generate(list("xé€".encode()), max_new_tokens=8, ignore_eos=True)
    chunks_text = "".join(chunk.text or "" for chunk in client.results(completion.request_id))
    assert chunks_text == bytes(completion.token_ids).decode("utf-8", errors="replace")
    assert completion.text == chunks_text


def test_text_prompt_and_model_info(client: Client) -> None:
    info = client.model_info()
    assert (info.vocab_size, info.max_context_length, info.has_tokenizer) == (256, 1024, True)
    assert info.eos_token_ids == (2,) and info.weight_version == 1
    assert client.generate("hello", max_new_tokens=3).usage.prompt_tokens == 5


def test_penalties_and_min_new_tokens_equal_generate(client: Client) -> None:
    oracle = fresh_tiny_model("llama")  # the served model is busy serving
    prompt = random_prompt(24, 11)
    penalised = reference_generate(oracle, prompt, 16, repetition_penalty=1.8)
    assert penalised != reference_generate(oracle, prompt, 16), "the penalty should change this output"
    eos = penalised[1]  # without min_new_tokens the output would end at its second token
    expected = reference_generate(oracle, prompt, 16, eos, repetition_penalty=1.8, min_new_tokens=6)
    completion = client.generate(
        prompt, max_new_tokens=16, eos_token_ids=[eos], repetition_penalty=1.8, min_new_tokens=6
    )
    assert completion.token_ids == expected, (completion.token_ids, expected)
    # A logit bias that bans the greedy first token, as generate's sequence_bias of one token.
    plain_first = reference_generate(oracle, prompt, 1)[0]
    expected = reference_generate(oracle, prompt, 8, sequence_bias={(plain_first,): -100.0})
    banned = client.generate(prompt, max_new_tokens=8, ignore_eos=True, logit_bias={plain_first: -100.0})
    assert banned.token_ids == expected and plain_first not in banned.token_ids, (banned.token_ids, expected)
    # Presence and frequency penalties reach the engine: strong ones change the greedy output.
    plain = client.generate(prompt, max_new_tokens=16, ignore_eos=True)
    discouraged = client.generate(
        prompt, max_new_tokens=16, ignore_eos=True, presence_penalty=2.0, frequency_penalty=2.0
    )
    assert len(set(discouraged.token_ids)) > len(set(plain.token_ids)), (
        plain.token_ids,
        discouraged.token_ids,
    )


def _two_characters_inside(text: str) -> str:
    """Two decoded characters from the middle of `text` (not the replacement character of bad bytes)."""
    for start in range(4, len(text) - 1):
        pair = text[start : start + 2]
        if "\ufffd" not in pair:
            return pair
    raise AssertionError(f"no two decodable characters in a row in {text!r}")


def test_a_stop_string_ends_the_text_before_it_and_frees_the_request(
    client: Client, admin: AdminClient
) -> None:
    prompt = random_prompt(20, 9)
    full = client.generate(prompt, max_new_tokens=48, ignore_eos=True)
    stop = _two_characters_inside(full.text or "")
    completion = client.generate(prompt, max_new_tokens=LONG, ignore_eos=True, stop=[stop])
    print("full:", repr(full.text), "stop:", repr(stop), "stopped:", repr(completion.text))
    assert completion.finish_reason == "stop"
    assert completion.text == full.text[: full.text.index(stop)]
    # The tokens run up to the one that completed the stop string, and no further.
    assert completion.token_ids == full.token_ids[: len(completion.token_ids)]
    decode = ByteTokenizer().decode
    assert stop in decode(completion.token_ids) and stop not in decode(completion.token_ids[:-1])
    assert completion.usage.generated_tokens == len(completion.token_ids)
    # Streamed deltas (some held back while they might begin the stop string) add up to the same text.
    with client.stream(prompt, max_new_tokens=LONG, ignore_eos=True, stop=[stop]) as stream:
        chunks = list(stream)
    assert "".join(chunk.text or "" for chunk in chunks) == completion.text
    assert chunks[-1].finish_reason == "stop"
    wait_all_blocks_free(admin)  # the engine was told to drop the request, long before max_new_tokens


def _decoding(client: Client, admin: AdminClient, timeout: float | None = None):
    """A long streamed request that has produced tokens (so it holds KV blocks)."""
    stream = client.stream(random_prompt(40, 7), max_new_tokens=LONG, ignore_eos=True, timeout=timeout)
    for chunk in stream:
        if chunk.token_ids:
            break
    # The status is a snapshot taken once a step is done: a token can reach the client before the step
    # that made it has updated it (seen under a loaded machine).
    wait_until(lambda: admin.status().kv_blocks_used > 0, what="the request's KV blocks in the status")
    return stream


def _final_status(client: Client, request_id: str) -> str:
    return [chunk for chunk in client.results(request_id)][-1].status


def test_cancel_frees_the_kv_blocks(client: Client, admin: AdminClient) -> None:
    request_id = client.submit(random_prompt(40, 8), max_new_tokens=LONG, ignore_eos=True)
    next(chunk for chunk in client.results(request_id) if chunk.token_ids)
    assert client.cancel(request_id) is True
    wait_all_blocks_free(admin)
    assert _final_status(client, request_id) == "cancelled"
    assert client.cancel(request_id) is False  # idempotent
    assert client.cancel("never-seen") is False


def test_closing_a_generate_stream_cancels_its_request(client: Client, admin: AdminClient) -> None:
    stream = _decoding(client, admin)
    stream.close()
    wait_all_blocks_free(admin)
    assert _final_status(client, stream.request_id) == "cancelled"


def test_a_client_deadline_cancels_the_request(client: Client, admin: AdminClient) -> None:
    stream = _decoding(client, admin, timeout=2.0)
    with admin.paused(), pytest.raises(DeadlineExceededError):  # held, so the deadline surely comes first
        for _ in stream:
            pass
    wait_all_blocks_free(admin)
    assert _final_status(client, stream.request_id) == "cancelled"


def _adds(references: dict, prefix: str) -> list:
    """One Generate add of each reference prompt, 24 tokens, ids ``prefix-<seed>``."""
    from cbserve_client.proto import generation_pb2, types_pb2

    return [
        generation_pb2.GenerateRequest(
            add=types_pb2.GenerationRequest(
                request_id=f"{prefix}-{seed}",
                token_ids=types_pb2.TokenIds(ids=prompt),
                sampling=types_pb2.SamplingParams(max_new_tokens=24, ignore_eos=True),
            )
        )
        for seed, (prompt, _) in references.items()
    ]


def _raw_generate(served: RunningServer, messages: list) -> list:
    """The responses of one Generate call that sends ``messages`` and half-closes."""
    import grpc
    from cbserve_client.proto import generation_pb2_grpc

    with grpc.insecure_channel(served.target) as channel:
        return list(generation_pb2_grpc.GenerationServiceStub(channel).Generate(iter(messages), timeout=60))


def test_one_generate_stream_carries_several_requests(served: RunningServer, references: dict) -> None:
    responses = _raw_generate(served, _adds(references, "multi"))
    tokens: dict[str, list[int]] = {}
    for response in responses:
        tokens.setdefault(response.chunk.request_id, []).extend(response.chunk.token_ids)
    assert [response.chunk.request_id for response in responses[:1]] == ["multi-1"]
    assert tokens == {f"multi-{seed}": expected for seed, (_, expected) in references.items()}


def test_a_stream_with_batch_chunks_sends_a_steps_chunks_in_one_message(
    served: RunningServer, references: dict
) -> None:
    from cbserve_client.proto import generation_pb2

    options = generation_pb2.GenerateRequest(options=generation_pb2.GenerateStreamOptions(batch_chunks=True))
    responses = _raw_generate(served, [options, *_adds(references, "batched")])
    assert all(not response.HasField("chunk") and response.chunks for response in responses), responses[:3]
    tokens: dict[str, list[int]] = {}
    for response in responses:
        for chunk in response.chunks:
            tokens.setdefault(chunk.request_id, []).extend(chunk.token_ids)
    assert tokens == {f"batched-{seed}": expected for seed, (_, expected) in references.items()}
    # The three requests decode in the same steps: their tokens share messages.
    shared = [response for response in responses if len({chunk.request_id for chunk in response.chunks}) == 3]
    assert len(shared) >= 20, [[chunk.request_id for chunk in response.chunks] for response in responses]


def test_options_after_a_streams_first_message_fail_the_call(served: RunningServer) -> None:
    import grpc
    from cbserve_client.proto import generation_pb2, types_pb2

    add = generation_pb2.GenerateRequest(
        add=types_pb2.GenerationRequest(
            token_ids=types_pb2.TokenIds(ids=[5, 6, 7]), sampling=types_pb2.SamplingParams(max_new_tokens=2)
        )
    )
    options = generation_pb2.GenerateRequest(options=generation_pb2.GenerateStreamOptions(batch_chunks=True))
    with pytest.raises(grpc.RpcError) as raised:
        _raw_generate(served, [add, options])
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "GenerateRequest.options" in raised.value.details()


def test_a_session_serves_requests_from_many_threads_equal_to_greedy(
    client: Client, references: dict
) -> None:
    from concurrent.futures import ThreadPoolExecutor

    with client.session() as session, ThreadPoolExecutor(len(references)) as pool:
        completions = pool.map(
            lambda prompt: session.generate(prompt, max_new_tokens=24, ignore_eos=True),
            [prompt for prompt, _ in references.values()],
        )
        for completion, (_, expected) in zip(completions, references.values(), strict=True):
            assert completion.token_ids == expected
            assert completion.finish_reason == "length"
            assert completion.usage is not None and completion.usage.generated_tokens == 24


def test_closing_a_session_stream_cancels_its_request_only(client: Client, admin: AdminClient) -> None:
    with client.session() as session:
        kept = session.stream(random_prompt(30, 9), max_new_tokens=48, ignore_eos=True)
        dropped = session.stream(random_prompt(40, 7), max_new_tokens=LONG, ignore_eos=True)
        next(chunk for chunk in dropped if chunk.token_ids)
        dropped.close()
        assert sum(len(chunk.token_ids) for chunk in kept) == 48
        with pytest.raises(StopIteration):
            next(dropped)
    assert _final_status(client, dropped.request_id) == "cancelled"
    assert _final_status(client, kept.request_id) == "finished"
    wait_all_blocks_free(admin)


def test_a_refused_request_raises_from_its_stream_and_the_session_goes_on(
    client: Client, references: dict
) -> None:
    from cbserve_client import InvalidArgumentError

    prompt, expected = references[2]
    with client.session() as session:
        with pytest.raises(InvalidArgumentError, match="token"):
            list(session.stream([10**6], max_new_tokens=4))
        assert session.generate(prompt, max_new_tokens=24, ignore_eos=True).token_ids == expected


def test_a_session_requests_timeout_cancels_it(client: Client, admin: AdminClient) -> None:
    with client.session() as session:
        stream = session.stream(random_prompt(40, 7), max_new_tokens=LONG, ignore_eos=True, timeout=2.0)
        next(chunk for chunk in stream if chunk.token_ids)
        with admin.paused(), pytest.raises(DeadlineExceededError, match="timeout of 2 s"):
            for _ in stream:
                pass
    wait_all_blocks_free(admin)
    assert _final_status(client, stream.request_id) == "cancelled"


def test_closing_a_session_cancels_its_requests_and_frees_their_blocks(
    client: Client, admin: AdminClient
) -> None:
    from cbserve_client import CancelledError

    session = client.session()
    stream = session.stream(random_prompt(40, 7), max_new_tokens=LONG, ignore_eos=True)
    next(chunk for chunk in stream if chunk.token_ids)
    session.close()
    with pytest.raises(CancelledError, match="session was closed"):
        for _ in stream:
            pass
    with pytest.raises(CancelledError):
        session.stream([5, 6, 7], max_new_tokens=2)
    wait_all_blocks_free(admin)
    assert _final_status(client, stream.request_id) == "cancelled"


def test_an_async_session_serves_concurrent_tasks_equal_to_greedy(
    served: RunningServer, references: dict
) -> None:
    import asyncio

    from cbserve_client import AsyncClient

    async def generate_all() -> list:
        async with AsyncClient(served.target) as client, client.session() as session:
            return await asyncio.gather(
                *(
                    session.generate(prompt, max_new_tokens=24, ignore_eos=True)
                    for prompt, _ in references.values()
                )
            )

    completions = asyncio.run(generate_all())
    assert [completion.token_ids for completion in completions] == [
        expected for _, expected in references.values()
    ]


def test_an_async_sessions_timeout_and_close_cancel_its_requests(
    served: RunningServer, client: Client, admin: AdminClient
) -> None:
    import asyncio

    from cbserve_client import AsyncClient, CancelledError

    async def run() -> tuple[str, str]:
        async with AsyncClient(served.target) as async_client:
            session = async_client.session()
            timed = session.stream(random_prompt(40, 7), max_new_tokens=LONG, ignore_eos=True, timeout=2.0)
            kept = session.stream(random_prompt(30, 9), max_new_tokens=LONG, ignore_eos=True)
            async for chunk in timed:
                if chunk.token_ids:
                    break
            with admin.paused(), pytest.raises(DeadlineExceededError, match="timeout of 2 s"):
                async for _ in timed:
                    pass
            await session.aclose()
            with pytest.raises(CancelledError, match="session was closed"):
                async for _ in kept:
                    pass
            return timed.request_id, kept.request_id

    timed_id, kept_id = asyncio.run(run())
    wait_all_blocks_free(admin)
    assert _final_status(client, timed_id) == "cancelled"
    assert _final_status(client, kept_id) == "cancelled"
