"""`FullAttentionManager`: the block tables of a full-attention group, which keep every token, and its
prefix cache."""

from __future__ import annotations

from collections.abc import Sequence

from engine.kv.block_pool import BlockPool, KVBlock
from engine.kv.prefix_hash import extend_block_hashes
from engine.request import FIRST_WEIGHT_VERSION, Request


def blocks_for_tokens(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


class FullAttentionManager:
    """Owns each request's block table in one full-attention group, and that group's prefix cache.

    Block tables are append-only while a request holds them: a block's position in the table is the
    page of the sequence it stores, so token `t` of a request lives in slot
    `table[t // page_size] * page_size + t % page_size` of every layer of the group.

    Invariant: `_block_ids[r]` is `[block.block_id for block in block_tables[r]]`, kept as the table
    grows, so a step hands the runner each table's ids without building them again (`block_ids`).

    The prefix cache is keyed by the weight version its KV was computed under (`weight_version`, moved
    on by `begin_weight_version`): lookups and registrations hash under the current version only.
    """

    def __init__(self, num_blocks: int, page_size: int, enable_prefix_caching: bool) -> None:
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks)
        self.weight_version = FIRST_WEIGHT_VERSION
        self.block_tables: dict[str, list[KVBlock]] = {}
        self._block_ids: dict[str, list[int]] = {}
        # How many leading blocks of each request are registered in the prefix cache.
        self._num_registered_blocks: dict[str, int] = {}

    def block_ids(self, request_id: str) -> list[int]:
        """The ids of the request's table: the manager's own list, which grows with the table (read it,
        never change it); empty when the request holds none."""
        return self._block_ids.get(request_id, [])

    def resume_pages(self, num_tokens: int) -> range:
        """Pages whose KV a request with `num_tokens` computed tokens reads again: all of them."""
        return range(blocks_for_tokens(num_tokens, self.page_size))

    def get_computed_blocks(self, request: Request) -> list[KVBlock]:
        """The longest run of leading full blocks of `request` already in the prefix cache.

        The last token is never served from the cache: its forward pass produces the logits of the
        first new token.
        """
        if not self.enable_prefix_caching:
            return []
        self._extend_block_hashes(request)
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

    def can_allocate(
        self, request_id: str, num_computed: int, num_new_tokens: int, computed_blocks: Sequence[KVBlock]
    ) -> bool:
        """Whether `allocate` with the same arguments would find enough free blocks."""
        num_new_blocks = self._num_new_blocks(request_id, num_computed, num_new_tokens, computed_blocks)
        # Hits sitting in the free queue leave it when touched, so they are not free for new blocks.
        num_free_hits = sum(1 for block in computed_blocks if block.ref_count == 0)
        return num_new_blocks <= self.block_pool.num_free_blocks - num_free_hits

    def allocate(
        self, request: Request, num_computed: int, num_new_tokens: int, computed_blocks: Sequence[KVBlock]
    ) -> list[KVBlock]:
        """Extends the table to cover tokens [0, num_computed + num_new_tokens); `computed_blocks` are
        prefix-cache hits for a request being admitted, appended to its (empty) table first. The caller
        has checked `can_allocate`. Returns the newly allocated blocks."""
        num_new_blocks = self._num_new_blocks(
            request.request_id, num_computed, num_new_tokens, computed_blocks
        )
        table = self.block_tables.setdefault(request.request_id, [])
        block_ids = self._block_ids.setdefault(request.request_id, [])
        self.block_pool.touch(computed_blocks)
        new_blocks = self.block_pool.allocate(num_new_blocks)
        for block in (*computed_blocks, *new_blocks):
            table.append(block)
            block_ids.append(block.block_id)
        if self.enable_prefix_caching:
            self._register_full_blocks(request, table, num_computed + num_new_tokens)
        return new_blocks

    def num_fork_blocks(self, num_tokens: int) -> int:
        """Blocks a sequence forked at `num_tokens` tokens takes for itself: its partly filled page."""
        return 1 if num_tokens % self.page_size else 0

    def fork(self, source: Request, child: Request, num_tokens: int) -> list[tuple[int, int]]:
        """Gives `child` the KV of `source`'s first `num_tokens` tokens: the full pages are shared (one
        more reference each), the partly filled page is copied into a block of its own (copy-on-write:
        both sequences write their next tokens there). The caller has checked the free blocks
        (`num_fork_blocks`). Returns the (source block, child block) copies to make."""
        table = self.block_tables[source.request_id]
        num_full = num_tokens // self.page_size
        shared = table[:num_full]
        self.block_pool.touch(shared)
        child_table = list(shared)
        copies = []
        if self.num_fork_blocks(num_tokens):
            [block] = self.block_pool.allocate(1)
            child_table.append(block)
            copies.append((table[num_full].block_id, block.block_id))
        self.block_tables[child.request_id] = child_table
        self._block_ids[child.request_id] = [block.block_id for block in child_table]
        if self.enable_prefix_caching:
            # The shared pages are the source's: registered by it as far as it registered them.
            self._num_registered_blocks[child.request_id] = min(
                self._num_registered_blocks.get(source.request_id, 0), num_full
            )
            child.block_hashes = source.block_hashes[:num_full]
            child.block_hashes_weight_version = source.block_hashes_weight_version
        return copies

    def free(self, request_id: str) -> None:
        """Releases the request's blocks, tail first so its least shareable blocks are evicted first."""
        table = self.block_tables.pop(request_id, None)
        self._block_ids.pop(request_id, None)
        self._num_registered_blocks.pop(request_id, None)
        if table:
            self.block_pool.free(reversed(table))

    def reset_prefix_cache(self) -> int:
        """Forgets every cached prefix and returns how many blocks were cached. Blocks that live
        requests hold now are never registered again: their KV may predate the event that made the
        cache stale (a weight update)."""
        num_cached = self.block_pool.reset_prefix_cache()
        for request_id, table in self.block_tables.items():
            self._num_registered_blocks[request_id] = len(table)
        return num_cached

    def begin_weight_version(self, weight_version: int) -> int:
        """New weights are in place: the old weights' prefixes are dropped and the blocks computed from
        now on are keyed by `weight_version`. Returns how many blocks were cached."""
        self.weight_version = weight_version
        return self.reset_prefix_cache()

    def _extend_block_hashes(self, request: Request) -> None:
        """Brings the request's hash chain up to its tokens, under the current weight version: a chain
        hashed under another version (a request hashed before an update, readmitted after it) is
        started again."""
        if request.block_hashes_weight_version != self.weight_version:
            request.block_hashes = []
            request.block_hashes_weight_version = self.weight_version
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.page_size, self.weight_version)

    def _num_new_blocks(
        self, request_id: str, num_computed: int, num_new_tokens: int, computed_blocks: Sequence[KVBlock]
    ) -> int:
        num_held = len(self.block_tables.get(request_id, ())) + len(computed_blocks)
        return max(0, blocks_for_tokens(num_computed + num_new_tokens, self.page_size) - num_held)

    def _register_full_blocks(
        self, request: Request, table: list[KVBlock], num_tokens_after_step: int
    ) -> None:
        # A block is registered once this step fills it. Attention writes every new token of a step
        # before any request reads the cache, so a request admitted later in the same step may
        # already share it.
        # Only known tokens count: a page that ends in a placeholder is registered by a later step.
        num_full = min(num_tokens_after_step, len(request.all_token_ids)) // self.page_size
        start = self._num_registered_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        self._extend_block_hashes(request)
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
