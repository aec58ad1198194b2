"""Parent-chained hashes of full KV blocks, the keys of the prefix cache.

Block i's hash covers its own tokens and the hash of block i-1, so equal hashes mean equal prefixes,
not just equal pages. The hash is SHA-256: a 64-bit hash (Python's tuple hash) has constructible
collisions, and a collision in an earlier page would serve KV computed after another prefix even though
each page's own tokens are re-checked. SHA-256 is also the same in every process, which tensor-parallel
ranks rely on to make the same cache decisions. Pages are still re-checked token by token on every hit
(`BlockPool.lookup`).

Every chain starts from a root that names the weight version its KV was computed under
(`chain_root`): the same tokens under other weights are another block, so a block computed by an older
policy can never be found by a request that looks up under the current one, whatever else went wrong.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BlockHash = bytes


def chain_root(weight_version: int) -> BlockHash:
    """The parent a chain's first block is hashed under: one per weight version."""
    return hashlib.sha256(b"cbserve weights %d" % weight_version).digest()


def hash_block(parent_hash: BlockHash, token_ids: tuple[int, ...]) -> BlockHash:
    digest = hashlib.sha256(parent_hash)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


def extend_block_hashes(
    block_hashes: list[BlockHash], token_ids: Sequence[int], page_size: int, weight_version: int
) -> None:
    """Appends the hashes of the full blocks of `token_ids` not yet in `block_hashes`, a chain under
    `weight_version` (the caller keeps one chain per version: `Request.block_hashes_weight_version`).

    Tokens are only ever appended to a request, so the hashes already computed stay valid and each
    block is hashed once per weight version in the request's life.
    """
    num_full_blocks = len(token_ids) // page_size
    parent = block_hashes[-1] if block_hashes else chain_root(weight_version)
    for index in range(len(block_hashes), num_full_blocks):
        page = tuple(token_ids[index * page_size : (index + 1) * page_size])
        parent = hash_block(parent, page)
        block_hashes.append(parent)
