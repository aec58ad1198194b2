"""CPU offload: preempted requests park their KV in host memory and resume without recomputation."""

from __future__ import annotations

import torch

from engine import ContinuousBatchingConfig, init_continuous_batching
from engine.kv.cache_manager import KVCacheManager
from engine.kv.offload import HostBlockPool
from engine.request import FinishReason, Request, RequestStatus
from engine.runner.kv_cache import HostKVCache, KVCacheShape, PagedKVCache
from engine.sampling.params import SamplingParams
from engine.scheduling.scheduler import Scheduler
from tests.helpers.models import random_prompt, tiny_model
from tests.helpers.oracle import reference_greedy

TIMEOUT = 120


def _filled_cache(num_blocks: int, page_size: int) -> PagedKVCache:
    cache = PagedKVCache(KVCacheShape(3, 2, 8, torch.float32), num_blocks, page_size, torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    for tensor in (*cache.key_caches, *cache.value_caches):
        tensor.copy_(torch.randn(tensor.shape, generator=generator))
    return cache


def test_offload_then_restore_round_trips_block_bytes_exactly():
    device = _filled_cache(num_blocks=10, page_size=4)
    host = HostKVCache(device, num_blocks=4)
    original = {block: device.block_bytes(block) for block in (3, 5, 6)}
    untouched = {block: device.block_bytes(block) for block in (1, 4, 8)}
    host.offload([3, 5, 6], [2, 0, 3])
    for block in (3, 5, 6, 7, 9):  # overwrite the freed blocks and the restore targets
        rows = slice(block * 4, (block + 1) * 4)
        for tensor in (*device.key_caches, *device.value_caches):
            tensor[rows] = -1.0
    host.restore([9, 7, 3], [2, 0, 3])
    assert device.block_bytes(9) == original[3]
    assert device.block_bytes(7) == original[5]
    assert device.block_bytes(3) == original[6]
    assert all(device.block_bytes(block) == data for block, data in untouched.items())


def test_a_host_block_offloaded_to_twice_before_a_restore_holds_the_newer_rows():
    """Offloads land in the host blocks after the offload call, in order: a host block freed (its request
    cancelled) and offloaded to again must not get the older rows written over the newer."""
    device = _filled_cache(num_blocks=10, page_size=4)
    host = HostKVCache(device, num_blocks=4)
    older, newer = device.block_bytes(3), device.block_bytes(5)
    host.offload([3], [1])
    host.offload([5], [1])
    host.restore([8], [1])
    assert device.block_bytes(8) == newer != older


def test_host_blocks_read_by_a_restore_return_to_the_pool_only_after_the_step():
    pool = HostBlockPool(3)
    taken = pool.allocate(2)
    assert taken is not None and pool.num_free_blocks == 1
    assert pool.allocate(2) is None and pool.num_free_blocks == 1, "a failed allocation takes nothing"
    pool.free_after_step(taken)
    assert pool.num_free_blocks == 1, "an offload of the same step must not overwrite them"
    pool.release_pending()
    assert pool.num_free_blocks == 3


def _scheduler_with_offload(num_device_blocks: int, num_host_blocks: int) -> Scheduler:
    manager = KVCacheManager(num_device_blocks, page_size=4, enable_prefix_caching=False)
    return Scheduler(
        manager,
        max_batch_tokens=64,
        max_requests_per_batch=8,
        safety_margin=0.0,
        host_block_pool=HostBlockPool(num_host_blocks),
    )


def _fill_and_preempt(scheduler: Scheduler):
    first = Request("first", list(range(10, 22)), SamplingParams(max_new_tokens=8))
    second = Request("second", list(range(30, 42)), SamplingParams(max_new_tokens=8))
    for request in (first, second):
        scheduler.add_request(request)
    output = scheduler.schedule()
    scheduler.update_from_output(output, [1, 1])
    # 6 usable blocks of 4 tokens: the 13th token of each needs a 4th block, so one must make room.
    output = scheduler.schedule()
    assert [request.request_id for request in output.preempted] == ["second"]
    return first, second, output


def test_preemption_offloads_the_computed_blocks_and_resumption_restores_them():
    scheduler = _scheduler_with_offload(num_device_blocks=7, num_host_blocks=8)
    first, second, output = _fill_and_preempt(scheduler)
    (offload,) = output.offloads
    assert offload.device_block_ids == (4, 5, 6) and len(offload.host_block_ids) == 3
    assert second.offloaded is not None and second.offloaded.num_tokens == 12
    scheduler.update_from_output(output, [1])
    scheduler.finish_request(first, RequestStatus.FINISHED, FinishReason.LENGTH)
    scheduler.remove_finished_running()
    output = scheduler.schedule()
    (restore,) = output.restores
    assert restore.host_block_ids == offload.host_block_ids
    (item,) = output.scheduled
    assert item.request is second and item.num_computed_tokens == 12 and item.num_new_tokens == 1
    assert scheduler.counters.offloaded_blocks == 3 and scheduler.counters.restored_blocks == 3
    assert scheduler.counters.recomputed_tokens == 0
    assert scheduler.host_block_pool is not None and scheduler.host_block_pool.num_free_blocks == 5
    scheduler.host_block_pool.release_pending()
    assert scheduler.host_block_pool.num_free_blocks == 8


def test_a_full_host_pool_falls_back_to_recompute():
    scheduler = _scheduler_with_offload(num_device_blocks=7, num_host_blocks=2)
    _, second, output = _fill_and_preempt(scheduler)
    assert output.offloads == [] and second.offloaded is None
    assert second.num_tokens_to_recompute == 12


def test_cancelling_an_offloaded_request_frees_its_host_blocks():
    scheduler = _scheduler_with_offload(num_device_blocks=7, num_host_blocks=8)
    _, second, _ = _fill_and_preempt(scheduler)
    assert scheduler.host_block_pool is not None and scheduler.host_block_pool.num_free_blocks == 5
    scheduler.finish_request(second, RequestStatus.CANCELLED, FinishReason.CANCELLED)
    assert second.offloaded is None and scheduler.host_block_pool.num_free_blocks == 8


def _run_all(model, prompts, new_tokens, config):
    manager = init_continuous_batching(model, continuous_batching_config=config)
    manager.start()
    try:
        ids = [manager.add_request(prompt, max_new_tokens=new_tokens, eos_token_id=[]) for prompt in prompts]
        outputs = [manager.get_result(request_id, timeout=TIMEOUT) for request_id in ids]
        manager.stop(block=True, timeout=TIMEOUT)
        return outputs, manager.stats()
    finally:
        manager.destroy()


def _assert_parity(model, prompts, new_tokens, outputs):
    for index, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
        assert output.status == RequestStatus.FINISHED, output.error
        expected = reference_greedy(model, prompt, new_tokens)
        assert output.generated_tokens == expected, (
            f"request {index} (prompt {len(prompt)} tokens)\n  engine:   {output.generated_tokens}\n"
            f"  generate: {expected}"
        )


def test_greedy_parity_when_preempted_requests_resume_from_offloaded_kv():
    model = tiny_model("llama")
    prompts = [random_prompt(40 + 7 * index, seed=7000 + index) for index in range(12)]
    config = ContinuousBatchingConfig(
        page_size=8, num_blocks=40, max_batch_tokens=128, cpu_offload_space=0.01, allow_block_sharing=False
    )
    outputs, stats = _run_all(model, prompts, 30, config)
    assert stats.offloaded_blocks > 0 and stats.restored_blocks == stats.offloaded_blocks, stats
    assert stats.recomputed_tokens == 0, "with room on the host nothing should be recomputed"
    _assert_parity(model, prompts, 30, outputs)


def test_stress_64_requests_on_a_cache_holding_about_8_finish_equal_to_generate_with_all_blocks_free():
    model = tiny_model("qwen3")
    prompts = [random_prompt(20 + (index * 13) % 50, seed=8000 + index) for index in range(64)]
    new_tokens = 24
    # About 8 requests of ~45 + 24 tokens fit in 70 blocks of 8; the host pool holds about 16 blocks,
    # so preemptions both offload and, once it is full, recompute.
    block_bytes = KVCacheShape.from_model_config(model.config, torch.float32).bytes_per_token() * 8
    config = ContinuousBatchingConfig(
        page_size=8,
        num_blocks=70,
        max_batch_tokens=256,
        cpu_offload_space=16 * block_bytes / 2**30,
        allow_block_sharing=True,
    )
    outputs, stats = _run_all(model, prompts, new_tokens, config)
    assert stats.preemptions > 0 and stats.offloaded_blocks > 0, stats
    assert stats.num_blocks_used == 0, f"{stats.num_blocks_used} blocks still held after every request ended"
    _assert_parity(model, prompts, new_tokens, outputs)
