"""The prefix cache's events let a router mirror exactly what each replica can reuse."""

from __future__ import annotations

import itertools
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ContinuousBatchingConfig,
    EngineBusyError,
    KVCacheEvent,
    PrefixCacheReset,
    RequestStatus,
    init_continuous_batching,
)
from engine.kv.block_pool import BlockPool
from engine.kv.prefix_hash import extend_block_hashes
from tests.helpers.engine_runs import engine_core
from tests.helpers.models import random_prompt, tiny_model

PAGE_SIZE = 4
TIMEOUT = 60


class Mirror:
    """What a router's index holds after applying the events in order (it may be fed from any thread)."""

    def __init__(self) -> None:
        self.blocks: dict[bytes, BlockStored] = {}
        self.events: list[KVCacheEvent] = []
        self.lock = threading.Lock()

    def __call__(self, events: list[KVCacheEvent]) -> None:
        with self.lock:
            for event in events:
                self.events.append(event)
                if isinstance(event, BlockStored):
                    assert event.block_hash not in self.blocks, "a block stored twice without a removal"
                    self.blocks[event.block_hash] = event
                elif isinstance(event, BlockRemoved):
                    assert event.block_hash in self.blocks, "a removal of a block never stored"
                    del self.blocks[event.block_hash]
                else:
                    self.blocks.clear()


def cached_blocks(pool: BlockPool) -> dict[bytes, tuple[bytes | None, tuple[int, ...]]]:
    return {
        block.block_hash: (block.parent_hash, block.token_ids)
        for block in pool.blocks
        if block.block_hash is not None
    }


def mirrored(mirror: Mirror) -> dict[bytes, tuple[bytes | None, tuple[int, ...]]]:
    return {block_hash: (event.parent_hash, event.token_ids) for block_hash, event in mirror.blocks.items()}


@pytest.fixture
def manager():
    manager = init_continuous_batching(
        tiny_model("llama"),
        continuous_batching_config=ContinuousBatchingConfig(
            page_size=PAGE_SIZE, num_blocks=24, max_batch_tokens=64
        ),
    )
    yield manager
    manager.destroy()


def _run(manager, prompts: list[list[int]], max_new_tokens: int = 3) -> None:
    ids = [manager.add_request(prompt, max_new_tokens=max_new_tokens, eos_token_id=[]) for prompt in prompts]
    for request_id in ids:
        assert manager.get_result(request_id, timeout=TIMEOUT).status == RequestStatus.FINISHED


def test_stored_blocks_carry_their_tokens_and_chain_to_their_parent(manager) -> None:
    mirror = Mirror()
    manager.add_kv_event_listener(mirror)
    manager.start()
    prompt = random_prompt(3 * PAGE_SIZE + 1, seed=1)
    _run(manager, [prompt])
    stored = [event for event in mirror.events if isinstance(event, BlockStored)]
    prompt_pages = [tuple(prompt[index * PAGE_SIZE : (index + 1) * PAGE_SIZE]) for index in range(3)]
    assert [event.token_ids for event in stored[:3]] == prompt_pages, [event.token_ids for event in stored]
    assert stored[0].parent_hash is None
    for parent, child in itertools.pairwise(stored):
        assert child.parent_hash == parent.block_hash
    expected_hashes: list[bytes] = []
    extend_block_hashes(expected_hashes, prompt, PAGE_SIZE, manager.weight_version)
    assert [event.block_hash for event in stored[:3]] == expected_hashes


def test_the_mirror_equals_the_cache_after_evictions_and_a_flush(manager) -> None:
    """24 blocks of 4 tokens: these prompts cannot all stay cached, so blocks are evicted and reused."""
    mirror = Mirror()
    manager.add_kv_event_listener(mirror)
    manager.start()
    shared = random_prompt(2 * PAGE_SIZE, seed=2)
    for round_index in range(4):
        prompts = [shared + random_prompt(3 * PAGE_SIZE, seed=10 * round_index + index) for index in range(3)]
        _run(manager, prompts)
    with manager.pause():  # the loop is parked between steps: the cache and the mirror are at rest
        pool = engine_core(manager).kv_cache_manager.block_pool
        assert any(isinstance(event, BlockRemoved) for event in mirror.events), "nothing was evicted"
        assert mirrored(mirror) == cached_blocks(pool)
    manager.reset_prefix_cache()
    with manager.pause():
        assert isinstance(mirror.events[-1], AllBlocksCleared)
        assert mirror.blocks == {} and cached_blocks(pool) == {}


def test_reset_prefix_cache_returns_the_number_of_blocks_dropped(manager) -> None:
    manager.start()
    _run(manager, [random_prompt(4 * PAGE_SIZE, seed=3)])
    with manager.pause():
        num_cached = len(cached_blocks(engine_core(manager).kv_cache_manager.block_pool))
    assert num_cached >= 4
    assert manager.reset_prefix_cache().num_blocks == num_cached
    assert manager.reset_prefix_cache().num_blocks == 0


def test_reset_prefix_cache_is_refused_with_a_request_in_flight_unless_it_aborts_them(manager) -> None:
    manager.start()
    _run(manager, [random_prompt(4 * PAGE_SIZE, seed=5)])
    pool = engine_core(manager).kv_cache_manager.block_pool
    with manager.pause():  # the request below stays queued while the pause holds
        num_cached = len(cached_blocks(pool))
        request_id = manager.add_request(random_prompt(8, seed=6), max_new_tokens=3, eos_token_id=[])
        with pytest.raises(EngineBusyError, match=r"requests in flight \(1 queued or running\).*abort"):
            manager.reset_prefix_cache()
        assert len(cached_blocks(pool)) == num_cached, "a refused reset drops nothing"
        reset = manager.reset_prefix_cache(abort=True)
    assert reset == PrefixCacheReset(num_blocks=num_cached, num_aborted=1)
    assert manager.get_result(request_id, timeout=TIMEOUT).status == RequestStatus.CANCELLED
    _run(manager, [random_prompt(8, seed=7)])  # and the engine serves on


def test_without_a_listener_nothing_is_recorded(manager) -> None:
    manager.start()
    _run(manager, [random_prompt(3 * PAGE_SIZE, seed=4)])
    assert engine_core(manager).take_kv_events() == []


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["allocate", "free", "cache", "reset"]), st.integers(0, 6)),
        min_size=1,
        max_size=60,
    )
)
def test_any_sequence_of_pool_operations_leaves_the_mirror_equal_to_the_cache(
    operations: list[tuple[str, int]],
) -> None:
    pool = BlockPool(8)
    pool.events.enabled = True
    mirror = Mirror()
    held: list = []
    counter = 0
    for operation, amount in operations:
        if operation == "allocate" and 0 < amount <= pool.num_free_blocks:
            held.extend(pool.allocate(amount))
        elif operation == "free" and held:
            pool.free([held.pop(amount % len(held))])
        elif operation == "cache" and held:
            block = held[amount % len(held)]
            counter += 1
            tokens = (counter,) * PAGE_SIZE
            pool.cache_block(block, counter.to_bytes(8, "big"), None, tokens)
        elif operation == "reset":
            pool.reset_prefix_cache()
        mirror(pool.events.take())
        assert mirrored(mirror) == cached_blocks(pool)
