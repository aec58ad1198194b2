"""Paged attention functions plugged into transformers' `AttentionInterface`.

Unmodified model code calls `attention_interface(module, query, key, value, attention_mask, ...)` with
the step's tokens packed into one sequence (batch dimension 1). These functions write the new keys and
values into the paged cache, then attend each request to its own cached tokens:

- decode rows (one query token each) run as one padded batch over their own lengths;
- every prefill chunk runs alone against its own prefix.

So attention work follows each request's own length; there is never one dense mask over every token
in flight. All new tokens of a layer are written before any are read, which lets requests scheduled in
the same step share prefix blocks that step fills.

Grouped-query attention never repeats keys: the query heads that share a key head are folded into the
query-length axis, `[H, Tq, D] -> [H_kv, G * Tq, D]`, and the mask is tiled to match.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

CBSERVE_ATTENTION_PREFIX = "cbserve|"


@dataclass
class PrefillSegment:
    """One request's query chunk: packed rows [query_start, query_end), at positions from
    `first_query_position` on."""

    query_start: int
    query_end: int
    first_query_position: int


@dataclass
class GroupSlots:
    """Where one cache group's layers write and read this step.

    Keys are gathered from each row's `first key position` on: 0 for full attention, the start of the
    earliest query's window for a sliding-window group, so its attention costs O(window), not
    O(length). Pages before that start may be the null block in a sliding table; they are never read.
    """

    write_slots: torch.Tensor  # [num_packed_tokens]: where each new token's KV goes
    decode_key_slots: torch.Tensor | None  # [num_decode, max_keys], padding points at the null block
    decode_first_key_positions: torch.Tensor | None  # [num_decode] position of column 0 of each row
    prefill_key_slots: list[torch.Tensor]  # per segment: slots of its keys, in position order
    prefill_first_key_positions: list[int]  # per segment: position of its first key
    # Masks depend on the sliding window only, so each distinct window is built once per step.
    _decode_masks: dict[int | None, torch.Tensor] = field(default_factory=dict)
    _prefill_masks: dict[tuple[int, int | None], torch.Tensor] = field(default_factory=dict)


@dataclass
class PagedAttentionMetadata:
    """Everything a layer needs to read and write the paged cache for one step, built once per step."""

    key_caches: list[torch.Tensor]  # per model layer [num_slots, num_kv_heads, head_dim] of its group
    value_caches: list[torch.Tensor]
    layer_groups: list[int]  # per model layer: index of its cache group in `groups`
    groups: list[GroupSlots]
    decode_rows: torch.Tensor | None  # [num_decode] packed row of each decode query
    decode_lengths: torch.Tensor | None  # [num_decode] keys of each decode row (its position + 1)
    prefill_segments: list[PrefillSegment]
    decode_rows_are_all_rows: bool

    def decode_mask(self, slots: GroupSlots, sliding_window: int | None, dtype: torch.dtype) -> torch.Tensor:
        """Additive mask [num_decode, 1, 1, max_keys]: 0 where a row may attend, -inf elsewhere."""
        mask = slots._decode_masks.get(sliding_window)
        if mask is None:
            assert slots.decode_key_slots is not None and self.decode_lengths is not None
            assert slots.decode_first_key_positions is not None
            columns = torch.arange(slots.decode_key_slots.shape[1], device=slots.decode_key_slots.device)
            key_positions = slots.decode_first_key_positions.unsqueeze(1) + columns.unsqueeze(0)
            lengths = self.decode_lengths.unsqueeze(1)
            allowed = key_positions < lengths
            if sliding_window is not None:
                allowed &= key_positions > lengths - 1 - sliding_window
            mask = _additive(allowed, dtype)[:, None, None, :]
            slots._decode_masks[sliding_window] = mask
        return mask

    def prefill_mask(
        self, slots: GroupSlots, index: int, sliding_window: int | None, group: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """Additive causal mask [group * num_queries, num_keys] for one prefill segment."""
        key = (index, sliding_window)
        mask = slots._prefill_masks.get(key)
        if mask is None:
            segment = self.prefill_segments[index]
            key_slots = slots.prefill_key_slots[index]
            num_queries = segment.query_end - segment.query_start
            device = key_slots.device
            query_positions = torch.arange(num_queries, device=device) + segment.first_query_position
            key_positions = (
                torch.arange(key_slots.shape[0], device=device) + slots.prefill_first_key_positions[index]
            )
            allowed = key_positions.unsqueeze(0) <= query_positions.unsqueeze(1)
            if sliding_window is not None:
                allowed &= key_positions.unsqueeze(0) > query_positions.unsqueeze(1) - sliding_window
            mask = _additive(allowed, dtype).repeat(group, 1)
            slots._prefill_masks[key] = mask
        return mask


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
        ~allowed, torch.finfo(dtype).min
    )


Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, float | None], torch.Tensor]


def sdpa_kernel(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    if softcap is not None:
        return eager_kernel(query, key, value, mask, scale, softcap)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)


def eager_kernel(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores + mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(probs, value)


def paged_attention(
    kernel: Kernel,
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    paged_metadata: PagedAttentionMetadata | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """query [1, H, T, D], key/value [1, H_kv, T, D] -> output [1, T, H, D]."""
    if paged_metadata is None:
        # A plain forward (model.generate, a trainer computing logprobs) while the engine owns the model.
        fallback = _sdpa_fallback if kernel is sdpa_kernel else _eager_fallback(module)
        return fallback(
            module,
            query,
            key,
            value,
            attention_mask,
            scaling=scaling,
            sliding_window=sliding_window,
            softcap=softcap,
            **kwargs,
        )
    meta = paged_metadata
    layer_idx: int = module.layer_idx  # type: ignore[assignment]
    key_cache, value_cache = meta.key_caches[layer_idx], meta.value_caches[layer_idx]
    slots = meta.groups[meta.layer_groups[layer_idx]]
    num_heads, num_tokens, head_dim = query.shape[1], query.shape[2], query.shape[3]
    num_kv_heads = key.shape[1]
    group = num_heads // num_kv_heads
    scale = scaling if scaling is not None else head_dim**-0.5

    key_cache.index_copy_(0, slots.write_slots, key[0].transpose(0, 1))
    value_cache.index_copy_(0, slots.write_slots, value[0].transpose(0, 1))

    rows = query[0].transpose(0, 1)  # [T, H, D]
    if meta.decode_rows_are_all_rows:
        decoded = _decode(
            kernel, meta, slots, rows, key_cache, value_cache, group, scale, sliding_window, softcap
        )
        return decoded[None], None

    output = torch.empty(num_tokens, num_heads, head_dim, dtype=query.dtype, device=query.device)
    if meta.decode_rows is not None:
        decode_queries = rows.index_select(0, meta.decode_rows)
        output[meta.decode_rows] = _decode(
            kernel, meta, slots, decode_queries, key_cache, value_cache, group, scale, sliding_window, softcap
        )
    for index, segment in enumerate(meta.prefill_segments):
        num_queries = segment.query_end - segment.query_start
        segment_query = query[0, :, segment.query_start : segment.query_end]  # [H, Tq, D]
        grouped_query = segment_query.reshape(num_kv_heads, group * num_queries, head_dim)
        key_slots = slots.prefill_key_slots[index]
        keys = key_cache.index_select(0, key_slots).transpose(0, 1)  # [H_kv, K, D]
        values = value_cache.index_select(0, key_slots).transpose(0, 1)
        mask = meta.prefill_mask(slots, index, sliding_window, group, query.dtype)
        attended = kernel(grouped_query, keys, values, mask, scale, softcap)  # [H_kv, G*Tq, D]
        output[segment.query_start : segment.query_end] = attended.reshape(
            num_heads, num_queries, head_dim
        ).transpose(0, 1)
    return output[None], None


def _decode(
    kernel: Kernel,
    meta: PagedAttentionMetadata,
    slots: GroupSlots,
    queries: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    group: int,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """queries [B, H, D] -> [B, H, D], each row attending to its own keys up to `decode_lengths`."""
    assert slots.decode_key_slots is not None
    num_rows, num_heads, head_dim = queries.shape
    num_kv_heads = num_heads // group
    keys = key_cache[slots.decode_key_slots].transpose(1, 2)  # [B, H_kv, L, D]
    values = value_cache[slots.decode_key_slots].transpose(1, 2)
    grouped = queries.reshape(num_rows, num_kv_heads, group, head_dim)
    mask = meta.decode_mask(slots, sliding_window, queries.dtype)
    attended = kernel(grouped, keys, values, mask, scale, softcap)  # [B, H_kv, G, D]
    return attended.reshape(num_rows, num_heads, head_dim)


def paged_sdpa_attention(*args: object, **kwargs: object) -> tuple[torch.Tensor, None]:
    return paged_attention(sdpa_kernel, *args, **kwargs)  # type: ignore[arg-type]


def paged_eager_attention(*args: object, **kwargs: object) -> tuple[torch.Tensor, None]:
    return paged_attention(eager_kernel, *args, **kwargs)  # type: ignore[arg-type]


PAGED_ATTENTION_FUNCTIONS = {
    f"{CBSERVE_ATTENTION_PREFIX}sdpa": paged_sdpa_attention,
    f"{CBSERVE_ATTENTION_PREFIX}eager": paged_eager_attention,
}


def _sdpa_fallback(*args: Any, **kwargs: Any) -> Any:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    kwargs.pop("softcap", None)
    return sdpa_attention_forward(*args, **kwargs)


def _eager_fallback(module: torch.nn.Module) -> Callable[..., Any]:
    """The model's own eager attention (models define it next to their attention class)."""
    function = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if function is None:
        raise RuntimeError(f"{type(module).__name__} has no eager_attention_forward to fall back to")
    return function


def register_paged_attention() -> None:
    """Registers the paged functions in transformers' attention and mask interfaces (idempotent).

    The names carry our own prefix: `paged|...` belongs to transformers' own continuous batching, which
    may run in the same process. The mask functions serve plain forwards (padding masks); the engine's
    own forwards pass a ready 4-D placeholder mask, which mask creation returns untouched.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

    for name, function in PAGED_ATTENTION_FUNCTIONS.items():
        AttentionInterface.register(name, function)
    AttentionMaskInterface.register(f"{CBSERVE_ATTENTION_PREFIX}sdpa", sdpa_mask)
    AttentionMaskInterface.register(f"{CBSERVE_ATTENTION_PREFIX}eager", eager_mask)
