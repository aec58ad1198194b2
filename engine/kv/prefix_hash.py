"""Parent-chained hashes of full KV blocks, the keys of the prefix cache.

Block i's hash covers its own tokens and the hash of block i-1, so equal hashes mean equal prefixes,
not just equal pages. The hash is SHA-256: a 64-bit hash (Python's tuple hash) has constructible
collisions, and a collision in an earlier page would serve KV computed after another prefix even though
each page's own tokens are re-checked. SHA-256 is also the same in every process, which tensor-parallel
ranks rely on to make the same cache decisions. Pages are still re-checked token by token on every hit
(`BlockPool.lookup`).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BlockHash = bytes


def hash_block(parent_hash: BlockHash | None, token_ids: tuple[int, ...]) -> BlockHash:
    digest = hashlib.sha256(parent_hash or b"")
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


def extend_block_hashes(block_hashes: list[BlockHash], token_ids: Sequence[int], page_size: int) -> None:
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
