"""Spec of `KVCacheManager`: block tables, slot allocation and prefix-cache hits, without tensors."""

from __future__ import annotations

import pytest

import engine.kv.prefix_hash as prefix_hash
from engine.kv.block_pool import KVBlock
from engine.kv.cache_manager import KVCacheManager, PrefixCacheStats, blocks_for_tokens
from engine.request import Request
from engine.sampling.params import SamplingParams


def make_request(request_id: str, prompt: list[int], max_new_tokens: int = 4) -> Request:
    return Request(request_id, prompt, SamplingParams(max_new_tokens=max_new_tokens))


def ids(blocks: list[KVBlock] | None) -> list[int]:
    assert blocks is not None, "allocate_slots returned None"
    return [block.block_id for block in blocks]


def prefill(manager: KVCacheManager, request: Request) -> list[int]:
    """Allocates and 'computes' the whole prompt of `request`, as one step would."""
    new_blocks = manager.allocate_slots(request, request.num_tokens)
    request.num_computed_tokens = request.num_tokens
    return ids(new_blocks)


def pool_snapshot(manager: KVCacheManager) -> tuple:
    pool = manager.block_pool
    return (
        pool.free_queue.block_ids(),
        [block.ref_count for block in pool.blocks],
        [block.block_hash for block in pool.blocks],
        dict(manager.block_tables),
    )


# --- allocate_slots ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tokens", "page_size", "expected"),
    [(0, 4, 0), (1, 4, 1), (4, 4, 1), (5, 4, 2), (16, 16, 1), (17, 16, 2), (33, 16, 3)],
)
def test_blocks_for_tokens_rounds_up(tokens: int, page_size: int, expected: int) -> None:
    assert blocks_for_tokens(tokens, page_size) == expected


@pytest.mark.parametrize(
    ("page_size", "num_computed", "num_new", "expected_new_blocks"),
    [
        (4, 0, 1, 1),
        (4, 0, 4, 1),
        (4, 0, 5, 2),
        (4, 0, 12, 3),
        (16, 0, 16, 1),
        (16, 0, 17, 2),
        (4, 3, 1, 0),  # fills the last slot of the first block
        (4, 4, 1, 1),  # first token of a new block
        (4, 5, 3, 0),  # fits in the partly filled second block
        (4, 5, 4, 1),
        (4, 2, 11, 3),
        (8, 7, 10, 2),
    ],
)
def test_allocate_slots_allocates_just_the_blocks_the_new_tokens_need(
    page_size: int, num_computed: int, num_new: int, expected_new_blocks: int
) -> None:
    manager = KVCacheManager(num_blocks=32, page_size=page_size, enable_prefix_caching=True)
    request = make_request("r", list(range(100, 100 + num_computed + num_new)))
    if num_computed:
        manager.allocate_slots(request, num_computed)
        request.num_computed_tokens = num_computed
    new_blocks = manager.allocate_slots(request, num_new)
    assert new_blocks is not None
    assert len(new_blocks) == expected_new_blocks, (
        f"computed={num_computed} new={num_new} page={page_size}: "
        f"got {len(new_blocks)} new blocks, expected {expected_new_blocks}"
    )
    table_len = len(manager.block_ids("r"))
    assert table_len == blocks_for_tokens(num_computed + num_new, page_size)


def test_allocate_slots_appends_to_the_table_in_order() -> None:
    manager = KVCacheManager(num_blocks=8, page_size=4, enable_prefix_caching=False)
    request = make_request("r", list(range(9)))
    assert ids(manager.allocate_slots(request, 6)) == [1, 2]
    request.num_computed_tokens = 6
    assert ids(manager.allocate_slots(request, 3)) == [3]
    assert manager.block_ids("r") == [1, 2, 3]


def test_allocate_slots_with_computed_blocks_puts_them_ahead_of_new_blocks() -> None:
    manager = KVCacheManager(num_blocks=10, page_size=4, enable_prefix_caching=True)
    first = make_request("a", list(range(12)))
    prefill(manager, first)  # blocks 1, 2, 3
    second = make_request("b", [*range(8), 50, 51, 52, 53, 54])
    hits = manager.get_computed_blocks(second)
    assert ids(hits) == [1, 2]
    new_blocks = manager.allocate_slots(second, second.num_tokens - 8, hits)
    assert ids(new_blocks) == [4, 5], "13 tokens, 8 of them hit: 2 new blocks"
    assert manager.block_ids("b") == [1, 2, 4, 5]
    assert [manager.block_pool.blocks[i].ref_count for i in (1, 2, 3)] == [2, 2, 1]


def test_allocate_slots_returns_none_and_changes_nothing_when_the_pool_is_short() -> None:
    manager = KVCacheManager(num_blocks=5, page_size=4, enable_prefix_caching=True)
    holder = make_request("holder", list(range(12)))
    prefill(manager, holder)  # 3 of 4 usable blocks
    before = pool_snapshot(manager)
    request = make_request("big", list(range(50, 58)))
    assert manager.allocate_slots(request, 8) is None, "needs 2 blocks, 1 free"
    assert pool_snapshot(manager) == before
    assert "big" not in manager.block_tables, "a failed first allocation must not leave an empty table"
    assert manager.block_pool.num_free_blocks == 1


def test_allocate_slots_that_cannot_grow_a_running_request_keeps_its_table() -> None:
    manager = KVCacheManager(num_blocks=4, page_size=4, enable_prefix_caching=False)
    request = make_request("r", list(range(16)))
    manager.allocate_slots(request, 12)  # all 3 usable blocks
    request.num_computed_tokens = 12
    before = pool_snapshot(manager)
    assert manager.allocate_slots(request, 1) is None
    assert pool_snapshot(manager) == before
    assert manager.block_ids("r") == [1, 2, 3]


def test_free_prefix_hits_do_not_count_as_free_room_for_new_blocks() -> None:
    """Touching a hit that sits in the free queue takes it out: it cannot also serve as a new block."""
    manager = KVCacheManager(num_blocks=5, page_size=4, enable_prefix_caching=True)
    first = make_request("a", list(range(12)))
    prefill(manager, first)
    manager.free(first)  # 4 free blocks, 3 of them cached
    second = make_request("b", list(range(20)))
    hits = manager.get_computed_blocks(second)
    assert ids(hits) == [1, 2, 3]
    before = pool_snapshot(manager)
    got = manager.allocate_slots(second, 8, hits)
    assert got is None, f"needs 3 hits + 2 new blocks of 4 free, got {got}"
    assert pool_snapshot(manager) == before
    assert "b" not in manager.block_tables


def test_free_prefix_hits_fit_when_the_rest_of_the_pool_has_room() -> None:
    manager = KVCacheManager(num_blocks=5, page_size=4, enable_prefix_caching=True)
    first = make_request("a", list(range(12)))
    prefill(manager, first)
    manager.free(first)
    second = make_request("b", list(range(16)))
    hits = manager.get_computed_blocks(second)
    assert ids(manager.allocate_slots(second, 4, hits)) == [4]
    assert manager.block_ids("b") == [1, 2, 3, 4]
    assert manager.block_pool.num_free_blocks == 0


def test_free_releases_the_table_and_is_a_no_op_for_an_unknown_request() -> None:
    manager = KVCacheManager(num_blocks=5, page_size=4, enable_prefix_caching=True)
    request = make_request("r", list(range(6)))
    prefill(manager, request)
    manager.free(request)
    assert "r" not in manager.block_tables
    assert manager.block_pool.num_free_blocks == 4
    manager.free(request)  # nothing left to free: must not raise a double free
    assert manager.block_pool.num_free_blocks == 4


def test_capacity_and_free_fraction() -> None:
    manager = KVCacheManager(num_blocks=9, page_size=16, enable_prefix_caching=False)
    assert manager.capacity_tokens == 8 * 16
    assert manager.free_fraction == 1.0
    prefill(manager, make_request("r", list(range(32))))
    assert manager.free_fraction == pytest.approx(6 / 8)


# --- prefix-cache hits ---------------------------------------------------------------------------


def test_second_request_with_a_shared_prefix_gets_the_first_requests_blocks() -> None:
    manager = KVCacheManager(num_blocks=16, page_size=4, enable_prefix_caching=True)
    shared = list(range(100, 116))  # 4 full blocks
    first = make_request("a", [*shared, 1, 2, 3])
    first_blocks = prefill(manager, first)
    second = make_request("b", [*shared, 7, 8])
    hits = manager.get_computed_blocks(second)
    assert ids(hits) == first_blocks[:4], f"hits {ids(hits)}, first request's table {first_blocks}"


def test_prefix_hits_stop_at_the_first_differing_block() -> None:
    manager = KVCacheManager(num_blocks=16, page_size=4, enable_prefix_caching=True)
    prompt = list(range(100, 116))
    prefill(manager, make_request("a", [*prompt, 0]))
    diverged = list(prompt)
    diverged[9] = 999  # third block differs
    hits = manager.get_computed_blocks(make_request("b", [*diverged, 0]))
    assert ids(hits) == [1, 2], f"expected hits up to the differing block, got {ids(hits)}"


def test_a_later_block_matching_after_a_miss_is_not_a_hit() -> None:
    """Hashes chain on the parent: the same page after a different prefix is a different block."""
    manager = KVCacheManager(num_blocks=16, page_size=4, enable_prefix_caching=True)
    prefill(manager, make_request("a", [1, 1, 1, 1, 2, 2, 2, 2, 0]))
    hits = manager.get_computed_blocks(make_request("b", [3, 3, 3, 3, 2, 2, 2, 2, 0]))
    assert hits == []


def test_prefix_hits_never_cover_the_last_prompt_token() -> None:
    manager = KVCacheManager(num_blocks=16, page_size=4, enable_prefix_caching=True)
    prompt = list(range(100, 112))  # exactly 3 blocks
    prefill(manager, make_request("a", prompt))
    hits = manager.get_computed_blocks(make_request("b", list(prompt)))
    assert ids(hits) == [1, 2], (
        f"a 12-token prompt (3 pages of 4) may hit 2 blocks, not its last one; got {ids(hits)}"
    )
    one_more = manager.get_computed_blocks(make_request("c", [*prompt, 5]))
    assert ids(one_more) == [1, 2, 3]


def test_a_single_page_prompt_gets_no_hit() -> None:
    manager = KVCacheManager(num_blocks=8, page_size=4, enable_prefix_caching=True)
    prefill(manager, make_request("a", [1, 2, 3, 4]))
    assert manager.get_computed_blocks(make_request("b", [1, 2, 3, 4])) == []


def test_only_full_blocks_are_registered() -> None:
    manager = KVCacheManager(num_blocks=8, page_size=4, enable_prefix_caching=True)
    prefill(manager, make_request("a", list(range(10))))
    assert manager.block_pool.num_cached_blocks == 2, "10 tokens = 2 full blocks + 2 tokens"
    hits = manager.get_computed_blocks(make_request("b", list(range(20))))
    assert ids(hits) == [1, 2]


def test_a_chunk_registers_only_the_blocks_it_fills() -> None:
    manager = KVCacheManager(num_blocks=8, page_size=4, enable_prefix_caching=True)
    request = make_request("a", list(range(12)))
    manager.allocate_slots(request, 6)
    assert manager.block_pool.num_cached_blocks == 1
    request.num_computed_tokens = 6
    manager.allocate_slots(request, 6)
    assert manager.block_pool.num_cached_blocks == 3


def test_a_decode_step_registers_the_block_it_fills() -> None:
    manager = KVCacheManager(num_blocks=8, page_size=4, enable_prefix_caching=True)
    request = make_request("a", list(range(6)))
    prefill(manager, request)
    request.all_token_ids.append(50)  # sampled token 7
    manager.allocate_slots(request, 1)
    request.num_computed_tokens = 7
    assert manager.block_pool.num_cached_blocks == 1
    request.all_token_ids.append(51)  # sampled token 8 fills block 2
    manager.allocate_slots(request, 1)
    assert manager.block_pool.num_cached_blocks == 2
    hits = manager.get_computed_blocks(make_request("b", [*range(6), 50, 51, 9]))
    assert ids(hits) == [1, 2], "generated tokens are shareable prefix too"


def test_hits_on_blocks_registered_in_the_same_step_by_another_request() -> None:
    """Blocks are registered at allocation: a request admitted later in the same step shares them."""
    manager = KVCacheManager(num_blocks=16, page_size=4, enable_prefix_caching=True)
    first = make_request("a", list(range(13)))
    first_blocks = ids(manager.allocate_slots(first, 13))  # scheduled, not yet computed
    second = make_request("b", [*range(12), 77, 78])
    hits = manager.get_computed_blocks(second)
    assert ids(hits) == first_blocks[:3]


def test_prefix_cache_stats_count_queried_and_hit_tokens_per_recorded_admission() -> None:
    manager = KVCacheManager(num_blocks=16, page_size=4, enable_prefix_caching=True)
    first = make_request("a", list(range(12)))
    assert manager.get_computed_blocks(first) == []
    manager.record_prefix_lookup(first, 0)
    prefill(manager, first)
    second = make_request("b", [*range(8), 60, 61, 62, 63, 64, 65])
    hits = manager.get_computed_blocks(second)
    manager.record_prefix_lookup(second, len(hits) * manager.page_size)
    stats = manager.prefix_cache_stats
    assert (stats.queried_tokens, stats.hit_tokens) == (12 + 14, 8)
    assert stats.hit_rate == pytest.approx(8 / 26)


def test_hit_rate_of_no_lookups_is_zero() -> None:
    assert PrefixCacheStats().hit_rate == 0.0


def test_no_hits_and_no_stats_with_prefix_caching_disabled() -> None:
    manager = KVCacheManager(num_blocks=16, page_size=4, enable_prefix_caching=False)
    prompt = list(range(20))
    prefill(manager, make_request("a", prompt))
    second = make_request("b", list(prompt))
    assert manager.get_computed_blocks(second) == []
    manager.record_prefix_lookup(second, 0)
    assert manager.prefix_cache_stats == PrefixCacheStats(0, 0)
    assert manager.block_pool.num_cached_blocks == 0


def test_freed_blocks_stay_reusable_hits_until_evicted() -> None:
    manager = KVCacheManager(num_blocks=6, page_size=4, enable_prefix_caching=True)
    prompt = list(range(100, 112))
    first = make_request("a", [*prompt, 1])
    first_blocks = prefill(manager, first)  # [1, 2, 3, 4]
    manager.free(first)
    assert manager.block_pool.free_queue.block_ids() == [4, 5, 3, 2, 1]

    hits = manager.get_computed_blocks(make_request("b", [*prompt, 2]))
    assert ids(hits) == first_blocks[:3], "freed blocks must still be hits"
    assert all(block.ref_count == 0 for block in hits)

    # Block 4 (the partial one, never cached) is reused first; taking 4, 5 and 3 evicts 3 (the third page).
    filler = make_request("filler", list(range(500, 512)))
    assert ids(manager.allocate_slots(filler, 12)) == [4, 5, 3]
    hits = manager.get_computed_blocks(make_request("c", [*prompt, 2]))
    assert ids(hits) == [1, 2], f"after evicting block 3, hits are {ids(hits)}"


def test_a_freed_hit_is_taken_back_out_of_the_free_queue() -> None:
    manager = KVCacheManager(num_blocks=6, page_size=4, enable_prefix_caching=True)
    first = make_request("a", list(range(9)))
    prefill(manager, first)  # [1, 2, 3]
    manager.free(first)
    second = make_request("b", [*range(8), 40, 41])
    hits = manager.get_computed_blocks(second)
    manager.allocate_slots(second, 2, hits)
    assert manager.block_ids("b") == [1, 2, 3], "a's partial block 3 (no prefix) is reused first"
    assert manager.block_pool.free_queue.block_ids() == [4, 5]


def test_reset_prefix_cache_drops_every_hit() -> None:
    manager = KVCacheManager(num_blocks=8, page_size=4, enable_prefix_caching=True)
    prefill(manager, make_request("a", list(range(13))))
    manager.reset_prefix_cache()
    assert manager.block_pool.num_cached_blocks == 0
    assert manager.get_computed_blocks(make_request("b", list(range(13)))) == []


def test_blocks_held_at_reset_and_the_blocks_chained_after_them_are_never_registered() -> None:
    """A later block's chain runs through a block the cache no longer knows: no lookup could reach it."""
    manager = KVCacheManager(num_blocks=8, page_size=4, enable_prefix_caching=True)
    request = make_request("a", list(range(6)))
    prefill(manager, request)  # block 1 full, block 2 half full
    manager.reset_prefix_cache()
    request.all_token_ids.extend([50, 51])
    manager.allocate_slots(request, 2)  # fills block 2
    request.num_computed_tokens = 8
    assert manager.block_pool.num_cached_blocks == 0, "block 2 was held at reset: never registered"
    request.all_token_ids.extend([52, 53, 54, 55])
    assert ids(manager.allocate_slots(request, 4)) == [3]
    assert manager.block_pool.num_cached_blocks == 0
    assert manager.block_pool.blocks[3].block_hash is None


def test_a_hash_collision_in_an_earlier_page_never_serves_a_block_computed_after_another_prefix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The lookup re-check must cover the whole prefix, not only the page's own tokens and parent hash.

    With a hash where pages (1, 2) and (2, 1) collide: y registers page (1, 2); x, whose first page
    (2, 1) collides and so stays unregistered, registers its second page (5, 5) under parent hash h0.
    z = (1, 2) + (5, 5) must hit y's first block only: x's second block holds KV computed after (2, 1).
    (CPython's own tuple hash has such pairs too, e.g. pages (1, 2) and (5, 1678395250935405368).)
    """
    monkeypatch.setattr(
        prefix_hash, "hash_block", lambda parent, tokens: hash((parent, tuple(sorted(tokens))))
    )
    manager = KVCacheManager(num_blocks=16, page_size=2, enable_prefix_caching=True)
    y = make_request("y", [1, 2, 7])
    prefill(manager, y)
    x = make_request("x", [2, 1, 5, 5, 9])
    assert manager.get_computed_blocks(x) == [], "the lookup re-check rejects x's colliding first page"
    prefill(manager, x)
    assert manager.block_ids("y")[0] == 1 and manager.block_ids("x")[1] == 4
    hits = manager.get_computed_blocks(make_request("z", [1, 2, 5, 5, 9]))
    assert ids(hits) == [1], (
        f"z = (1, 2)(5, 5) got hits {ids(hits)}; block 4 is x's page (5, 5), computed after (2, 1)"
    )


def test_the_prefix_cache_is_keyed_by_weight_version() -> None:
    """After new weights, the same prompt is another chain of blocks: a request hashed under the old
    version (queued before the update) finds nothing of the old weights' KV, even a block the cache
    still held, and blocks computed under the new version are shared under it."""
    manager = KVCacheManager(num_blocks=16, page_size=2, enable_prefix_caching=True)
    prompt = [1, 2, 3, 4, 5]
    old = make_request("old", prompt)
    prefill(manager, old)
    queued = make_request("queued", prompt)
    assert len(manager.get_computed_blocks(queued)) == 2
    old_chain = list(queued.block_hashes)
    full = manager.full_attention_group
    assert full is not None
    full.weight_version = 2  # the key alone moves on: the old blocks are still registered
    assert manager.get_computed_blocks(queued) == [], "a lookup under version 2 hit version 1's KV"
    assert queued.block_hashes_weight_version == 2 and queued.block_hashes != old_chain
    manager.free(old)
    manager.begin_weight_version(3)
    first = make_request("first", prompt)
    prefill(manager, first)
    assert ids(manager.get_computed_blocks(make_request("second", prompt))) == manager.block_ids("first")[:2]
