"""The load record gateways route on (`GetLoads` and every KV event batch), field by field against the
engine's own counters (`ManagerStats`), on the tiny random Llama (page size 16, prefix caching on)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from cbserve_client import AdminClient
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2, vllm_engine_pb2_grpc

from service.engine_host import EngineHost
from tests.helpers.models import random_prompt
from tests.helpers.servers import ADMIN_TOKEN, ByteTokenizer, RunningServer, wait_until

TIMEOUT = 30
PAGE_SIZE = 16


@pytest.fixture(scope="module")
def server(model) -> Iterator[tuple[RunningServer, EngineHost]]:
    running = RunningServer(model, tokenizer=ByteTokenizer())
    try:
        yield running, running.load()
    finally:
        running.close()


@pytest.fixture
def stub(server) -> Iterator[vllm_engine_pb2_grpc.VllmEngineStub]:
    with grpc.insecure_channel(server[0].target) as channel:
        yield vllm_engine_pb2_grpc.VllmEngineStub(channel)


def _generate(stub, request_id: str, prompt: list[int], max_tokens: int = 2) -> None:
    request = vllm_engine_pb2.GenerateRequest(
        request_id=request_id,
        tokenized=vllm_engine_pb2.TokenizedInput(input_ids=prompt),
        sampling_params=vllm_engine_pb2.SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True
        ),
    )
    list(stub.Generate(request, timeout=TIMEOUT))


def _first_heartbeat(stub) -> common_pb2.EngineLoad:
    subscription = common_pb2.SubscribeKvEventsRequest(load_records_before_first_batch=True)
    batches = stub.SubscribeKvEvents(subscription, timeout=TIMEOUT)
    try:
        return next(batch for batch in batches if batch.load.load_only).load
    finally:
        batches.cancel()


def test_a_paused_engine_reports_its_queued_work_and_a_growing_silence(server, stub) -> None:
    running, host = server
    shared = random_prompt(2 * PAGE_SIZE + 8, seed=31)
    _generate(stub, "warm", shared)  # its two full pages stay in the prefix cache
    hit_prompt = shared[: 2 * PAGE_SIZE] + random_prompt(10, seed=32)
    fresh_prompt = random_prompt(20, seed=33)
    expected_uncached = (len(hit_prompt) - 2 * PAGE_SIZE) + len(fresh_prompt)
    with (
        AdminClient(running.admin_target, token=ADMIN_TOKEN, timeout=TIMEOUT) as admin,
        ThreadPoolExecutor(2) as pool,
    ):
        with admin.paused():
            queued = [
                pool.submit(_generate, stub, "hit", hit_prompt),
                pool.submit(_generate, stub, "fresh", fresh_prompt),
            ]
            wait_until(lambda: host.stats().num_waiting == 2, what="both requests queued")
            stats = host.stats()
            assert stats.waiting_uncached_tokens == expected_uncached
            assert stats.prefill_pending_tokens == expected_uncached, "neither has produced a token"

            (load,) = stub.GetLoads(vllm_engine_pb2.GetLoadsRequest(), timeout=TIMEOUT).loads
            assert load.num_waiting_uncached_tokens == stats.waiting_uncached_tokens
            record = host.engine_load()
            assert record.waiting_uncached_tokens == stats.waiting_uncached_tokens
            assert record.prefill_pending_tokens == stats.prefill_pending_tokens
            assert record.engine_reports_steps
            assert (record.queues.waiting, record.queues.paused, record.queues.retracted) == (2, 2, 0)
            assert record.HasField("engine_silence_ms")
            silence_before = record.engine_silence_ms
            time.sleep(0.1)
            assert host.engine_load().engine_silence_ms > silence_before, "no step runs while paused"
            assert host.stats().progress_at == stats.progress_at

            pushed = _first_heartbeat(stub)
            assert pushed.waiting_uncached_tokens == stats.waiting_uncached_tokens
            assert pushed.prefill_pending_tokens == stats.prefill_pending_tokens
            assert pushed.HasField("engine_silence_ms") and pushed.engine_reports_steps
            assert pushed.queues.waiting == 2
        for future in queued:
            future.result(TIMEOUT)


def test_an_idle_engine_reports_no_silence_and_no_pending_work(server, stub) -> None:
    _, host = server
    _generate(stub, "idle-check", random_prompt(20, seed=34))
    wait_until(lambda: not host.stats().has_unfinished_requests, what="the engine idle")
    record = host.engine_load()
    assert not record.HasField("engine_silence_ms"), "no request in flight: nothing to be silent on"
    assert (record.waiting_uncached_tokens, record.prefill_pending_tokens) == (0, 0)
    assert record.HasField("waiting_uncached_tokens") and record.HasField("prefill_pending_tokens")


def test_active_token_usage_leaves_out_blocks_kept_only_for_the_prefix_cache(server, stub) -> None:
    _, host = server
    _generate(stub, "cached", random_prompt(3 * PAGE_SIZE, seed=35))
    wait_until(lambda: not host.stats().has_unfinished_requests, what="the engine idle")
    stats = host.stats()
    assert stats.num_blocks_cached > 0 and stats.num_blocks_used == 0
    record = host.engine_load()
    assert record.HasField("active_token_usage") and record.active_token_usage == 0.0


def test_every_completed_step_resets_the_silence(server, stub) -> None:
    _, host = server
    before = host.stats()
    _generate(stub, "steps", random_prompt(20, seed=36), max_tokens=5)
    after = host.stats()
    # One step prefills and samples the first token, then one step per token: each one ends a silence.
    assert after.num_steps - before.num_steps >= 5
    assert after.progress_at > before.progress_at
