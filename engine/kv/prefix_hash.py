"""Parent-chained hashes of full KV blocks, the keys of the prefix cache.

Block i's hash covers its own tokens and the hash of block i-1, so equal hashes mean (up to a
collision) equal prefixes, not just equal pages. Python's hash of a tuple of ints is deterministic
across processes (only str and bytes hashing is salted), which tensor-parallel ranks rely on to make
the same cache decisions. Collisions are possible, so every hit is re-checked against the tokens
(`BlockPool.lookup`).
"""

from __future__ import annotations

from collections.abc import Sequence


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((parent_hash, token_ids))


def extend_block_hashes(block_hashes: list[int], token_ids: Sequence[int], page_size: int) -> None:
    """Appends the hashes of the full blocks of `token_ids` not yet in `block_hashes`.

    Tokens are only ever appended to a request, so the hashes already computed stay valid and each
    block is hashed once in the request's life.
    """
    num_full_blocks = len(token_ids) // page_size
    parent = block_hashes[-1] if block_hashes else None
    for index in range(len(block_hashes), num_full_blocks):
        page = tuple(token_ids[index * page_size : (index + 1) * page_size])
        parent = hash_block(parent, page)
        block_hashes.append(parent)
