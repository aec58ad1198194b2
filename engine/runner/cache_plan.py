"""`plan_cache`: how large an engine's KV cache and batches are, decided before anything is allocated.

The sizes follow from the model's shape, the memory its device has free (capped on the CPU) and the
configuration. Under tensor parallelism every rank takes the smallest sizes any rank affords and the
driver's seed, so all ranks build the same cache and sample the same tokens.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.config import ContinuousBatchingConfig
from engine.families import exact_length_limit
from engine.kv.layer_groups import KVCacheGroupSpec, StateGroupSpec, kv_cache_groups, state_group
from engine.runner.kv_cache import (
    DEFAULT_CPU_CACHE_BUDGET_BYTES,
    KVCacheShape,
    resolve_cache_sizes,
    resolve_offload_blocks,
)
from engine.runner.recurrent.state_cache import state_bytes

if TYPE_CHECKING:
    from engine.parallel import TensorParallelGroup

logger = logging.getLogger(__name__)

DEFAULT_MAX_REQUESTS_PER_BATCH = 1024


@dataclass(frozen=True)
class CachePlan:
    """The KV cache one rank builds, and the batch bounds it is sized for."""

    # Of every layer on this rank; each group's cache holds its own layers.
    shape: KVCacheShape
    kv_cache_groups: list[KVCacheGroupSpec]
    num_blocks: list[int]  # of each group
    num_host_blocks: int  # 0: no CPU offload
    max_batch_tokens: int
    max_requests_per_batch: int
    max_model_len: int | None
    seed: int | None
    # The recurrent layers, whose state slots (one per request the batch can hold, and the null slot) are
    # taken from the memory budget before the blocks are sized.
    state_group: StateGroupSpec | None = None
    num_state_slots: int = 0

    @property
    def has_sliding_layers(self) -> bool:
        return any(group.sliding_window is not None for group in self.kv_cache_groups)


def _budget_cap_bytes(config: ContinuousBatchingConfig, device: torch.device) -> int | None:
    """The most bytes the auto-sized cache may take beside `max_memory_percent`'s share of free memory: the
    user's `kv_cache_memory`, else on the CPU 4 GiB unless the user chose the share (RAM is the host's)."""
    if config.kv_cache_memory is not None:
        return int(config.kv_cache_memory * 2**30)
    if device.type == "cpu" and config.max_memory_percent is None:
        return DEFAULT_CPU_CACHE_BUDGET_BYTES
    return None


def plan_cache(
    model: torch.nn.Module,
    config: ContinuousBatchingConfig,
    tp_size: int,
    parallel: TensorParallelGroup | None = None,
) -> CachePlan:
    """The cache `model` gets on this rank: its share of the KV heads (`tp_size` ranks), agreed with the
    other ranks through `parallel`."""
    # The cache lives beside the weights, in their dtype.
    weights = next(model.parameters())
    device = weights.device
    text_config = model.config.get_text_config()  # type: ignore[operator, union-attr]
    max_model_len: int | None = getattr(text_config, "max_position_embeddings", None)
    exact_limit = exact_length_limit(text_config)
    if exact_limit is not None and (max_model_len is None or exact_limit < max_model_len):
        logger.info(
            "requests and steps are bounded to %d tokens, the longest the engine computes this model exactly "
            "for (engine.families.exact_length_limit)",
            exact_limit,
        )
        max_model_len = exact_limit
    max_requests_per_batch = config.max_requests_per_batch or DEFAULT_MAX_REQUESTS_PER_BATCH
    shape = KVCacheShape.from_model_config(model.config, weights.dtype, tp_size)
    groups = kv_cache_groups(text_config)
    recurrent = state_group(text_config)
    num_state_slots = max_requests_per_batch + 1 if recurrent is not None else 0
    num_blocks, max_batch_tokens = resolve_cache_sizes(
        shape,
        groups,
        device,
        config.page_size,
        config.num_blocks,
        config.max_batch_tokens,
        config.resolved_max_memory_percent(has_logit_processing=config.per_request_processors),
        max_tokens_needed=max_requests_per_batch * (max_model_len or 4096),
        max_requests=max_requests_per_batch,
        activation_bytes_per_token=16 * text_config.hidden_size * shape.dtype.itemsize,
        max_budget_bytes=_budget_cap_bytes(config, device),
        reserved_bytes=state_bytes(recurrent, num_state_slots, shape.dtype) if recurrent is not None else 0,
    )
    # Host blocks are sized for a page of every layer: any group's blocks can use any of them.
    num_host_blocks = resolve_offload_blocks(
        config.cpu_offload_space,
        config.cpu_offload_space_safety_threshold,
        shape.bytes_per_token() * config.page_size,
    )
    if recurrent is not None and num_host_blocks:
        logger.info(
            "CPU offload is off: the model's %s layers keep a state per request that has no host copy, so a "
            "preempted request recomputes",
            recurrent.kind,
        )
        num_host_blocks = 0
    if exact_limit is not None:
        max_batch_tokens = min(max_batch_tokens, exact_limit)
    seed = config.seed
    if parallel is not None:
        *num_blocks, max_batch_tokens, num_host_blocks = parallel.smallest(
            [*num_blocks, max_batch_tokens, num_host_blocks]
        )
        seed = parallel.shared_seed(seed)
    return CachePlan(
        shape=shape,
        kv_cache_groups=groups,
        num_blocks=num_blocks,
        num_host_blocks=num_host_blocks,
        max_batch_tokens=max_batch_tokens,
        max_requests_per_batch=max_requests_per_batch,
        max_model_len=max_model_len,
        seed=seed,
        state_group=recurrent,
        num_state_slots=num_state_slots,
    )
