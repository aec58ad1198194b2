"""The pool of KV-cache blocks: who owns each block, which are free, which hold a reusable prefix.

A *block* is the unit of KV memory: it holds `page_size` consecutive tokens of one request for every
layer. The pool knows nothing about tensors; it only hands out block ids. Block 0 is the null block:
it is never handed out, its KV bytes stay zero, and attention gathers point their padding at it so a
padded key can never carry NaN into a softmax.

Free blocks live in one queue, popped from its head::

    head (reused first)                                     tail (freed last)
      [b9] <-> [b7] <-> [b3, hash h1] <-> [b4, hash h2] <-> ...

A freed block that holds a cached prefix joins the tail, so cached prefixes are evicted least recently
freed first, and it keeps its hash: until it is popped for reuse, a later request with the same prefix
can take it back out of the middle of the queue (O(1), the queue is intrusive). Popping a hashed block
for reuse evicts exactly that one cached prefix block.

A freed block that holds nothing reusable joins the head: the next request takes it before any cached
prefix, and takes memory a step wrote recently instead of a block the process never touched. Queued
at the tail, they would come back only after every other block of a pool sized from free memory had
been handed out once, so each new request would write pages the process never touched, each first
write a page fault and a page the kernel zeroes. On the 2-core Xeon, with SmolLM2's cache of 357 blocks,
three rounds of 64 concurrent requests took about 106,000 page faults a round that way; reusing freed
blocks first, 103,000 in the first round and 13,000 in each later one, whose decode steps went from
138-142 to 125-126 ms (2026-12-04).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from engine.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventLog
from engine.kv.prefix_hash import BlockHash

NULL_BLOCK_ID = 0


class KVBlock:
    """One block of the pool. `ref_count` counts the requests whose block table holds it."""

    __slots__ = ("block_hash", "block_id", "next_free", "parent_hash", "prev_free", "ref_count", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        # Set only while the block is registered in the prefix cache. `token_ids` and `parent_hash`
        # let a lookup re-check a hash hit, so a hash collision can never serve another prompt's KV.
        self.block_hash: BlockHash | None = None
        self.parent_hash: BlockHash | None = None
        self.token_ids: tuple[int, ...] | None = None
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        short_hash = self.block_hash.hex()[:12] if self.block_hash else None
        return f"KVBlock(id={self.block_id}, ref={self.ref_count}, hash={short_hash})"


class FreeBlockQueue:
    """Intrusive doubly linked list of free blocks: append, popleft and remove are all O(1)."""

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        # Sentinels keep every link operation branch-free.
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        block.prev_free, block.next_free = last, self._tail
        last.next_free = block
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def appendleft(self, block: KVBlock) -> None:
        first = self._head.next_free
        assert first is not None
        block.prev_free, block.next_free = self._head, first
        first.prev_free = block
        self._head.next_free = block
        self.num_free_blocks += 1

    def popleft(self) -> KVBlock:
        first = self._head.next_free
        if first is None or first is self._tail:
            raise IndexError("no free KV block")
        self.remove(first)
        return first

    def remove(self, block: KVBlock) -> None:
        prev_block, next_block = block.prev_free, block.next_free
        if prev_block is None or next_block is None:
            raise ValueError(f"{block!r} is not in the free queue")
        prev_block.next_free = next_block
        next_block.prev_free = prev_block
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def block_ids(self) -> list[int]:
        """Block ids from head (next to be reused) to tail; for tests and debugging."""
        ids = []
        block = self._head.next_free
        while block is not None and block is not self._tail:
            ids.append(block.block_id)
            block = block.next_free
        return ids


class BlockPool:
    """Hands out blocks, counts their references and keeps the prefix-cache map.

    Invariants:
    - a block is in the free queue exactly when its ref_count is 0 (the null block is in neither);
    - a block is in `_cached_blocks` exactly when its `block_hash` is set; cached blocks may be free;
    - `events` hears of every change to `_cached_blocks`, in order (engine.kv.events).
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks must be >= 2 (block 0 is reserved as the null block), got {num_blocks}"
            )
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(block_id) for block_id in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks[NULL_BLOCK_ID + 1 :])
        self._cached_blocks: dict[BlockHash, KVBlock] = {}
        self.events = KVEventLog()

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached_blocks)

    def allocate(self, num_blocks: int) -> list[KVBlock]:
        """Takes `num_blocks` blocks from the head of the free queue, evicting their cached prefix."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks, only {self.num_free_blocks} free")
        allocated = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_count = 1
            allocated.append(block)
        return allocated

    def touch(self, blocks: Sequence[KVBlock]) -> None:
        """Adds a reference to blocks found in the prefix cache, taking free ones out of the queue."""
        for block in blocks:
            if block.ref_count == 0:
                self.free_queue.remove(block)
            block.ref_count += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drops one reference from each block; blocks reaching zero join the free queue: its tail when
        they hold a cached prefix, its head otherwise (see the module docstring).

        Callers pass a request's blocks tail first: the end of a prompt is the least likely part to
        be shared, so it should be the first to be evicted.
        """
        for block in blocks:
            if block.ref_count <= 0:
                raise RuntimeError(f"double free of {block!r}")
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    def lookup(
        self, block_hash: BlockHash, parent_hash: BlockHash | None, token_ids: tuple[int, ...]
    ) -> KVBlock | None:
        """Returns the cached block for this exact (parent, tokens) pair, or None."""
        block = self._cached_blocks.get(block_hash)
        if block is None or block.parent_hash != parent_hash or block.token_ids != token_ids:
            return None
        return block

    def cache_block(
        self, block: KVBlock, block_hash: BlockHash, parent_hash: BlockHash | None, token_ids: tuple[int, ...]
    ) -> None:
        """Registers a full block under its prefix hash. A hash already taken keeps its first owner."""
        if block.block_hash is not None or block_hash in self._cached_blocks:
            return
        block.block_hash, block.parent_hash, block.token_ids = block_hash, parent_hash, token_ids
        self._cached_blocks[block_hash] = block
        self.events.record(BlockStored(block_hash, parent_hash, token_ids))

    def reset_prefix_cache(self) -> int:
        """Forgets every cached prefix (after a weight update, a flush, or a failed step that may not
        have written blocks it had already registered); returns how many there were. Blocks that
        requests hold stay theirs."""
        num_cached = len(self._cached_blocks)
        for block in self._cached_blocks.values():
            block.block_hash = block.parent_hash = block.token_ids = None
        self._cached_blocks.clear()
        self.events.record(AllBlocksCleared())
        return num_cached

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            del self._cached_blocks[block.block_hash]
            self.events.record(BlockRemoved(block.block_hash))
            block.block_hash = block.parent_hash = block.token_ids = None
