"""Spec of `BlockPool`: block ids, reference counts, the free queue and the prefix-cache map.

No model and no tensors: the pool only hands out block ids.
"""

from __future__ import annotations

import pytest

from engine.kv.block_pool import NULL_BLOCK_ID, BlockPool, FreeBlockQueue, KVBlock
from engine.kv.cache_manager import KVCacheManager
from engine.kv.prefix_hash import chain_root, hash_block
from engine.request import FIRST_WEIGHT_VERSION, Request
from engine.sampling.params import SamplingParams


def ids(blocks: list[KVBlock]) -> list[int]:
    return [block.block_id for block in blocks]


def cache(pool: BlockPool, block: KVBlock, tokens: tuple[int, ...], parent: bytes | None = None) -> bytes:
    """Registers `block` as holding `tokens` after `parent` (None: a first block); returns its hash."""
    block_hash = hash_block(parent or chain_root(FIRST_WEIGHT_VERSION), tokens)
    pool.cache_block(block, block_hash, parent, tokens)
    return block_hash


# --- construction and the null block -------------------------------------------------------------


@pytest.mark.parametrize("num_blocks", [-1, 0, 1])
def test_pool_needs_at_least_one_block_besides_the_null_block(num_blocks: int) -> None:
    with pytest.raises(ValueError, match=r"num_blocks must be >= 2"):
        BlockPool(num_blocks)


def test_new_pool_has_every_block_but_the_null_block_free_in_id_order() -> None:
    pool = BlockPool(6)
    assert pool.num_usable_blocks == 5
    assert pool.num_free_blocks == 5
    assert pool.num_used_blocks == 0
    assert pool.free_queue.block_ids() == [1, 2, 3, 4, 5]
    assert NULL_BLOCK_ID == 0


def test_null_block_is_never_allocated_even_when_the_pool_is_drained() -> None:
    pool = BlockPool(5)
    allocated = pool.allocate(4)
    assert NULL_BLOCK_ID not in ids(allocated), f"null block handed out: {ids(allocated)}"
    assert pool.blocks[NULL_BLOCK_ID].ref_count == 0
    assert pool.num_free_blocks == 0
    with pytest.raises(ValueError, match=r"asked for 1 blocks, only 0 free"):
        pool.allocate(1)


def test_null_block_stays_out_of_the_free_queue_after_frees() -> None:
    pool = BlockPool(4)
    pool.free(pool.allocate(3))
    assert NULL_BLOCK_ID not in pool.free_queue.block_ids()
    assert pool.blocks[NULL_BLOCK_ID].prev_free is None and pool.blocks[NULL_BLOCK_ID].next_free is None


# --- allocation order and reference counts -------------------------------------------------------


def test_allocate_hands_out_block_ids_in_order_starting_at_one() -> None:
    pool = BlockPool(8)
    assert ids(pool.allocate(1)) == [1]
    assert ids(pool.allocate(3)) == [2, 3, 4]
    assert ids(pool.allocate(2)) == [5, 6]
    assert pool.free_queue.block_ids() == [7]


def test_allocate_zero_blocks_returns_nothing_and_changes_nothing() -> None:
    pool = BlockPool(4)
    assert pool.allocate(0) == []
    assert pool.free_queue.block_ids() == [1, 2, 3]


def test_allocate_more_than_free_raises_and_takes_nothing() -> None:
    pool = BlockPool(4)
    pool.allocate(1)
    with pytest.raises(ValueError, match=r"asked for 3 blocks, only 2 free"):
        pool.allocate(3)
    assert pool.free_queue.block_ids() == [2, 3]
    assert [block.ref_count for block in pool.blocks] == [0, 1, 0, 0]


def test_allocated_blocks_have_ref_count_one() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    assert [block.ref_count for block in blocks] == [1, 1]
    assert pool.num_used_blocks == 2


def test_touch_adds_a_reference_and_free_drops_one() -> None:
    pool = BlockPool(4)
    [block] = pool.allocate(1)
    pool.touch([block])
    assert block.ref_count == 2
    pool.free([block])
    assert block.ref_count == 1
    assert block.block_id not in pool.free_queue.block_ids(), "a block still referenced must not be free"
    pool.free([block])
    assert block.ref_count == 0
    assert pool.free_queue.block_ids() == [1, 2, 3]


def test_double_free_raises() -> None:
    pool = BlockPool(4)
    [block] = pool.allocate(1)
    pool.free([block])
    with pytest.raises(RuntimeError, match=r"double free of KVBlock\(id=1"):
        pool.free([block])
    assert pool.free_queue.block_ids() == [1, 2, 3], "a rejected free must not touch the queue"


def test_freeing_a_never_allocated_block_is_a_double_free() -> None:
    pool = BlockPool(4)
    with pytest.raises(RuntimeError, match=r"double free"):
        pool.free([pool.blocks[2]])


# --- the free queue ------------------------------------------------------------------------------


def test_freed_blocks_without_a_prefix_join_the_head_of_the_free_queue() -> None:
    """Reused first, before blocks the process never wrote: their memory is already mapped."""
    pool = BlockPool(6)
    blocks = {block.block_id: block for block in pool.allocate(4)}
    assert pool.free_queue.block_ids() == [5]
    pool.free([blocks[3], blocks[1]])
    assert pool.free_queue.block_ids() == [1, 3, 5]
    pool.free([blocks[4], blocks[2]])
    assert pool.free_queue.block_ids() == [2, 4, 1, 3, 5]


def test_allocate_reuses_the_most_recently_freed_block_without_a_prefix_first() -> None:
    pool = BlockPool(6)
    blocks = {block.block_id: block for block in pool.allocate(4)}
    pool.free([blocks[4], blocks[2], blocks[3]])
    assert ids(pool.allocate(2)) == [3, 2]
    assert pool.free_queue.block_ids() == [4, 5]


def test_freed_blocks_holding_a_prefix_join_the_tail_behind_never_used_blocks() -> None:
    pool = BlockPool(6)
    first, second = pool.allocate(2)
    cache(pool, first, (1, 2))
    pool.free([second, first])
    assert pool.free_queue.block_ids() == [2, 3, 4, 5, 1], "a cached prefix is evicted last"
    assert ids(pool.allocate(4)) == [2, 3, 4, 5]
    assert first.block_hash is not None, "taking the blocks before it must not evict it"


def test_cache_manager_frees_a_request_table_tail_first() -> None:
    manager = KVCacheManager(num_blocks=6, page_size=4, enable_prefix_caching=True)
    request = Request("r", list(range(10)), SamplingParams(max_new_tokens=1))
    assert ids(manager.allocate_slots(request, 10) or []) == [1, 2, 3]
    manager.free(request)
    got = manager.block_pool.free_queue.block_ids()
    # Blocks 1 and 2 are full and cached: they join the tail, the last block (3) first. Block 3 holds
    # two tokens, no prefix: it goes to the head.
    assert got == [3, 4, 5, 2, 1], f"the table [1, 2, 3] should be freed tail first, free queue is {got}"


def test_free_queue_remove_unlinks_a_block_from_the_middle() -> None:
    blocks = [KVBlock(block_id) for block_id in range(1, 5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[1])
    assert queue.block_ids() == [1, 3, 4]
    assert queue.num_free_blocks == 3
    assert blocks[1].prev_free is None and blocks[1].next_free is None


def test_free_queue_rejects_removing_a_block_it_does_not_hold() -> None:
    queue = FreeBlockQueue([KVBlock(1)])
    with pytest.raises(ValueError, match=r"not in the free queue"):
        queue.remove(KVBlock(2))


def test_free_queue_popleft_on_empty_queue_raises_index_error() -> None:
    queue = FreeBlockQueue([])
    with pytest.raises(IndexError, match=r"no free KV block"):
        queue.popleft()


# --- the prefix cache ----------------------------------------------------------------------------


def test_cached_block_is_found_by_hash_parent_and_tokens() -> None:
    pool = BlockPool(4)
    first, second = pool.allocate(2)
    h1 = cache(pool, first, (1, 2))
    h2 = cache(pool, second, (3, 4), parent=h1)
    assert pool.lookup(h1, None, (1, 2)) is first
    assert pool.lookup(h2, h1, (3, 4)) is second
    assert pool.num_cached_blocks == 2


def test_lookup_rejects_a_hash_hit_whose_tokens_differ() -> None:
    """A hash collision: block registered under H for tokens A must not serve tokens B."""
    pool = BlockPool(4)
    [block] = pool.allocate(1)
    collided_hash = 12345
    pool.cache_block(block, collided_hash, None, (1, 2, 3))
    assert pool.lookup(collided_hash, None, (1, 2, 3)) is block
    got = pool.lookup(collided_hash, None, (9, 9, 9))
    assert got is None, f"lookup(H, None, B) served {got!r}, registered under H for tokens A"


def test_lookup_rejects_a_hash_hit_whose_parent_differs() -> None:
    pool = BlockPool(4)
    [block] = pool.allocate(1)
    pool.cache_block(block, 777, 111, (5, 6))
    assert pool.lookup(777, 111, (5, 6)) is block
    assert pool.lookup(777, 222, (5, 6)) is None
    assert pool.lookup(777, None, (5, 6)) is None


def test_lookup_of_an_unknown_hash_returns_none() -> None:
    pool = BlockPool(4)
    assert pool.lookup(42, None, (1,)) is None


def test_a_hash_already_registered_keeps_its_first_block() -> None:
    pool = BlockPool(4)
    first, second = pool.allocate(2)
    block_hash = cache(pool, first, (1, 2))
    cache(pool, second, (1, 2))
    assert pool.lookup(block_hash, None, (1, 2)) is first
    assert second.block_hash is None, "the second block must stay unregistered"
    assert pool.num_cached_blocks == 1


def test_a_registered_block_is_not_registered_again_under_another_hash() -> None:
    pool = BlockPool(4)
    [block] = pool.allocate(1)
    h1 = cache(pool, block, (1, 2))
    cache(pool, block, (3, 4))
    assert block.block_hash == h1
    assert pool.num_cached_blocks == 1


def test_freeing_a_cached_block_keeps_its_prefix() -> None:
    pool = BlockPool(4)
    [block] = pool.allocate(1)
    block_hash = cache(pool, block, (1, 2))
    pool.free([block])
    assert pool.lookup(block_hash, None, (1, 2)) is block
    assert block.block_hash == block_hash
    assert pool.num_cached_blocks == 1


def test_cached_free_blocks_are_evicted_one_at_a_time_least_recently_freed_first() -> None:
    pool = BlockPool(4)
    a, b, c = pool.allocate(3)
    ha, hb, hc = cache(pool, a, (1,)), cache(pool, b, (2,)), cache(pool, c, (3,))
    pool.free([b, c, a])
    assert pool.free_queue.block_ids() == [2, 3, 1]
    assert pool.num_cached_blocks == 3, "freeing must not evict"

    assert pool.allocate(1) == [b]
    assert b.block_hash is None
    assert pool.lookup(hb, None, (2,)) is None
    assert pool.lookup(hc, None, (3,)) is c, "only the popped block may be evicted"
    assert pool.lookup(ha, None, (1,)) is a
    assert pool.num_cached_blocks == 2

    assert pool.allocate(1) == [c]
    assert pool.lookup(hc, None, (3,)) is None
    assert pool.lookup(ha, None, (1,)) is a
    assert pool.num_cached_blocks == 1


def test_uncached_free_blocks_ahead_in_the_queue_are_reused_before_cached_ones_are_evicted() -> None:
    pool = BlockPool(5)
    [cached] = pool.allocate(1)
    block_hash = cache(pool, cached, (1,))
    pool.free([cached])
    assert pool.free_queue.block_ids() == [2, 3, 4, 1]
    assert ids(pool.allocate(3)) == [2, 3, 4]
    assert pool.lookup(block_hash, None, (1,)) is cached


def test_touching_a_free_cached_block_takes_it_out_of_the_middle_of_the_queue() -> None:
    pool = BlockPool(4)
    a, b, c = pool.allocate(3)
    hb = cache(pool, b, (2,))
    pool.free([a, b, c])
    assert pool.free_queue.block_ids() == [3, 1, 2]
    hit = pool.lookup(hb, None, (2,))
    assert hit is b
    pool.touch([hit])
    assert pool.free_queue.block_ids() == [3, 1]
    assert pool.num_free_blocks == 2
    assert b.ref_count == 1
    assert b.block_hash == hb, "a touched block keeps its prefix"
    assert ids(pool.allocate(2)) == [3, 1]


def test_touching_a_block_in_use_does_not_touch_the_queue() -> None:
    pool = BlockPool(4)
    [block] = pool.allocate(1)
    pool.touch([block, block])
    assert block.ref_count == 3
    assert pool.free_queue.block_ids() == [2, 3]


def test_reset_prefix_cache_forgets_every_prefix_but_keeps_blocks_and_queue() -> None:
    pool = BlockPool(5)
    a, b, c = pool.allocate(3)
    ha = cache(pool, a, (1,))
    hb = cache(pool, b, (2,), parent=ha)
    pool.free([b])
    queue_before = pool.free_queue.block_ids()
    pool.reset_prefix_cache()
    assert pool.num_cached_blocks == 0
    assert pool.lookup(ha, None, (1,)) is None
    assert pool.lookup(hb, ha, (2,)) is None
    for block in (a, b, c):
        assert (block.block_hash, block.parent_hash, block.token_ids) == (None, None, None), block
    assert pool.free_queue.block_ids() == queue_before
    assert [a.ref_count, b.ref_count, c.ref_count] == [1, 0, 1]


def test_a_block_can_be_registered_again_after_reset() -> None:
    pool = BlockPool(3)
    [block] = pool.allocate(1)
    cache(pool, block, (1,))
    pool.reset_prefix_cache()
    block_hash = cache(pool, block, (2,))
    assert pool.lookup(block_hash, None, (2,)) is block
