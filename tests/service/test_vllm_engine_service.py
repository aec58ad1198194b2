"""`vllm.grpc.engine.VllmEngine` on the generation port: what a gateway relies on, RPC by RPC.

The served model is the tiny random Llama (vocab 256, page size 16); its outputs through this protocol
are compared with the same greedy request through cbserve's own GenerationService.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator

import grpc
import pytest
from cbserve_client import AdminClient, Client
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2, vllm_engine_pb2_grpc

from tests.helpers.models import random_prompt
from tests.helpers.servers import ADMIN_TOKEN, wait_all_blocks_free

TIMEOUT = 30
_REQUEST_NUMBERS = itertools.count()


@pytest.fixture
def stub(served) -> Iterator[vllm_engine_pb2_grpc.VllmEngineStub]:
    with grpc.insecure_channel(served.target) as channel:
        yield vllm_engine_pb2_grpc.VllmEngineStub(channel)


def _request(prompt: list[int], stream: bool = False, **sampling) -> vllm_engine_pb2.GenerateRequest:
    sampling.setdefault("temperature", 0.0)
    return vllm_engine_pb2.GenerateRequest(
        request_id=f"vllm-{next(_REQUEST_NUMBERS)}",
        tokenized=vllm_engine_pb2.TokenizedInput(input_ids=prompt),
        sampling_params=vllm_engine_pb2.SamplingParams(**sampling),
        stream=stream,
    )


def _direct(client: Client, prompt: list[int], max_new_tokens: int) -> list[int]:
    return client.generate(prompt, max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True).token_ids


def test_a_whole_response_equals_the_same_greedy_request_through_cbserve_s_own_protocol(stub, client) -> None:
    prompt = random_prompt(20, seed=1)
    (response,) = list(stub.Generate(_request(prompt, max_tokens=9, ignore_eos=True), timeout=TIMEOUT))
    complete = response.complete
    assert list(complete.output_ids) == _direct(client, prompt, 9)
    assert (complete.finish_reason, complete.prompt_tokens, complete.completion_tokens) == ("length", 20, 9)


def test_a_stream_sends_token_deltas_then_a_completion(stub, client) -> None:
    prompt = random_prompt(20, seed=2)
    responses = list(
        stub.Generate(_request(prompt, stream=True, max_tokens=9, ignore_eos=True), timeout=TIMEOUT)
    )
    *chunks, last = responses
    assert all(response.HasField("chunk") for response in chunks) and last.HasField("complete")
    streamed = [token for response in chunks for token in response.chunk.token_ids]
    assert streamed == _direct(client, prompt, 9)
    assert sum(response.chunk.completion_tokens for response in chunks) == 9
    assert last.complete.finish_reason == "length"
    # As vLLM's servicer does, the completion repeats the last delta (the gateway adds up the chunks).
    assert list(last.complete.output_ids) == list(chunks[-1].chunk.token_ids)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_n_sequences_each_end_with_a_completion_carrying_their_index(stub, client, stream: bool) -> None:
    """Sequence i of n = 3 with seed 11 is the single request seeded 11 + i: streamed, its chunks carry
    its index and add up to it; whole, its completion does."""
    prompt = random_prompt(20, seed=4)
    request = _request(prompt, stream=stream, max_tokens=9, ignore_eos=True, temperature=1.0, seed=11, n=3)
    responses = list(stub.Generate(request, timeout=TIMEOUT))
    completes = [response.complete for response in responses if response.HasField("complete")]
    assert sorted(complete.index for complete in completes) == [0, 1, 2]
    assert all(complete.finish_reason == "length" for complete in completes)
    outputs: dict[int, list[int]] = {index: [] for index in range(3)}
    if stream:
        for response in responses:
            if response.HasField("chunk"):
                outputs[response.chunk.index].extend(response.chunk.token_ids)
    else:
        assert len(responses) == 3
        outputs = {complete.index: list(complete.output_ids) for complete in completes}
    for index, tokens in outputs.items():
        alone = client.generate(prompt, max_new_tokens=9, ignore_eos=True, temperature=1.0, seed=11 + index)
        assert tokens == alone.token_ids, index


def test_a_stop_token_id_ends_the_output_and_is_named_as_the_match(stub, client) -> None:
    prompt = random_prompt(20, seed=3)
    greedy = _direct(client, prompt, 12)
    stop_token = greedy[4]
    first = greedy.index(stop_token)
    (response,) = list(
        stub.Generate(_request(prompt, max_tokens=12, stop_token_ids=[stop_token]), timeout=TIMEOUT)
    )
    assert list(response.complete.output_ids) == greedy[: first + 1]
    assert response.complete.finish_reason == "stop" and response.complete.matched_token_id == stop_token


def test_min_p_of_one_samples_the_most_likely_token(stub, client) -> None:
    prompt = random_prompt(9, seed=6)
    greedy = client.generate(prompt, max_new_tokens=6, ignore_eos=True).token_ids
    (response,) = list(
        stub.Generate(
            _request(prompt, max_tokens=6, ignore_eos=True, min_p=1.0, temperature=1.0, seed=3),
            timeout=TIMEOUT,
        )
    )
    assert list(response.complete.output_ids) == list(greedy)


def test_logprobs_come_with_their_top_alternatives(stub) -> None:
    (response,) = list(
        stub.Generate(
            _request(random_prompt(8, seed=4), max_tokens=3, ignore_eos=True, logprobs=2), timeout=TIMEOUT
        )
    )
    logprobs = response.complete.output_logprobs
    assert list(logprobs.token_ids) == list(response.complete.output_ids)
    assert len(logprobs.token_logprobs) == 3 and all(len(top.values) == 2 for top in logprobs.top_logprobs)
    assert all(value <= 0 for value in logprobs.token_logprobs)


UNSUPPORTED = {
    "n above its bound": (dict(n=129), "sampling_params.n"),
    "min_p above 1": (dict(min_p=1.5), "sampling_params.min_p"),
    "a choice constraint": (dict(choice=vllm_engine_pb2.ChoiceConstraint()), "sampling_params.choice"),
    "every prompt logprob": (dict(prompt_logprobs=-1), "sampling_params.prompt_logprobs"),
    "every logprob": (dict(logprobs=-1), "sampling_params.logprobs"),
    "too many logprobs": (dict(logprobs=21), "sampling_params.logprobs"),
    "top_p > 1": (dict(top_p=1.5), "sampling_params.top_p"),
    "max_tokens past the context": (dict(max_tokens=5000), "sampling_params.max_tokens"),
    "negative seed": (dict(seed=-1), "sampling_params.seed"),
    "token id outside the vocabulary": (dict(stop_token_ids=[999]), "sampling_params.stop_token_ids"),
    "min_tokens above max_tokens": (dict(min_tokens=9), "sampling_params.min_tokens (9)"),
    "a logit bias past its bound": (dict(logit_bias={5: 200.0}), "sampling_params.logit_bias[5] must"),
    "an empty regex": (dict(regex=""), "sampling_params.constraint must not be empty"),
}


@pytest.mark.parametrize("name", UNSUPPORTED)
def test_a_field_cbserve_does_not_serve_fails_that_request_alone_naming_it(stub, client, name: str) -> None:
    sampling, field = UNSUPPORTED[name]
    with pytest.raises(grpc.RpcError) as caught:
        list(
            stub.Generate(
                _request(random_prompt(6, seed=5), **{"max_tokens": 4, **sampling}), timeout=TIMEOUT
            )
        )
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in caught.value.details(), caught.value.details()
    assert client.generate([5, 6, 7], max_new_tokens=2).token_ids  # still serving


def test_request_level_fields_cbserve_does_not_serve_are_refused_naming_them(stub) -> None:
    cases = {
        "kv_transfer_params": dict(kv_transfer_params_json="{}"),
        "data_parallel_rank": dict(data_parallel_rank=1),
        "mm_inputs": dict(mm_inputs=vllm_engine_pb2.MultimodalInputs()),
    }
    for field, extra in cases.items():
        request = _request(random_prompt(6, seed=6), max_tokens=2)
        request.MergeFrom(vllm_engine_pb2.GenerateRequest(**extra))
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.Generate(request, timeout=TIMEOUT))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in caught.value.details()


def test_abort_ends_the_request_and_frees_its_blocks(stub, served) -> None:
    request = _request(random_prompt(10, seed=7), stream=True, max_tokens=900, ignore_eos=True)
    responses = stub.Generate(request, timeout=TIMEOUT)
    assert next(responses).HasField("chunk")
    stub.Abort(vllm_engine_pb2.AbortRequest(request_ids=[request.request_id]), timeout=TIMEOUT)
    last = list(responses)[-1]
    assert last.complete.finish_reason == "abort"
    with AdminClient(served.admin_target, ADMIN_TOKEN) as admin:
        wait_all_blocks_free(admin)


def test_a_dropped_stream_cancels_its_request(stub, served) -> None:
    responses = stub.Generate(
        _request(random_prompt(10, seed=8), stream=True, max_tokens=900, ignore_eos=True), timeout=TIMEOUT
    )
    assert next(responses).HasField("chunk")
    responses.cancel()
    with AdminClient(served.admin_target, ADMIN_TOKEN) as admin:
        wait_all_blocks_free(admin)


def test_model_server_and_load_information(stub, served) -> None:
    health = stub.HealthCheck(vllm_engine_pb2.HealthCheckRequest(), timeout=TIMEOUT)
    assert health.healthy, health.message
    model = stub.GetModelInfo(vllm_engine_pb2.GetModelInfoRequest(), timeout=TIMEOUT)
    assert (model.vocab_size, model.max_context_length, model.served_model_name) == (256, 1024, "tiny")
    assert model.is_generation and list(model.eos_token_ids) == [2]
    server = stub.GetServerInfo(vllm_engine_pb2.GetServerInfoRequest(), timeout=TIMEOUT)
    assert server.block_size == 16 and server.data_parallel_size == 1 and not server.is_paused
    loads = stub.GetLoads(vllm_engine_pb2.GetLoadsRequest(), timeout=TIMEOUT)
    (load,) = loads.loads
    assert loads.dp_rank_count == 1 and load.max_total_num_tokens == 63 * 16
    assert 0 <= load.token_usage <= 1 and load.num_running_reqs == 0


def test_flush_cache_drops_the_prefix_cache_and_says_how_much(stub, client) -> None:
    client.generate(random_prompt(40, seed=9), max_new_tokens=1)  # two full blocks cached at least
    flushed = stub.FlushCache(common_pb2.FlushCacheRequest(), timeout=TIMEOUT)
    assert flushed.success and flushed.message.startswith("dropped ")
    assert int(flushed.message.split()[1]) >= 2
    assert (
        stub.FlushCache(common_pb2.FlushCacheRequest(), timeout=TIMEOUT).message == "dropped 0 cached blocks"
    )


def test_flush_cache_with_a_request_in_flight_fails_at_once_or_waits_up_to_its_timeout(
    stub, client, served
) -> None:
    with AdminClient(served.admin_target, ADMIN_TOKEN) as admin:
        with admin.paused():  # the request below stays queued while the pause holds
            request_id = client.submit(random_prompt(10, seed=12), max_new_tokens=4, ignore_eos=True)
            refused = stub.FlushCache(common_pb2.FlushCacheRequest(), timeout=TIMEOUT)
            assert not refused.success
            assert "requests in flight (1 queued or running)" in refused.message, refused.message
            waiting = stub.FlushCache.future(common_pb2.FlushCacheRequest(timeout_s=TIMEOUT), timeout=TIMEOUT)
        assert list(client.results(request_id))[-1].finish_reason == "length"
        flushed = waiting.result()
        assert flushed.success and flushed.message.startswith("dropped "), flushed.message
    with pytest.raises(grpc.RpcError) as refused_timeout:
        stub.FlushCache(common_pb2.FlushCacheRequest(timeout_s=-1), timeout=TIMEOUT)
    assert refused_timeout.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_the_kv_event_stream_answers_at_once_and_carries_a_prompt_s_blocks(served, client) -> None:
    prompt = random_prompt(3 * 16 + 5, seed=10)
    pages = [tuple(prompt[index * 16 : (index + 1) * 16]) for index in range(3)]

    async def subscribe() -> list[tuple[int, ...]]:
        async with grpc.aio.insecure_channel(served.target) as channel:
            events = vllm_engine_pb2_grpc.VllmEngineStub(channel).SubscribeKvEvents(
                common_pb2.SubscribeKvEventsRequest(
                    start_sequence_number=0, load_records_before_first_batch=True
                )
            )
            await asyncio.wait_for(events.initial_metadata(), timeout=2)  # a gateway allows two seconds
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, lambda: client.generate(prompt, max_new_tokens=1))
            stored: list[tuple[int, ...]] = []
            while not set(pages) <= set(stored):
                batch = await asyncio.wait_for(events.read(), timeout=TIMEOUT)
                for event in batch.events:
                    if event.WhichOneof("data") == "stored":
                        stored.extend(tuple(block.token_ids) for block in event.stored.blocks)
            events.cancel()
            return stored

    stored = asyncio.run(subscribe())
    assert stored.index(pages[0]) < stored.index(pages[1]) < stored.index(pages[2])


def test_a_tokenizer_that_is_not_a_transformers_tokenizer_is_not_exported(stub) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=TIMEOUT))
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_a_stop_string_ends_the_output_and_is_named_as_the_match(stub, client) -> None:
    """Matched on the decoded text, as cbserve's own protocol matches it (the tokenizer here is bytes)."""
    prompt = random_prompt(20, seed=11)
    greedy = _direct(client, prompt, 12)
    printable = [index for index, token in enumerate(greedy) if 33 <= token < 127]
    assert printable, f"no printable byte in {greedy} to stop on"
    stop = chr(greedy[printable[0]])
    request = _request(prompt, max_tokens=12, stop=[stop])
    (response,) = list(stub.Generate(request, timeout=TIMEOUT))
    end = greedy.index(greedy[printable[0]]) + 1
    assert list(response.complete.output_ids) == greedy[:end]
    assert response.complete.finish_reason == "stop" and response.complete.matched_stop_str == stop
