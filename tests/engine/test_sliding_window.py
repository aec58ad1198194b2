"""Sliding-window layers keep only their window in the cache: a small set of recycled blocks per request.

Allocator tests run without a model; parity tests compare the engine with `model.generate` on tiny
Mistral (every layer sliding, window 24) and Gemma 2 (alternating sliding and full layers).
"""

from __future__ import annotations

import pytest
import torch

from engine import ContinuousBatchingConfig, ContinuousBatchingManager, init_continuous_batching
from engine.kv.block_pool import NULL_BLOCK_ID
from engine.kv.cache_manager import KVCacheManager, blocks_for_tokens
from engine.kv.layer_groups import KVCacheGroupSpec, kv_cache_groups
from engine.kv.offload import HostBlockPool
from engine.kv.sliding_window import SlidingWindowManager
from engine.loop.admission import RejectionReason, size_rejection
from engine.request import Request, RequestStatus
from engine.runner.kv_cache import KVCacheShape
from engine.sampling.params import SamplingParams
from engine.scheduling.scheduler import Scheduler, SchedulerOutput
from tests.helpers.engine_runs import engine_core
from tests.helpers.models import random_prompt, tiny_config, tiny_model
from tests.helpers.oracle import reference_greedy

WINDOW = 24
PAGE = 8
TIMEOUT = 120


def make_request(request_id: str, num_prompt_tokens: int, max_new_tokens: int = 8) -> Request:
    prompt = random_prompt(num_prompt_tokens, seed=num_prompt_tokens)
    return Request(request_id, prompt, SamplingParams(max_new_tokens=max_new_tokens, eos_token_ids=()))


def held_blocks(group: SlidingWindowManager, request_id: str) -> list[int]:
    return [block_id for block_id in group.block_ids(request_id) if block_id != NULL_BLOCK_ID]


def max_held(num_new_tokens: int) -> int:
    return blocks_for_tokens(WINDOW + num_new_tokens, PAGE) + 1


def assert_no_block_held(manager: KVCacheManager) -> None:
    for group in manager.groups:
        assert group.block_pool.num_used_blocks == 0, f"{type(group).__name__} leaked blocks"
        assert not group.block_tables


# --- layer groups from the model config ----------------------------------------------------------


def test_layer_groups_come_from_the_model_config():
    assert kv_cache_groups(tiny_config("llama")) == [KVCacheGroupSpec((0, 1), None)]
    assert kv_cache_groups(tiny_config("qwen3")) == [KVCacheGroupSpec((0, 1), None)]
    assert kv_cache_groups(tiny_config("mistral")) == [KVCacheGroupSpec((0, 1), WINDOW)]
    assert kv_cache_groups(tiny_config("gemma2")) == [
        KVCacheGroupSpec((1,), None),
        KVCacheGroupSpec((0,), WINDOW),
    ]


# --- the allocator ---------------------------------------------------------------------------------


def test_a_request_longer_than_the_window_holds_only_its_window_and_recycles_blocks():
    # 11 usable blocks for a request of 43 pages: it only finishes if out-of-window blocks come back.
    manager = KVCacheManager(12, PAGE, enable_prefix_caching=False, sliding_windows=[WINDOW])
    group = manager.sliding_window_groups[0]
    request = make_request("r", 300, max_new_tokens=40)
    while request.num_tokens < 340:
        if request.num_computed_tokens == request.num_tokens:
            request.all_token_ids.append(5)  # a decoded token
        num_new = min(32, request.num_tokens - request.num_computed_tokens)
        assert manager.allocate_slots(request, num_new) is not None
        table = group.block_ids("r")
        held = held_blocks(group, "r")
        assert len(held) <= max_held(num_new), (request.num_computed_tokens, table)
        first_needed = max(0, request.num_computed_tokens - WINDOW + 1) // PAGE
        assert table[:first_needed] == [NULL_BLOCK_ID] * first_needed, "pages before the window are null"
        assert NULL_BLOCK_ID not in table[first_needed:]
        assert group.block_pool.num_used_blocks == len(held), "freed pages went back to the pool"
        request.num_computed_tokens += num_new
    manager.free(request)
    assert_no_block_held(manager)


def test_allocation_is_atomic_across_groups():
    # Full group: 40 usable blocks; sliding group: 6, enough for one window plus a small step.
    manager = KVCacheManager([41, 7], PAGE, enable_prefix_caching=False, sliding_windows=[None, WINDOW])
    first, second = make_request("a", 30), make_request("b", 30)
    assert manager.allocate_slots(first, 30) is not None
    full_before = manager.block_pool.num_free_blocks
    assert manager.allocate_slots(second, 30) is None, "the sliding group cannot hold a second window"
    assert manager.block_pool.num_free_blocks == full_before, "the full group must be left untouched"
    assert "b" not in manager.block_tables and "b" not in manager.groups[1].block_tables
    manager.free(first)
    assert_no_block_held(manager)


def _run_scheduler(scheduler: Scheduler, requests: list[Request], cancel: str | None = None) -> int:
    """Steps the scheduler with dummy sampled tokens until every request ends; returns the steps."""
    for request in requests:
        assert size_rejection(request, scheduler) is None
        scheduler.add_request(request)
    manager = scheduler.kv_cache_manager
    steps = 0
    while scheduler.has_unfinished_requests():
        output: SchedulerOutput = scheduler.schedule()
        steps += 1
        for copy in (*output.offloads, *output.restores):
            assert NULL_BLOCK_ID not in copy.device_block_ids, "only blocks holding KV are copied"
        for item in output.scheduled:
            for group in manager.sliding_window_groups:
                assert len(held_blocks(group, item.request.request_id)) <= max_held(item.num_new_tokens)
        tokens = [7 if item.samples_token else None for item in output.scheduled]
        scheduler.update_from_output(output, tokens)
        if scheduler.host_block_pool is not None:
            scheduler.host_block_pool.release_pending()
        if cancel is not None and steps == 5:
            request = next(request for request in requests if request.request_id == cancel)
            scheduler.finish_request(request, RequestStatus.CANCELLED, "cancelled")
            scheduler.remove_finished_running()
        assert steps < 10_000
    return steps


@pytest.mark.parametrize("num_host_blocks", [0, 64])
@pytest.mark.parametrize("windows", [[WINDOW], [None, WINDOW]], ids=["sliding", "hybrid"])
def test_preemption_offload_and_cancel_leak_no_block(windows, num_host_blocks):
    num_blocks = [14] * len(windows) if len(windows) == 1 else [30, 14]
    manager = KVCacheManager(num_blocks, PAGE, enable_prefix_caching=False, sliding_windows=windows)
    host_pool = HostBlockPool(num_host_blocks) if num_host_blocks else None
    scheduler = Scheduler(
        manager, max_batch_tokens=32, max_requests_per_batch=8, safety_margin=0.0, host_block_pool=host_pool
    )
    requests = [make_request(f"r{index}", 20 + 11 * index, max_new_tokens=30) for index in range(5)]
    _run_scheduler(scheduler, requests, cancel="r2")
    assert scheduler.counters.preemptions > 0
    if host_pool is not None:
        assert scheduler.counters.offloaded_blocks > 0
        assert scheduler.counters.restored_blocks == scheduler.counters.offloaded_blocks
        assert host_pool.num_free_blocks == num_host_blocks
    assert_no_block_held(manager)


def test_a_restored_request_gets_null_pages_before_its_window():
    manager = KVCacheManager(40, PAGE, enable_prefix_caching=False, sliding_windows=[WINDOW])
    host_pool = HostBlockPool(16)
    scheduler = Scheduler(
        manager, max_batch_tokens=64, max_requests_per_batch=8, safety_margin=0.0, host_block_pool=host_pool
    )
    request = make_request("r", 60)
    scheduler.add_request(request)
    output = scheduler.schedule()
    scheduler.update_from_output(output, [7])  # the whole prompt computed, one token sampled
    scheduler._preempt(request, output)
    offload = output.offloads[-1]
    # Tokens 0..59 computed: the next query (position 60) reads positions 37..59, pages 4..7.
    assert len(offload.device_block_ids) == 4
    scheduler.host_block_pool.release_pending()  # type: ignore[union-attr]
    resumed = scheduler.schedule()
    assert resumed.restores and len(resumed.restores[0].device_block_ids) == 4
    table = manager.block_ids("r")
    assert table[:4] == [NULL_BLOCK_ID] * 4 and NULL_BLOCK_ID not in table[4:]
    assert resumed.restores[0].device_block_ids == tuple(table[4:8])


def test_admission_rejects_a_sliding_group_too_small_for_one_window_and_step():
    manager = KVCacheManager(5, PAGE, enable_prefix_caching=False, sliding_windows=[WINDOW])
    scheduler = Scheduler(manager, max_batch_tokens=32, max_requests_per_batch=8, safety_margin=0.0)
    rejection = size_rejection(make_request("r", 100), scheduler)
    assert rejection is not None and rejection.reason == RejectionReason.SLIDING_WINDOW_CACHE_TOO_SMALL
    assert "sliding-window" in rejection.message and rejection.field == "max_batch_tokens"
    small_step = Scheduler(manager, max_batch_tokens=1, max_requests_per_batch=8, safety_margin=0.0)
    assert size_rejection(make_request("r", 100, max_new_tokens=500), small_step) is None, (
        "a sliding-only model has no length bound from its cache"
    )


# --- the engine ------------------------------------------------------------------------------------


def _run(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int, config: ContinuousBatchingConfig):
    manager = init_continuous_batching(model, continuous_batching_config=config)
    manager.start()
    try:
        ids = [manager.add_request(prompt, max_new_tokens=new_tokens, eos_token_id=[]) for prompt in prompts]
        outputs = [manager.get_result(request_id, timeout=TIMEOUT) for request_id in ids]
        manager.stop(block=True, timeout=TIMEOUT)
        stats = manager.stats()
    finally:
        manager.destroy()
    return outputs, stats


def _assert_parity(model, prompts, new_tokens, outputs):
    for index, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
        assert output is not None and output.error is None, output
        expected = reference_greedy(model, prompt, new_tokens)
        assert output.generated_tokens == expected, (
            f"request {index} (prompt {len(prompt)} tokens)\n  engine:   {output.generated_tokens}\n"
            f"  generate: {expected}"
        )


# Mistral's cache is all sliding, so a handful of blocks makes it preempt; Gemma 2's full group does.
NUM_BLOCKS = {"mistral": 14, "gemma2": 40}


@pytest.mark.parametrize("offload", [False, True], ids=["recompute", "offload"])
@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_greedy_parity_under_chunking_preemption_and_offload(family, offload):
    model = tiny_model(family)
    prompts = [random_prompt(length, seed=9000 + length) for length in (5, 30, 70, 150)]
    block_bytes = KVCacheShape.from_model_config(model.config, torch.float32).bytes_per_token() * PAGE
    config = ContinuousBatchingConfig(
        page_size=PAGE,
        num_blocks=NUM_BLOCKS[family],
        max_batch_tokens=32,
        cpu_offload_space=64 * block_bytes / 2**30 if offload else 0,
    )
    outputs, stats = _run(model, prompts, 40, config)
    assert stats.preemptions > 0, "the cache was meant to be too small to avoid preemption"
    assert not stats.prefix_caching_enabled, "prefix sharing must be off for models with sliding layers"
    if offload:
        assert stats.offloaded_blocks > 0, stats
    assert stats.num_blocks_used == 0, stats
    _assert_parity(model, prompts, 40, outputs)


def test_a_long_mistral_request_holds_only_a_window_of_blocks(monkeypatch):
    held_per_step: list[int] = []
    allocate = SlidingWindowManager.allocate

    def recording_allocate(self, request, num_computed, num_new_tokens):
        new_blocks = allocate(self, request, num_computed, num_new_tokens)
        held_per_step.append(len(held_blocks(self, request.request_id)))
        return new_blocks

    monkeypatch.setattr(SlidingWindowManager, "allocate", recording_allocate)
    model = tiny_model("mistral")
    prompt = random_prompt(300, seed=9500)
    config = ContinuousBatchingConfig(page_size=PAGE, num_blocks=128, max_batch_tokens=32)
    outputs, stats = _run(model, [prompt], 30, config)
    needed_without_window = blocks_for_tokens(300 + 30, PAGE)
    assert max(held_per_step) <= (WINDOW + 32) // PAGE + 2, held_per_step
    assert max(held_per_step) * 5 < needed_without_window
    assert stats.num_blocks_used == 0
    _assert_parity(model, [prompt], 30, outputs)


def test_stats_count_the_blocks_of_every_cache_group():
    config = ContinuousBatchingConfig(page_size=PAGE, num_blocks=40)
    manager = ContinuousBatchingManager(tiny_model("gemma2"), continuous_batching_config=config)
    try:
        manager.start()
        pools = [group.block_pool for group in engine_core(manager).kv_cache_manager.groups]
        assert len(pools) == 2, "Gemma 2 keeps a full and a sliding group"
        stats = manager.stats()
        total = sum(pool.num_usable_blocks for pool in pools)
        assert stats.num_blocks_total == total > pools[0].num_usable_blocks
        request_id = manager.add_request(random_prompt(60, seed=9600), max_new_tokens=30, streaming=True)
        for _ in range(3):  # stats are refreshed after each step: by the 3rd token they show the prefill
            assert manager.get_result(request_id, timeout=60) is not None
        used = manager.stats().num_blocks_used
        assert used > blocks_for_tokens(61, PAGE), f"{used} blocks: the sliding group's are not counted"
    finally:
        manager.destroy()
