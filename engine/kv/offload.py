"""CPU offload: which host blocks hold the KV of which preempted request. Ids only, no tensors.

A preempted request's computed blocks are copied to host memory instead of being recomputed; when it is
scheduled again they are copied back and it resumes where it stopped. The copies themselves happen in
the runner (`runner.kv_cache.HostKVCache`), at the start of the step whose `SchedulerOutput` carries them,
in this order: offloads (device -> host), then restores (host -> device), then the forward pass. So a
device block freed by an offload may be the target of a restore or of new tokens in the same step, and
host blocks freed by a restore only return to the pool after that step (`release_pending`), never to be
overwritten by an offload of the same step.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BlockCopy:
    """Copy the KV of `device_block_ids[i]` to/from `host_block_ids[i]`, all layers of cache group
    `group`. Only blocks holding KV are copied: never the null block of a sliding-window table."""

    device_block_ids: tuple[int, ...]
    host_block_ids: tuple[int, ...]
    group: int = 0


@dataclass
class OffloadedKV:
    """A preempted request's KV parked in host memory: of its `num_tokens` computed tokens, the pages
    each group reads again on resumption (`KVCacheManager.resume_block_ids`), one tuple per group."""

    host_block_ids: tuple[tuple[int, ...], ...]
    num_tokens: int

    @property
    def all_host_block_ids(self) -> tuple[int, ...]:
        return tuple(block_id for group_blocks in self.host_block_ids for block_id in group_blocks)


class HostBlockPool:
    """A free list of host block ids. Block ids run 0..num_blocks-1 (no null block on the host).

    One id space serves every cache group: a host block is as large as a page of all the model's
    layers, and a block offloaded from a group fills only that group's layers.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        # Popped from the end: the most recently freed host block is reused first (warm in cache).
        self._free = list(range(num_blocks - 1, -1, -1))
        self._pending_release: list[int] = []

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, num_blocks: int) -> tuple[int, ...] | None:
        """`num_blocks` host blocks, or None (nothing taken) when the pool cannot hold them."""
        if num_blocks > len(self._free):
            return None
        taken = tuple(self._free[-num_blocks:]) if num_blocks else ()
        del self._free[len(self._free) - num_blocks :]
        return taken

    def free_after_step(self, block_ids: tuple[int, ...]) -> None:
        """Returns blocks read by this step's restores once the step has run."""
        self._pending_release.extend(block_ids)

    def free_now(self, block_ids: tuple[int, ...]) -> None:
        """Returns blocks no copy of this step reads (a cancelled offloaded request)."""
        self._free.extend(block_ids)

    def release_pending(self) -> None:
        self._free.extend(self._pending_release)
        self._pending_release.clear()
