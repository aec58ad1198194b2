"""`SlidingWindowManager`: the block tables of a sliding-window group, which keep only the window.

A sliding layer's query at position `q` attends to keys `q - sliding_window + 1 .. q`. The earliest
query of a step sits at the request's `num_computed` tokens, so no query of this step or any later one
reads a token before `num_computed - sliding_window + 1`: pages lying entirely before it go back to the
pool, and their table entries become the null block. A table is still indexed by logical page::

    page:   0      1      2      3      4      5
    table: [null] [null] [null] [b7]   [b2]   [b9]      window of the step's first query: pages 3..
                                                        (plus pages the step's new tokens reach)

so a request holds at most `ceil((sliding_window - 1 + num_new_tokens) / page_size) + 1` blocks, a small
set recycled as it decodes. Blocks are never shared: there is no prefix caching in this group, and a
forked sequence (n > 1) takes copies of its source's window pages.
"""

from __future__ import annotations

from engine.kv.block_pool import NULL_BLOCK_ID, BlockPool, KVBlock
from engine.kv.full_attention import blocks_for_tokens
from engine.request import Request


class SlidingWindowManager:
    """Owns each request's block table in one sliding-window group.

    Invariants: while a request holds a table, `num_computed` only grows, so the first page it still
    needs only moves forward; entries before that page are the null block, entries from it to the end
    of the table are blocks with ref_count 1 owned by this request alone. `_block_ids[r]` is
    `[block.block_id for block in block_tables[r]]`, kept as the table changes (`block_ids`).
    """

    def __init__(self, num_blocks: int, page_size: int, sliding_window: int) -> None:
        if sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        self.page_size = page_size
        self.sliding_window = sliding_window
        self.block_pool = BlockPool(num_blocks)
        self.null_block = self.block_pool.blocks[NULL_BLOCK_ID]
        self.block_tables: dict[str, list[KVBlock]] = {}
        self._block_ids: dict[str, list[int]] = {}

    def block_ids(self, request_id: str) -> list[int]:
        """The ids of the request's table: the manager's own list, which changes with the table (read it,
        never change it); empty when the request holds none."""
        return self._block_ids.get(request_id, [])

    def first_needed_page(self, num_computed: int) -> int:
        """The first page a query at position `num_computed` (or later) can read."""
        return max(0, num_computed - self.sliding_window + 1) // self.page_size

    def resume_pages(self, num_tokens: int) -> range:
        """Pages whose KV a request with `num_tokens` computed tokens reads again: its window."""
        return range(self.first_needed_page(num_tokens), blocks_for_tokens(num_tokens, self.page_size))

    def max_blocks_per_step(self, num_new_tokens: int) -> int:
        """The most blocks one request holds in a step of `num_new_tokens` tokens (the window of its
        first query plus the new tokens, on unaligned pages)."""
        return blocks_for_tokens(self.sliding_window - 1 + num_new_tokens, self.page_size) + 1

    def can_allocate(self, request_id: str, num_computed: int, num_new_tokens: int) -> bool:
        """Whether `allocate` would find enough blocks, counting those it releases first."""
        num_released, num_new_blocks = self._plan(request_id, num_computed, num_new_tokens)
        return num_new_blocks <= self.block_pool.num_free_blocks + num_released

    def allocate(self, request: Request, num_computed: int, num_new_tokens: int) -> list[KVBlock]:
        """Releases the pages that fell out of the window, then extends the table to cover tokens up
        to `num_computed + num_new_tokens`. The caller has checked `can_allocate`.

        A released block may be handed to another request in this same step: this request never
        reads it again, since attention gathers only from the first page of its window.
        """
        _num_released, num_new_blocks = self._plan(request.request_id, num_computed, num_new_tokens)
        table = self.block_tables.setdefault(request.request_id, [])
        block_ids = self._block_ids.setdefault(request.request_id, [])
        first_needed = self.first_needed_page(num_computed)
        out_of_window = [block for block in table[:first_needed] if block is not self.null_block]
        self.block_pool.free(reversed(out_of_window))
        num_nulled = min(first_needed, len(table))
        if out_of_window:
            table[:num_nulled] = [self.null_block] * num_nulled
            block_ids[:num_nulled] = [NULL_BLOCK_ID] * num_nulled
        # A table restored or admitted past its window starts with null pages up to the window.
        num_null_pages = first_needed - len(table)
        if num_null_pages > 0:
            table.extend([self.null_block] * num_null_pages)
            block_ids.extend([NULL_BLOCK_ID] * num_null_pages)
        new_blocks = self.block_pool.allocate(num_new_blocks)
        table.extend(new_blocks)
        block_ids.extend(block.block_id for block in new_blocks)
        return new_blocks

    def num_fork_blocks(self, num_tokens: int) -> int:
        """Blocks a sequence forked at `num_tokens` tokens takes: the pages of its window."""
        return len(self.resume_pages(num_tokens))

    def fork(self, source: Request, child: Request, num_tokens: int) -> list[tuple[int, int]]:
        """Gives `child` copies of the pages of `source` that a query at `num_tokens` reads (earlier pages
        are null). The caller has checked the free blocks (`num_fork_blocks`); `source` last allocated
        with at most `num_tokens` computed tokens, so it still holds those pages. Returns the
        (source block, child block) copies to make."""
        table = self.block_tables[source.request_id]
        pages = self.resume_pages(num_tokens)
        blocks = self.block_pool.allocate(len(pages))
        self.block_tables[child.request_id] = [self.null_block] * pages.start + blocks
        self._block_ids[child.request_id] = [NULL_BLOCK_ID] * pages.start + [
            block.block_id for block in blocks
        ]
        copies = []
        for page, block in zip(pages, blocks, strict=True):
            assert table[page] is not self.null_block, (source, page)
            copies.append((table[page].block_id, block.block_id))
        return copies

    def free(self, request_id: str) -> None:
        table = self.block_tables.pop(request_id, None)
        self._block_ids.pop(request_id, None)
        if table:
            self.block_pool.free(reversed([block for block in table if block is not self.null_block]))

    def _plan(self, request_id: str, num_computed: int, num_new_tokens: int) -> tuple[int, int]:
        """(blocks this step releases, blocks it allocates)."""
        table = self.block_tables.get(request_id, [])
        first_needed = self.first_needed_page(num_computed)
        num_released = sum(1 for block in table[:first_needed] if block is not self.null_block)
        num_required = blocks_for_tokens(num_computed + num_new_tokens, self.page_size)
        return num_released, max(0, num_required - max(len(table), first_needed))
