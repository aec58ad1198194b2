"""The KV cache tensors and how many blocks fit in memory.

Each cache group (`engine.kv.layer_groups`) has its own `PagedKVCache` holding only its layers. Each
layer has one key and one value tensor of shape `[num_blocks * page_size, num_kv_heads, head_dim]` (a
multi-head latent attention layer one tensor, of its latents, which attention reads as both:
engine.runner.latent_attention); a block is `page_size` consecutive rows of every layer's tensors::

    layer l keys:  | block 0 (null, zeros) | block 1 | block 2 | ... |
                     <-- page_size rows -->

Rows are addressed as slots (`block_id * page_size + offset`), so attention reads and writes with
plain `index_select` / `index_copy_`. On the CPU each tensor is a mapping of its own
(`engine.system.untouched_memory`): the kernel only backs the pages a request actually writes, so a
large cache costs address space, not RSS, until it fills, unless `populate` asks for every page to be
backed ahead of its first write, in the background (engine.system.untouched_memory.Population), from the
cache's creation and again after sleep gave its memory back (the engine's `populate_kv_cache`). Only the
null block is zeroed, because padding reads it.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from engine.families import num_key_value_heads
from engine.kv.block_pool import NULL_BLOCK_ID
from engine.kv.full_attention import blocks_for_tokens
from engine.kv.layer_groups import KVCacheGroupSpec
from engine.runner.latent_attention import latent_cache_width
from engine.system.container_limits import read_container_limits
from engine.system.device_copies import HostCopies, to_device
from engine.system.untouched_memory import Population, UntouchedHostTensor

logger = logging.getLogger(__name__)

# Hard bound on the block count the pool tracks (one Python object each), whatever the memory.
MAX_AUTO_BLOCKS = 1 << 18
DEFAULT_MAX_BATCH_TOKENS_GPU = 8192
DEFAULT_MAX_BATCH_TOKENS_CPU = 2048
MIN_MAX_BATCH_TOKENS = 256
# On the CPU the cache shares RAM with the rest of the host: unless the user sets `max_memory_percent`, it
# takes at most this much (vLLM's CPU backend defaults to the same 4 GiB of KV space).
DEFAULT_CPU_CACHE_BUDGET_BYTES = 4 << 30


@dataclass(frozen=True)
class KVCacheShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    # Multi-head latent attention: a layer caches one row a token, its latent and rotary key, read as both
    # keys and values, so the value caches are the key caches.
    values_are_keys: bool = False

    @classmethod
    def from_model_config(cls, config: Any, dtype: torch.dtype, tp_size: int = 1) -> KVCacheShape:
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        latent_width = latent_cache_width(text_config)
        if latent_width is not None:  # one head every query head reads; not sharded (tensor parallelism)
            return cls(text_config.num_hidden_layers, 1, latent_width, dtype, values_are_keys=True)
        num_heads = text_config.num_attention_heads
        num_kv_heads = num_key_value_heads(text_config)
        if num_kv_heads % tp_size:
            raise ValueError(
                f"tensor-parallel size {tp_size} must divide the model's num_key_value_heads ({num_kv_heads})"
            )
        head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // num_heads
        return cls(text_config.num_hidden_layers, num_kv_heads // tp_size, head_dim, dtype)

    def for_layers(self, num_layers: int) -> KVCacheShape:
        """The same cache shape for a group of `num_layers` layers."""
        return replace(self, num_layers=num_layers)

    def bytes_per_token(self) -> int:
        element_size = torch.empty((), dtype=self.dtype).element_size()
        tensors_per_layer = 1 if self.values_are_keys else 2
        return tensors_per_layer * self.num_layers * self.num_kv_heads * self.head_dim * element_size


def free_memory_bytes(device: torch.device) -> int:
    """Bytes free for the cache on `device`: on the CPU, the host's available memory or, when it is
    smaller, the headroom left under this process's cgroup memory limit (a pod's limit)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    import psutil

    host_available = int(psutil.virtual_memory().available)
    cgroup_available = read_container_limits().memory_available_bytes
    if cgroup_available is not None and cgroup_available < host_available:
        logger.info(
            "sizing from the cgroup's memory headroom, %.2f GiB, not the host's %.2f GiB available",
            cgroup_available / 2**30,
            host_available / 2**30,
        )
        return cgroup_available
    return host_available


def blocks_needed_by_group(
    group: KVCacheGroupSpec, page_size: int, max_tokens_needed: int, max_requests: int, max_batch_tokens: int
) -> int:
    """The most blocks (null block included) `group` can ever use.

    A full-attention group can use a block per page of every token in flight. A request of a
    sliding-window group holds at most `ceil((window - 1 + n) / page_size) + 1` blocks in a step of
    `n` tokens, at most `ceil((window - 1) / page_size) + 2 + n / page_size`; summed over
    `max_requests` requests sharing a step of `max_batch_tokens` tokens.
    """
    if group.sliding_window is None:
        return blocks_for_tokens(max_tokens_needed, page_size) + 1
    per_request = blocks_for_tokens(group.sliding_window - 1, page_size) + 2
    return max_requests * per_request + blocks_for_tokens(max_batch_tokens, page_size) + 1


def resolve_cache_sizes(
    shape: KVCacheShape,
    groups: Sequence[KVCacheGroupSpec],
    device: torch.device,
    page_size: int,
    num_blocks: int | None,
    max_batch_tokens: int | None,
    max_memory_percent: float,
    max_tokens_needed: int,
    max_requests: int,
    activation_bytes_per_token: int,
    max_budget_bytes: int | None = None,
    reserved_bytes: int = 0,
) -> tuple[list[int], int]:
    """(num_blocks of each group, max_batch_tokens), filling in whatever the user left as None.

    `max_batch_tokens` comes first (a fixed default capped so its activations take at most a tenth of
    the budget). A user's `num_blocks` goes to the full-attention group whole; a sliding-window group
    gets what `blocks_needed_by_group` says it can use, capped at `num_blocks`. Auto-sized, the
    groups share the rest of the budget in proportion to the bytes they can use, never more. The budget
    is `max_memory_percent` of the free memory, capped at `max_budget_bytes` when given; the blocks get it
    less `reserved_bytes` (the recurrent layers' state slots).
    """
    budget = int(free_memory_bytes(device) * max_memory_percent)
    if max_budget_bytes is not None:
        budget = min(budget, max_budget_bytes)
    if max_batch_tokens is None:
        default = DEFAULT_MAX_BATCH_TOKENS_GPU if device.type == "cuda" else DEFAULT_MAX_BATCH_TOKENS_CPU
        affordable = budget // 10 // max(1, activation_bytes_per_token)
        max_batch_tokens = max(MIN_MAX_BATCH_TOKENS, min(default, affordable))
    needed = [
        blocks_needed_by_group(group, page_size, max_tokens_needed, max_requests, max_batch_tokens)
        for group in groups
    ]
    if num_blocks is not None:
        sized = [
            num_blocks if group.sliding_window is None else max(2, min(num_blocks, need))
            for group, need in zip(groups, needed, strict=True)
        ]
        return sized, max_batch_tokens
    bytes_per_block = [
        shape.for_layers(len(group.layer_indices)).bytes_per_token() * page_size for group in groups
    ]
    cache_budget = budget - max_batch_tokens * activation_bytes_per_token - reserved_bytes
    needed_bytes = sum(need * size for need, size in zip(needed, bytes_per_block, strict=True))
    share = min(1.0, max(0, cache_budget) / needed_bytes)
    sized = [max(2, min(int(need * share), MAX_AUTO_BLOCKS)) for need in needed]
    logger.info(
        "KV cache sized from free memory: %s blocks of %d tokens (%.2f GiB), max_batch_tokens=%d",
        ", ".join(f"{group.name} {count}" for group, count in zip(groups, sized, strict=True)),
        page_size,
        sum(count * size for count, size in zip(sized, bytes_per_block, strict=True)) / 2**30,
        max_batch_tokens,
    )
    return sized, max_batch_tokens


def _tensors_per_cache(shape: KVCacheShape) -> int:
    return shape.num_layers if shape.values_are_keys else 2 * shape.num_layers


def _keys_and_values(
    tensors: list[torch.Tensor], shape: KVCacheShape
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A cache's distinct tensors as its per-layer key and value caches."""
    key_caches = tensors[: shape.num_layers]
    return key_caches, key_caches if shape.values_are_keys else tensors[shape.num_layers :]


def block_slots(block_ids: list[int], page_size: int, device: torch.device) -> torch.Tensor:
    """The cache rows of `block_ids`, block after block, on `device`."""
    blocks = to_device(block_ids, torch.long, device)  # a plain copy to the device would wait for it
    return (blocks.unsqueeze(1) * page_size + torch.arange(page_size, device=device)).flatten()


class PagedKVCache:
    def __init__(
        self,
        shape: KVCacheShape,
        num_blocks: int,
        page_size: int,
        device: torch.device,
        populate: bool = False,
    ) -> None:
        self.shape = shape
        self.num_blocks = num_blocks
        self.page_size = page_size
        self.device = device
        self.populate = populate
        num_slots = num_blocks * page_size
        row_shape = (num_slots, shape.num_kv_heads, shape.head_dim)
        num_tensors = _tensors_per_cache(shape)
        # On the CPU each tensor owns its pages (see engine.system.untouched_memory); elsewhere the
        # device allocator's storage is shrunk and regrown around sleep.
        self._host_tensors: list[UntouchedHostTensor] = []
        if device.type == "cpu":
            self._host_tensors = [UntouchedHostTensor(row_shape, shape.dtype) for _ in range(num_tensors)]
            self.tensors = [host.tensor for host in self._host_tensors]
        else:
            self.tensors = [
                torch.empty(row_shape, dtype=shape.dtype, device=device) for _ in range(num_tensors)
            ]
        self.key_caches, self.value_caches = _keys_and_values(self.tensors, shape)
        self._population: Population | None = None
        self._start_population()
        self._zero_null_block()

    def _start_population(self) -> None:
        self._stop_population()  # one at a time: a second would only back the same pages again
        if self.populate and self._host_tensors:
            self._population = Population(self._host_tensors)

    def _stop_population(self) -> None:
        if self._population is not None:
            self._population.stop()
            self._population = None

    def wait_populated(self, timeout: float | None = None) -> bool:
        """Waits for the background backing of the pages (`populate`) to end; True at once without it."""
        return self._population is None or self._population.wait(timeout)

    def close(self) -> None:
        """Stops the background backing of the pages, which then holds the tensors no longer (the engine is
        done with them)."""
        self._stop_population()

    def _zero_null_block(self) -> None:
        null_rows = slice(NULL_BLOCK_ID * self.page_size, (NULL_BLOCK_ID + 1) * self.page_size)
        for cache in self.tensors:
            cache[null_rows].zero_()

    def release_storage(self) -> int:
        """Gives every tensor's memory back (sleep); returns the bytes freed. The tensors stay, so
        whatever holds them sees the memory again after `restore_storage`."""
        if self._host_tensors:
            self._stop_population()  # a chunk backed after the drop would hold its memory again
            return sum(host.drop_pages() for host in self._host_tensors)
        released = 0
        for tensor in self.tensors:
            storage = tensor.untyped_storage()
            released += storage.nbytes()
            storage.resize_(0)
        return released

    def restore_storage(self) -> None:
        """Gives the tensors their memory back, its contents undefined but for the null block, which
        padding reads and is zeroed again."""
        if not self._host_tensors:
            for tensor in self.tensors:
                tensor.untyped_storage().resize_(tensor.numel() * tensor.element_size())
        self._start_population()
        self._zero_null_block()

    def copy_blocks(self, source_block_ids: list[int], target_block_ids: list[int]) -> None:
        """Copies the KV of each source block into its target block, every layer, on the device."""
        if not source_block_ids:
            return
        sources = block_slots(source_block_ids, self.page_size, self.device)
        targets = block_slots(target_block_ids, self.page_size, self.device)
        for cache in self.tensors:
            cache.index_copy_(0, targets, cache.index_select(0, sources))

    def block_bytes(self, block_id: int) -> bytes:
        """The raw bytes of one block across all layers; for round-trip tests of block copies."""
        rows = slice(block_id * self.page_size, (block_id + 1) * self.page_size)
        parts = [cache[rows].contiguous().cpu().view(torch.uint8).numpy().tobytes() for cache in self.tensors]
        return b"".join(parts)


@dataclass
class _PendingOffload:
    """An offload whose rows are on their way to the host: `copies` holds each layer's rows, to be
    written to `host_slots` of the matching tensor of `host_caches` once they have landed."""

    host_slots: torch.Tensor
    host_caches: list[torch.Tensor]
    copies: HostCopies


class HostKVCache:
    """Host-memory copies of KV blocks for CPU offload, laid out like `PagedKVCache` (pinned on CUDA).

    Copies go through `index_select` / `index_copy_` on whole block ranges: an advanced-indexing copy
    into a temporary (`host[rows].copy_(...)`) would silently copy nothing.

    An offload never waits for the device (async batching keeps its overlap in a step that preempts):
    each layer's rows are gathered on the device and copied to pinned memory without blocking, and
    written into the host blocks later, in offload order, once landed. Every pending offload is written
    before a restore reads the host blocks, and in order, so a host block freed and offloaded to again
    ends up with the newest rows.
    """

    def __init__(self, device_cache: PagedKVCache, num_blocks: int) -> None:
        self.device_cache = device_cache
        self.num_blocks = num_blocks
        self.page_size = device_cache.page_size
        shape = device_cache.shape
        row_shape = (num_blocks * self.page_size, shape.num_kv_heads, shape.head_dim)
        pin = device_cache.device.type == "cuda"
        self.tensors = [
            torch.empty(row_shape, dtype=shape.dtype, pin_memory=pin)
            for _ in range(_tensors_per_cache(shape))
        ]
        self.key_caches, self.value_caches = _keys_and_values(self.tensors, shape)
        self._pending: deque[_PendingOffload] = deque()

    def _slot_pairs(
        self, device_block_ids: list[int], host_block_ids: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Device slots, host slots, and the (device, host) tensor pairs of every layer's keys and values."""
        device_slots = block_slots(device_block_ids, self.page_size, self.device_cache.device)
        host_slots = block_slots(host_block_ids, self.page_size, torch.device("cpu"))
        pairs = list(zip(self.device_cache.tensors, self.tensors, strict=True))
        return device_slots, host_slots, pairs

    def offload(self, device_block_ids: list[int], host_block_ids: list[int]) -> None:
        """Queues the copy of device blocks to host blocks, every layer (see the class docstring)."""
        if not device_block_ids:
            return
        self._write_landed(wait=False)
        device_slots, host_slots, pairs = self._slot_pairs(device_block_ids, host_block_ids)
        rows = [device_cache.index_select(0, device_slots) for device_cache, _host_cache in pairs]
        host_caches = [host_cache for _device_cache, host_cache in pairs]
        self._pending.append(_PendingOffload(host_slots, host_caches, HostCopies(rows)))

    def _write_landed(self, wait: bool) -> None:
        """Writes pending offloads into the host blocks, oldest first: all of them with `wait`, else
        those that have landed, up to the first that has not."""
        while self._pending and (wait or self._pending[0].copies.ready()):
            pending = self._pending.popleft()
            for host_cache, rows in zip(pending.host_caches, pending.copies.wait(), strict=True):
                host_cache.index_copy_(0, pending.host_slots, rows)

    def restore(self, device_block_ids: list[int], host_block_ids: list[int]) -> None:
        """Copies host blocks back into device blocks, every layer."""
        if not device_block_ids:
            return
        self._write_landed(wait=True)
        device_slots, host_slots, pairs = self._slot_pairs(device_block_ids, host_block_ids)
        for device_cache, host_cache in pairs:
            rows = host_cache.index_select(0, host_slots).to(self.device_cache.device, non_blocking=True)
            device_cache.index_copy_(0, device_slots, rows)


def resolve_offload_blocks(
    cpu_offload_space_gib: float | None, safety_threshold: float, bytes_per_block: int
) -> int:
    """Host blocks for CPU offload: `cpu_offload_space` GiB, capped at `safety_threshold` of total RAM,
    or of the cgroup's memory limit when that is smaller (None: that cap itself). 0 disables offload."""
    if cpu_offload_space_gib == 0:
        return 0
    import psutil

    memory = int(psutil.virtual_memory().total)
    cgroup_limit = read_container_limits().memory_limit_bytes
    cap = int(min(memory, cgroup_limit or memory) * safety_threshold)
    requested = cap if cpu_offload_space_gib is None else int(cpu_offload_space_gib * 2**30)
    if requested > cap:
        logger.warning(
            "cpu_offload_space %.2f GiB is above %.0f%% of RAM; capped at %.2f GiB "
            "(cpu_offload_space_safety_threshold)",
            requested / 2**30,
            safety_threshold * 100,
            cap / 2**30,
        )
    return min(requested, cap) // bytes_per_block
