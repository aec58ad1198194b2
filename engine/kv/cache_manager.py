"""`KVCacheManager`: the scheduler's view of the KV cache, in blocks and tokens, never tensors."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.kv.block_pool import BlockPool, KVBlock
from engine.kv.prefix_hash import extend_block_hashes
from engine.request import Request


def blocks_for_tokens(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


@dataclass
class PrefixCacheStats:
    """Prompt tokens looked up in the prefix cache, and those served from it."""

    queried_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class KVCacheManager:
    """Owns each request's block table and the prefix cache.

    Block tables are append-only while a request holds them: a block's position in the table is the
    page of the sequence it stores, so token `t` of a request lives in slot
    `table[t // page_size] * page_size + t % page_size` of every layer's cache.
    """

    def __init__(self, num_blocks: int, page_size: int, enable_prefix_caching: bool) -> None:
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[KVBlock]] = {}
        # How many leading blocks of each request are registered in the prefix cache.
        self._num_registered_blocks: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def capacity_tokens(self) -> int:
        return self.block_pool.num_usable_blocks * self.page_size

    @property
    def free_fraction(self) -> float:
        return self.block_pool.num_free_blocks / self.block_pool.num_usable_blocks

    def block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.block_tables.get(request_id, ())]

    def get_computed_blocks(self, request: Request) -> list[KVBlock]:
        """The longest run of leading full blocks of `request` already in the prefix cache.

        The last token is never served from the cache: its forward pass produces the logits of the
        first new token.
        """
        if not self.enable_prefix_caching:
            return []
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.page_size)
        max_hit_blocks = (request.num_tokens - 1) // self.page_size
        hits: list[KVBlock] = []
        parent_hash: bytes | None = None
        for index in range(min(max_hit_blocks, len(request.block_hashes))):
            block_hash = request.block_hashes[index]
            start = index * self.page_size
            page = tuple(request.all_token_ids[start : start + self.page_size])
            block = self.block_pool.lookup(block_hash, parent_hash, page)
            if block is None:
                break
            hits.append(block)
            parent_hash = block_hash
        return hits

    def record_prefix_lookup(self, request: Request, num_hit_tokens: int) -> None:
        """Counts one admission's lookup; called once the request is actually admitted."""
        if self.enable_prefix_caching:
            self.prefix_cache_stats.queried_tokens += request.num_tokens
            self.prefix_cache_stats.hit_tokens += num_hit_tokens

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: Sequence[KVBlock] = ()
    ) -> list[KVBlock] | None:
        """Makes room for `num_new_tokens` more tokens of `request` after its computed ones.

        `computed_blocks` are prefix-cache hits for a request being admitted; they are appended to its
        (empty) table ahead of the new blocks. Returns the newly allocated blocks, or None — and
        changes nothing — when the pool cannot fit them.
        """
        table = self.block_tables.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.page_size
        num_required = blocks_for_tokens(num_computed + num_new_tokens, self.page_size)
        num_new_blocks = max(0, num_required - len(table) - len(computed_blocks))
        # Hits sitting in the free queue leave it when touched, so they are not free for new blocks.
        num_free_hits = sum(1 for block in computed_blocks if block.ref_count == 0)
        if num_new_blocks > self.block_pool.num_free_blocks - num_free_hits:
            if not table:
                del self.block_tables[request.request_id]
            return None
        self.block_pool.touch(computed_blocks)
        new_blocks = self.block_pool.allocate(num_new_blocks)
        table.extend(computed_blocks)
        table.extend(new_blocks)
        if self.enable_prefix_caching:
            self._register_full_blocks(request, table, num_computed + num_new_tokens)
        return new_blocks

    def free(self, request: Request) -> None:
        """Releases the request's blocks, tail first so its least shareable blocks are evicted first."""
        table = self.block_tables.pop(request.request_id, None)
        self._num_registered_blocks.pop(request.request_id, None)
        if table:
            self.block_pool.free(reversed(table))

    def reset_prefix_cache(self) -> None:
        """Forgets every cached prefix. Blocks that live requests hold now are never registered
        again: their KV may predate the event that made the cache stale (a weight update)."""
        self.block_pool.reset_prefix_cache()
        for request_id, table in self.block_tables.items():
            self._num_registered_blocks[request_id] = len(table)

    def _register_full_blocks(
        self, request: Request, table: list[KVBlock], num_tokens_after_step: int
    ) -> None:
        # A block is registered once this step fills it. Attention writes every new token of a step
        # before any request reads the cache, so a request admitted later in the same step may
        # already share it.
        num_full = min(num_tokens_after_step, request.num_tokens) // self.page_size
        start = self._num_registered_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.page_size)
        for index in range(start, num_full):
            parent_hash = request.block_hashes[index - 1] if index else None
            if index and table[index - 1].block_hash != parent_hash:
                # Another block owns the parent's hash (this request computed the same page twice, or
                # the registration was refused): a lookup reaching this block through that owner
                # would be trusting KV computed after a block it never checked. Register no further.
                num_full = index
                break
            page = tuple(request.all_token_ids[index * self.page_size : (index + 1) * self.page_size])
            self.block_pool.cache_block(table[index], request.block_hashes[index], parent_hash, page)
        self._num_registered_blocks[request.request_id] = num_full
