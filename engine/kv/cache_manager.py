"""`KVCacheManager`: the scheduler's view of the KV cache, in blocks and tokens, never tensors.

The cache is split into groups (`engine.kv.layer_groups`): a full-attention group and/or a
sliding-window group, each with its own pool and block tables, and for a model with recurrent layers a
state group (engine.kv.state_slots), one slot per running request. The manager makes them act as one: a
request's slots are allocated in every group or in none, and freeing a request frees it everywhere.
Group 0 (the full-attention group when the model has one) is the *primary* group: `block_pool` and
`block_tables` refer to it, as do the block counts reported in stats. The state group comes after the
paged groups, in `block_ids_per_group` too, so paged group indices are the same with or without it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from engine.kv.block_pool import BlockPool, KVBlock
from engine.kv.events import KVCacheEvent
from engine.kv.full_attention import FullAttentionManager, blocks_for_tokens
from engine.kv.offload import BlockCopy, HostBlockPool, OffloadedKV
from engine.kv.sliding_window import SlidingWindowManager
from engine.kv.state_slots import StateSlotManager
from engine.request import Request

__all__ = ["DeviceBlockCopy", "KVCacheManager", "KVCacheStats", "PrefixCacheStats", "blocks_for_tokens"]

GroupManager = FullAttentionManager | SlidingWindowManager


@dataclass(frozen=True)
class DeviceBlockCopy:
    """Copy the KV of `source_block_ids[i]` into `target_block_ids[i]`, all layers of cache group `group`
    (a forked sequence's own copy of its source's pages)."""

    source_block_ids: tuple[int, ...]
    target_block_ids: tuple[int, ...]
    group: int = 0


@dataclass
class PrefixCacheStats:
    """Prompt tokens looked up in the prefix cache, and those served from it."""

    queried_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


@dataclass(frozen=True)
class KVCacheStats:
    """The cache's blocks, every group's counted (a hybrid model's sliding-window blocks are memory too),
    and the prefix cache's lookups (`KVCacheManager.make_stats`)."""

    num_blocks_total: int
    num_blocks_used: int
    num_blocks_cached: int
    prefix_caching_enabled: bool
    prefix_cache: PrefixCacheStats


class KVCacheManager:
    """Owns every group's block tables and the prefix cache (full-attention group only).

    `num_blocks` and `sliding_windows` give one entry per group (None: full attention); a plain int
    with the default windows is a single full-attention group. Prefix caching needs every group to be
    full attention: a sliding group drops the pages a prefix hit would share, and a state group's state
    summarises the whole prefix, which a hit would skip computing.

    `num_state_slots` (null slot included; 0: none) gives the model's recurrent layers their state group.
    """

    def __init__(
        self,
        num_blocks: int | Sequence[int],
        page_size: int,
        enable_prefix_caching: bool,
        sliding_windows: Sequence[int | None] = (None,),
        num_state_slots: int = 0,
    ) -> None:
        blocks_per_group = [num_blocks] if isinstance(num_blocks, int) else list(num_blocks)
        if len(blocks_per_group) != len(sliding_windows) or not sliding_windows:
            raise ValueError(f"one num_blocks per group: got {blocks_per_group} for {list(sliding_windows)}")
        if enable_prefix_caching and any(window is not None for window in sliding_windows):
            raise ValueError("prefix caching cannot be enabled with sliding-window groups")
        if enable_prefix_caching and num_state_slots:
            raise ValueError("prefix caching cannot be enabled with a state group (recurrent layers)")
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.groups: list[GroupManager] = [
            FullAttentionManager(count, page_size, enable_prefix_caching)
            if window is None
            else SlidingWindowManager(count, page_size, window)
            for count, window in zip(blocks_per_group, sliding_windows, strict=True)
        ]
        self.state_group = StateSlotManager(num_state_slots) if num_state_slots else None
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def block_pool(self) -> BlockPool:
        return self.groups[0].block_pool

    @property
    def block_tables(self) -> dict[str, list[KVBlock]]:
        return self.groups[0].block_tables

    @property
    def full_attention_group(self) -> FullAttentionManager | None:
        group = self.groups[0]
        return group if isinstance(group, FullAttentionManager) else None

    @property
    def sliding_window_groups(self) -> list[SlidingWindowManager]:
        return [group for group in self.groups if isinstance(group, SlidingWindowManager)]

    @property
    def capacity_tokens(self) -> int | None:
        """Tokens one request can hold at most; None when no group bounds a request's length."""
        full = self.full_attention_group
        return None if full is None else full.block_pool.num_usable_blocks * self.page_size

    @property
    def all_groups(self) -> list[GroupManager | StateSlotManager]:
        """The paged groups, then the state group when there is one (the order of `block_ids_per_group`)."""
        return [*self.groups, self.state_group] if self.state_group is not None else list(self.groups)

    @property
    def free_fraction(self) -> float:
        """The free share of the fullest paged group's pool (state slots are bounded by the request cap,
        not by memory the safety margin guards)."""
        return min(
            group.block_pool.num_free_blocks / group.block_pool.num_usable_blocks for group in self.groups
        )

    def block_ids(self, request_id: str, group: int = 0) -> list[int]:
        """The ids of the request's table in `group`: the group's own list (read it, never change it)."""
        return self.groups[group].block_ids(request_id)

    def block_ids_per_group(self, request_id: str) -> tuple[list[int], ...]:
        """The ids of the request's table in every group (the state group's `[slot]` last), as the groups
        keep them: no copy is made, so they are current until the request's next allocation or release."""
        return tuple(group.block_ids(request_id) for group in self.all_groups)

    def resume_block_ids(self, request_id: str, group: int, num_tokens: int) -> list[int]:
        """The blocks of `group` a request with `num_tokens` computed tokens reads again when resumed
        (what an offload saves and a restore refills); never the null block."""
        table = self.groups[group].block_ids(request_id)
        return [table[page] for page in self.groups[group].resume_pages(num_tokens)]

    def offload(
        self, request: Request, host_block_pool: HostBlockPool
    ) -> tuple[OffloadedKV, list[BlockCopy]] | None:
        """Host blocks for the KV of `request`'s computed tokens, and the copies that fill them (made before
        its device blocks are reused); None, taking nothing, when the pool lacks room. Only the pages each
        group reads again are copied: all of them for full attention, the window of the next query for
        sliding-window groups. A request with a recurrent state is never offloaded (None): the state has
        no host copy, so it recomputes."""
        if self.state_group is not None:
            return None
        num_tokens = request.num_computed_tokens
        device_blocks = [
            self.resume_block_ids(request.request_id, group, num_tokens) for group in range(len(self.groups))
        ]
        host_blocks = host_block_pool.allocate(sum(len(blocks) for blocks in device_blocks))
        if host_blocks is None:
            return None
        host_blocks_per_group = []
        copies = []
        start = 0
        for group, blocks in enumerate(device_blocks):
            group_host_blocks = host_blocks[start : start + len(blocks)]
            start += len(blocks)
            host_blocks_per_group.append(group_host_blocks)
            copies.append(BlockCopy(tuple(blocks), group_host_blocks, group))
        return OffloadedKV(tuple(host_blocks_per_group), num_tokens), copies

    def restore_copies(self, request: Request, offloaded: OffloadedKV) -> list[BlockCopy]:
        """The copies that bring an offloaded request's KV back, into the blocks just allocated for it."""
        return [
            BlockCopy(
                tuple(self.resume_block_ids(request.request_id, group, offloaded.num_tokens)),
                host_block_ids,
                group,
            )
            for group, host_block_ids in enumerate(offloaded.host_block_ids)
        ]

    def get_computed_blocks(self, request: Request) -> list[KVBlock]:
        """The longest run of leading full blocks of `request` already in the prefix cache.

        A request with prompt logprobs (SamplingParams.prompt_logprobs) takes no block covering a prompt
        position whose logprobs it does not hold yet: the logits of a position served from the cache are
        never computed. So on admission it bypasses the lookup and computes its whole prompt; its blocks
        are still registered for other requests to share, as far as the cache does not hold the same pages
        already (engine.kv.full_attention registers no page after one another block owns). Readmitted after
        a preemption with recompute, it may take only the blocks its collected logprobs cover. Its lookups
        still count as queried tokens in `prefix_cache_stats`.
        """
        full = self.full_attention_group
        if full is None:
            return []
        if request.prompt_logprobs is not None:
            max_hit_blocks = len(request.prompt_logprobs) // self.page_size
            return full.get_computed_blocks(request)[:max_hit_blocks] if max_hit_blocks else []
        return full.get_computed_blocks(request)

    def record_prefix_lookup(self, request: Request, num_hit_tokens: int) -> None:
        """Counts one admission's lookup; called once the request is actually admitted."""
        if self.enable_prefix_caching:
            self.prefix_cache_stats.queried_tokens += request.num_tokens
            self.prefix_cache_stats.hit_tokens += num_hit_tokens

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: Sequence[KVBlock] = ()
    ) -> list[KVBlock] | None:
        """Makes room in every group for `num_new_tokens` more tokens of `request` after its computed
        ones.

        `computed_blocks` are prefix-cache hits for a request being admitted (full-attention group).
        Returns the primary group's newly allocated blocks, or None — and changes nothing in any
        group — when one of them cannot fit the step.
        """
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.page_size
        request_id = request.request_id
        for group in self.all_groups:
            if isinstance(group, FullAttentionManager):
                fits = group.can_allocate(request_id, num_computed, num_new_tokens, computed_blocks)
            else:
                fits = group.can_allocate(request_id, num_computed, num_new_tokens)
            if not fits:
                return None
        new_blocks: list[list[KVBlock]] = []
        for group in self.all_groups:
            if isinstance(group, FullAttentionManager):
                new_blocks.append(group.allocate(request, num_computed, num_new_tokens, computed_blocks))
            else:
                new_blocks.append(group.allocate(request, num_computed, num_new_tokens))
        return new_blocks[0]

    def fork(self, source: Request, child: Request, num_tokens: int) -> list[DeviceBlockCopy] | None:
        """Gives `child`, which holds no blocks, the KV of `source`'s first `num_tokens` tokens in every
        group (n > 1: a sequence forked from the request's first one). Full-attention pages are shared,
        the rest copied (engine.kv.full_attention, engine.kv.sliding_window), the state slot too
        (engine.kv.state_slots). Returns the device copies to make before the next forward pass, or None —
        and changes nothing — when a group lacks the free blocks."""
        groups = self.all_groups
        for group in groups:
            if group.num_fork_blocks(num_tokens) > group.block_pool.num_free_blocks:
                return None
        copies = []
        for index, group in enumerate(groups):
            pairs = group.fork(source, child, num_tokens)
            if pairs:
                sources, targets = zip(*pairs, strict=True)
                copies.append(DeviceBlockCopy(tuple(sources), tuple(targets), index))
        return copies

    def free(self, request: Request) -> None:
        """Releases the request's blocks (and state slot) in every group."""
        for group in self.all_groups:
            group.free(request.request_id)

    def reset_prefix_cache(self) -> int:
        """Drops the prefix cache; returns how many blocks it held."""
        full = self.full_attention_group
        return full.reset_prefix_cache() if full is not None else 0

    def begin_weight_version(self, weight_version: int) -> int:
        """New weights are in place: the prefix cache drops the old weights' blocks and keys new ones by
        `weight_version` (engine.kv.prefix_hash); returns how many blocks it held."""
        full = self.full_attention_group
        return full.begin_weight_version(weight_version) if full is not None else 0

    def reset_prefix_cache_stats(self) -> None:
        """Starts counting prefix-cache lookups from zero (after warmup, whose lookups are no user's)."""
        self.prefix_cache_stats = PrefixCacheStats()

    def make_stats(self) -> KVCacheStats:
        pools = [group.block_pool for group in self.groups]
        return KVCacheStats(
            num_blocks_total=sum(pool.num_usable_blocks for pool in pools),
            num_blocks_used=sum(pool.num_used_blocks for pool in pools),
            num_blocks_cached=sum(pool.num_cached_blocks for pool in pools),
            prefix_caching_enabled=self.enable_prefix_caching,
            prefix_cache=replace(self.prefix_cache_stats),
        )

    def record_kv_events(self) -> None:
        """From now on, changes to the prefix cache are kept for `take_kv_events` (engine.kv.events)."""
        self.block_pool.events.enabled = True

    def take_kv_events(self) -> list[KVCacheEvent]:
        """The prefix cache's changes since the last call, in order."""
        return self.block_pool.events.take()
