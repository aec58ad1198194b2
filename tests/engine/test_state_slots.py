"""State slots (engine.kv.state_slots): one per running request for the recurrent layers, taken when the
request is admitted, given back when it finishes or is preempted, never shared, never offloaded."""

from __future__ import annotations

import pytest

from engine.kv.block_pool import NULL_BLOCK_ID
from engine.kv.cache_manager import KVCacheManager
from engine.kv.layer_groups import ConvStateSpec, StateGroupSpec, kv_cache_groups, state_group
from engine.kv.offload import HostBlockPool
from engine.request import FinishReason, Request, RequestStatus
from engine.sampling.params import SamplingParams
from engine.scheduling.scheduler import Scheduler
from tests.engine.test_cpu_offload import _fill_and_preempt
from tests.helpers.families import tiny_family_config

PAGE_SIZE = 4


def _request(request_id: str, length: int = 6, max_new_tokens: int = 4) -> Request:
    return Request(request_id, list(range(10, 10 + length)), SamplingParams(max_new_tokens=max_new_tokens))


def _manager(num_blocks: int = 32, num_state_slots: int = 4) -> KVCacheManager:
    return KVCacheManager(num_blocks, PAGE_SIZE, enable_prefix_caching=False, num_state_slots=num_state_slots)


def _slot(manager: KVCacheManager, request: Request) -> list[int]:
    return manager.block_ids_per_group(request.request_id)[-1]


def test_lfm2_keeps_pages_for_its_attention_layers_and_a_conv_state_for_its_convolutions():
    config = tiny_family_config("lfm2")
    assert config.layer_types == ["conv", "full_attention", "conv"]
    assert [group.layer_indices for group in kv_cache_groups(config)] == [(1,)]
    assert state_group(config) == StateGroupSpec((0, 2), "conv", ConvStateSpec(3, config.hidden_size))
    assert ConvStateSpec(3, 64).state_shape == (2, 64)


def test_a_request_takes_a_slot_on_admission_keeps_it_and_gives_it_back_when_freed():
    manager = _manager()
    request = _request("a")
    assert manager.allocate_slots(request, 6) is not None
    (slot,) = _slot(manager, request)
    assert slot != NULL_BLOCK_ID
    request.num_computed_tokens = 6
    assert manager.allocate_slots(request, 1) is not None
    assert _slot(manager, request) == [slot], "a running request keeps its slot"
    assert manager.state_group is not None and manager.state_group.block_pool.num_free_blocks == 2
    manager.free(request)
    assert _slot(manager, request) == [] and manager.state_group.block_pool.num_free_blocks == 3


def test_a_freed_slot_goes_to_the_next_request_which_starts_at_position_zero():
    manager = _manager(num_state_slots=2)
    first, second = _request("first"), _request("second")
    assert manager.allocate_slots(first, 6) is not None
    assert manager.allocate_slots(second, 6) is None, "one usable slot, held by the first request"
    manager.free(first)
    assert manager.allocate_slots(second, 6) is not None
    assert _slot(manager, second) == [1]


def test_no_slot_means_no_allocation_in_any_group():
    manager = _manager(num_state_slots=2)
    assert manager.allocate_slots(_request("first"), 6) is not None
    free_blocks = manager.block_pool.num_free_blocks
    assert manager.allocate_slots(_request("second"), 6) is None
    assert manager.block_pool.num_free_blocks == free_blocks, "the paged group took nothing either"


def test_a_slot_is_never_handed_to_a_request_past_position_zero():
    manager = _manager()
    request = _request("resumed")
    request.num_computed_tokens = 4  # a prefix hit or a restore would do this: neither exists here
    with pytest.raises(RuntimeError, match="built from position 0 only"):
        manager.allocate_slots(request, 2)


def test_prefix_caching_is_refused_with_a_state_group():
    with pytest.raises(ValueError, match="state group"):
        KVCacheManager(32, PAGE_SIZE, enable_prefix_caching=True, num_state_slots=4)


def test_state_slots_do_not_count_in_the_free_fraction_or_the_block_stats():
    manager = _manager(num_state_slots=2)
    assert manager.allocate_slots(_request("a"), 6) is not None
    assert manager.free_fraction == manager.block_pool.num_free_blocks / manager.block_pool.num_usable_blocks
    assert manager.make_stats().num_blocks_total == 31


def test_a_forked_sequence_gets_a_copy_of_its_sources_slot():
    manager = _manager()
    source, child = _request("source"), _request("child")
    assert manager.allocate_slots(source, 5) is not None
    source.num_computed_tokens = 5
    copies = manager.fork(source, child, 5)
    assert copies is not None
    state_copy = copies[-1]
    assert state_copy.group == 1
    assert state_copy.source_block_ids == tuple(_slot(manager, source))
    assert state_copy.target_block_ids == tuple(_slot(manager, child))
    assert _slot(manager, child) != _slot(manager, source)


def _scheduler(num_blocks: int, host_blocks: int = 0) -> Scheduler:
    return Scheduler(
        _manager(num_blocks=num_blocks),
        max_batch_tokens=64,
        max_requests_per_batch=3,
        safety_margin=0.0,
        host_block_pool=HostBlockPool(host_blocks) if host_blocks else None,
    )


def test_a_preempted_request_gives_its_slot_back_and_recomputes_even_with_room_on_the_host():
    scheduler = _scheduler(num_blocks=7, host_blocks=16)
    state_pool = scheduler.kv_cache_manager.state_group.block_pool  # type: ignore[union-attr]
    first, second, output = _fill_and_preempt(scheduler)
    assert output.offloads == [] and second.offloaded is None, "a state has no host copy"
    assert second.num_tokens_to_recompute == 12 and second.num_computed_tokens == 0
    assert state_pool.num_free_blocks == 2
    scheduler.update_from_output(output, [1])
    scheduler.finish_request(first, RequestStatus.FINISHED, FinishReason.LENGTH)
    scheduler.remove_finished_running()
    output = scheduler.schedule()
    (item,) = output.scheduled
    assert item.request is second and item.num_computed_tokens == 0, "it recomputes from position 0"
    assert item.block_ids[-1] != [] and state_pool.num_free_blocks == 2
