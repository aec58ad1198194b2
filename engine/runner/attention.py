"""Paged attention functions plugged into transformers' `AttentionInterface`.

Unmodified model code calls `attention_interface(module, query, key, value, attention_mask, ...)` with
the step's tokens packed into one sequence (batch dimension 1). These functions write the new keys and
values into the paged cache, then attend each request to its own cached tokens, on one of two paths:

- the kernel path (`max_blocks_per_request`): `paged_attention_kernel` serves the whole step in one
  launch, reading keys in place through block tables (`KernelInputs`);
- the gather path, one `AttentionBatch` at a time: all decode rows (one query token each) form one batch,
  padded to the longest row's keys; every prefill chunk is a batch of its own, against its own prefix.

So attention work follows each request's own length; there is never one dense mask over every token
in flight. All new tokens of a layer are written before any are read, which lets requests scheduled in
the same step share prefix blocks that step fills.

Everything a step needs (gather indices, slots, masks, block tables) is built once per step by the model
runner, so a layer runs tensor operations and kernel launches only: a decode-only step is traceable by
torch.compile and capturable in a CUDA graph.

Grouped-query attention never repeats keys: the query heads that share a key head are folded into the
query axis, `[S, Q, H, D] -> [S, H_kv, G * Q, D]`, and masks are built for that folded axis.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

CBSERVE_ATTENTION_PREFIX = "cbserve|"
# Queries per kernel tile in steps with prefill chunks (decode-only steps use one): enough rows for
# tensor-core dots, few enough that a short chunk wastes little.
PREFILL_QUERIES_PER_TILE = 16


@dataclass
class AttentionBatch:
    """S requests' queries padded to Q each, every request attending to its own K keys (the gather path).

    Padding queries (past a request's own query count) gather some real row and are dropped from the
    result; padding keys read the null block and are masked. Invariant: every mask row allows at least
    one column, so no softmax sees a row of only masked scores (which would be NaN in half precision).
    """

    query_rows: torch.Tensor  # [S, Q] packed row of each query
    # [N] indices into the flattened [S * Q] result that are real queries, in packed-row order; None when
    # every query is real.
    real_queries: torch.Tensor | None
    # [N] packed rows the real queries fill; None when the batch covers rows 0..N-1 in order.
    output_rows: torch.Tensor | None
    # Per cache group, [S, K] slot of each key and the additive [S, 1, G * Q, K] mask.
    key_slots: list[torch.Tensor]
    masks: list[torch.Tensor]

    def step_tensors(self) -> list[torch.Tensor]:
        """The per-step tensors this batch reads, in a fixed order (what a CUDA graph copies in)."""
        return [self.query_rows, *self.key_slots, *self.masks]


@dataclass
class KernelInputs:
    """A whole step for `paged_attention_kernel`, which reads keys in place (the kernel path).

    Request r owns packed rows query_starts[r] .. query_starts[r + 1] - 1, the last of its seq_lens[r]
    positions, and finds its keys in cache group g through block_tables[g][r]. Tiles of up to
    `queries_per_tile` queries are the kernel's units of work: tile p covers queries tile_offsets[p] on of
    request tile_requests[p] (-1: a padding tile).
    """

    block_tables: list[torch.Tensor]  # per cache group: [R, W] block ids, padded with the null block
    query_starts: torch.Tensor  # [R + 1]
    seq_lens: torch.Tensor  # [R]
    tile_requests: torch.Tensor  # [P]
    tile_offsets: torch.Tensor  # [P]
    queries_per_tile: int
    # Whether some packed rows belong to no request (padding tokens of a padded step).
    has_unowned_rows: bool = False
    # Batch-invariant mode: every query's output has the same bits whatever tile serves it (the kernels'
    # `fixed_order`; tiles then always hold up to PREFILL_QUERIES_PER_TILE queries).
    fixed_order: bool = False

    def step_tensors(self) -> list[torch.Tensor]:
        """The per-step tensors the kernel reads, in a fixed order (what a CUDA graph copies in)."""
        return [*self.block_tables, self.query_starts, self.seq_lens, self.tile_requests, self.tile_offsets]


@dataclass
class PagedAttentionMetadata:
    """Everything a layer needs to read and write the paged cache for one step, built once per step."""

    key_caches: list[torch.Tensor]  # per model layer [num_slots, num_kv_heads, head_dim] of its group
    value_caches: list[torch.Tensor]
    layer_groups: list[int]  # per model layer: index of its cache group
    sliding_windows: list[int | None]  # per cache group
    write_slots: list[torch.Tensor]  # per cache group: [num_packed_tokens] where each new token's KV goes
    # The gather path: a decode-only step has one batch, covering every packed row in order; otherwise
    # every batch names the rows it fills. Empty on the kernel path.
    batches: list[AttentionBatch]
    is_decode_only: bool
    page_size: int
    # The kernel path instead: `paged_attention_kernel.paged_attention` and its inputs.
    attention_kernel: Callable[..., torch.Tensor] | None = None
    kernel_inputs: KernelInputs | None = None
    # Per model layer: the chunk its queries attend within (Llama 4's chunked layers), or None; empty when
    # no layer is chunked. Only the kernels bound chunks, so such a model's steps take the kernel path
    # (engine.runner.inputs refuses to gather them).
    attention_chunks: list[int | None] = field(default_factory=list)

    def attention_chunk(self, layer_index: int) -> int | None:
        return self.attention_chunks[layer_index] if self.attention_chunks else None

    def step_tensors(self) -> list[torch.Tensor]:
        """Every per-step tensor attention reads, in a fixed order (the caches are not per-step)."""
        tensors = list(self.write_slots)
        for batch in self.batches:
            tensors.extend(batch.step_tensors())
        if self.kernel_inputs is not None:
            tensors.extend(self.kernel_inputs.step_tensors())
        return tensors


# The metadata of the step running on this thread, for models whose decoder layers do not hand their
# keyword arguments down to attention (StableLM, Falcon, GPT-J, ...): `paged_metadata` never reaches
# them. Bound by the engine's eager forwards around the model call only (engine.runner.forward_paths), so
# a plain forward on another thread, or the same thread between steps, never sees a step's caches.
_running_step = threading.local()


def bind_step_metadata(metadata: PagedAttentionMetadata | None) -> None:
    """Makes `metadata` the running step's on this thread (None: no step runs)."""
    _running_step.metadata = metadata


def bound_step_metadata() -> PagedAttentionMetadata | None:
    """The metadata of the step running on this thread, or None outside the engine's eager forwards."""
    return getattr(_running_step, "metadata", None)


def is_latent_attention(module: torch.nn.Module) -> bool:
    """Whether `module` is transformers' multi-head latent attention (DeepSeek V2 and V3, and the families
    built on it), whose cache holds latents (engine.runner.latent_attention)."""
    return hasattr(module, "kv_b_proj") and hasattr(module, "expand_kv")


Kernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, float | None, torch.Tensor | None],
    torch.Tensor,
]


def sdpa_kernel(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    if softcap is not None or sinks is not None:
        return eager_kernel(query, key, value, mask, scale, softcap, sinks)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)


def eager_kernel(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """`sinks` [1, H_kv, rows, 1]: each score row's sink logit, one more softmax column that takes
    probability mass and contributes no value (gpt-oss)."""
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores + mask
    if sinks is not None:
        scores = torch.cat([scores, sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)], dim=-1)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    if sinks is not None:
        probs = probs[..., :-1]
    return torch.matmul(probs, value)


def kernel_queries_and_output(
    queries: torch.Tensor, has_unowned_rows: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """What both kernels (`paged_attention_kernel`, `paged_attention_cpu`) start from: queries [T, H, D] with
    unit stride along D, and the output they fill, zeroed when some rows belong to no request (no kernel
    writes those)."""
    if queries.stride(2) != 1:
        queries = queries.contiguous()
    return queries, torch.zeros_like(queries) if has_unowned_rows else torch.empty_like(queries)


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
    layer_index: int | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """query [1, H, T, D], key/value [1, H_kv, T, D] -> output [1, T, H, D].

    `sliding_window` needs no handling here: each cache group's masks already apply its window. Attention
    sinks arrive as `s_aux` [H] (gpt-oss's keyword), one logit per query head; ALiBi slopes as
    `alibi_slopes` [H] (engine.runner.own_attention's adapters for Bloom, MPT and Falcon's ALiBi variant),
    one per query head. `layer_index` is the
    module's `layer_idx` unless given (engine.runner.own_attention's adapters give it: some families
    name it otherwise).
    """
    sinks: torch.Tensor | None = kwargs.get("s_aux")  # type: ignore[assignment]
    alibi_slopes: torch.Tensor | None = kwargs.get("alibi_slopes")  # type: ignore[assignment]
    if paged_metadata is None and not torch.compiler.is_compiling():
        paged_metadata = bound_step_metadata()
    if paged_metadata is None:
        # A plain forward (model.generate, a trainer computing logprobs) while the engine owns the model;
        # under `engine.trainer_exact`, through the engine's kernel in its batch-invariant order.
        from engine.runner.exact_attention import exact_attention, exact_forward_active

        if exact_forward_active():
            return exact_attention(
                module, query, key, value, attention_mask, scaling, sliding_window=sliding_window,
                softcap=softcap, **kwargs,  # type: ignore[arg-type]
            )  # fmt: skip
        uses_sdpa = kernel is sdpa_kernel and sinks is None  # the model's eager code adds its sinks
        fallback = _sdpa_fallback if uses_sdpa else _eager_fallback(module)
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
    if layer_index is None:
        layer_index = module.layer_idx  # type: ignore[assignment]
    assert layer_index is not None
    if is_latent_attention(module):
        # Its keys and values are in the cache already, as latents (imported here: that module builds on
        # this one).
        from engine.runner.latent_attention import latent_attention

        return latent_attention(kernel, module, layer_index, query, paged_metadata, scaling, softcap), None
    if paged_metadata.kernel_inputs is not None:
        return _kernel_attention(
            layer_index, query, key, value, paged_metadata, scaling, softcap, sinks, alibi_slopes
        ), None
    gathered = _gather_attention if paged_metadata.is_decode_only else _varlen_gather_attention
    return gathered(
        kernel, layer_index, query, key, value, paged_metadata, scaling, softcap, sinks, alibi_slopes
    ), None


def _write_keys_and_values(
    layer_index: int, keys: torch.Tensor, values: torch.Tensor, meta: PagedAttentionMetadata
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Writes this step's keys and values [T, H_kv, D] of one layer; returns its caches and cache group."""
    key_cache, value_cache = meta.key_caches[layer_index], meta.value_caches[layer_index]
    group = meta.layer_groups[layer_index]
    write_slots = meta.write_slots[group]
    key_cache.index_copy_(0, write_slots, keys)
    value_cache.index_copy_(0, write_slots, values)
    return key_cache, value_cache, group


def _write_caches(
    layer_index: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    meta: PagedAttentionMetadata,
    scaling: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, float]:
    """Writes this step's keys and values; returns the query rows [T, H, D], the layer's caches, its cache
    group and the softmax scale."""
    key_cache, value_cache, group = _write_keys_and_values(
        layer_index, key[0].transpose(0, 1), value[0].transpose(0, 1), meta
    )
    scale = scaling if scaling is not None else query.shape[3] ** -0.5
    return query[0].transpose(0, 1), key_cache, value_cache, group, scale


def _kernel_attention(
    layer_index: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    meta: PagedAttentionMetadata,
    scaling: float | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """The kernel path: one launch for the whole step, keys read in place.

    It stays inside compiled graphs on both paths: the step's shape (requests, tiles, table width) is in
    its tensors' sizes, which dynamic compilation keeps symbolic, so a varlen step compiles as one graph
    instead of breaking around every layer's attention."""
    scale = scaling if scaling is not None else query.shape[3] ** -0.5
    rows = query[0].transpose(0, 1)
    keys, values = key[0].transpose(0, 1), value[0].transpose(0, 1)
    return write_and_attend(layer_index, rows, keys, values, meta, scale, softcap, sinks, alibi_slopes)[None]


def write_and_attend(
    layer_index: int,
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    meta: PagedAttentionMetadata,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """One layer's attention on the kernel path: writes the step's keys and values [T, H_kv, D] into the
    layer's caches, then attends the queries [T, H, D] to their requests' keys (with the layer's sink
    logits [H] and ALiBi slopes [H], if it has them); returns [T, H, D]."""
    _write_keys_and_values(layer_index, keys, values, meta)
    return attend_written(layer_index, queries, meta, scale, softcap, sinks, alibi_slopes)


def attend_written(
    layer_index: int,
    queries: torch.Tensor,
    meta: PagedAttentionMetadata,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """`write_and_attend` once the step's keys and values of the layer are in its caches."""
    group = meta.layer_groups[layer_index]
    inputs = meta.kernel_inputs
    assert inputs is not None and meta.attention_kernel is not None
    return meta.attention_kernel(
        queries,
        meta.key_caches[layer_index],
        meta.value_caches[layer_index],
        inputs.block_tables[group],
        inputs.query_starts,
        inputs.seq_lens,
        inputs.tile_requests,
        inputs.tile_offsets,
        inputs.queries_per_tile,
        meta.page_size,
        scale,
        softcap,
        meta.sliding_windows[group],
        inputs.has_unowned_rows,
        inputs.fixed_order,
        sinks,
        meta.attention_chunk(layer_index),
        alibi_slopes,
    )


def _gather_attention(
    kernel: Kernel,
    layer_index: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    meta: PagedAttentionMetadata,
    scaling: float | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """The gather path: every batch of the step, each filling the rows it names. A decode-only step has one
    batch covering every row in order (`output_rows` None), which is the output itself, or, run eagerly,
    batches of similar length (engine.runner.inputs.decode_buckets); a step with prefill chunks has one
    batch per chunk besides its decode rows."""
    rows, key_cache, value_cache, group, scale = _write_caches(layer_index, query, key, value, meta, scaling)
    return gather_written(
        kernel, rows, key_cache, value_cache, group, meta, scale, softcap, sinks, alibi_slopes
    )[None]


def gather_written(
    kernel: Kernel,
    rows: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    group: int,
    meta: PagedAttentionMetadata,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """The gather path once the step's keys and values are in the caches: rows [T, H, D] -> [T, H, D]."""
    if len(meta.batches) == 1 and meta.batches[0].output_rows is None:
        return attend(
            kernel, meta.batches[0], group, rows, key_cache, value_cache, scale, softcap, sinks, alibi_slopes
        )
    output = torch.zeros_like(rows)
    for batch in meta.batches:
        attended = attend(
            kernel, batch, group, rows, key_cache, value_cache, scale, softcap, sinks, alibi_slopes
        )
        output.index_copy_(0, batch.output_rows, attended)  # type: ignore[arg-type]
    return output


# On the gather path, steps with prefill chunks run their attention outside any compiled graph: their
# batches are a Python list whose length and masks follow each step's chunks, and a compiled graph would
# recompile for every new count; the projections and MLP around it still compile.
_varlen_gather_attention = torch.compiler.disable(_gather_attention)


def attend(
    kernel: Kernel,
    batch: AttentionBatch,
    group: int,
    rows: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """rows [T, H, D] -> [N, H, D]: the batch's real queries attended over their own keys (with the
    layer's sink logits [H] and ALiBi slopes [H], if it has them).

    ALiBi's bias is slope * key column: a request's columns are its consecutive key positions from its
    first, so the bias differs from the model's slope * key position by a constant per row, which the
    softmax does not see."""
    num_requests, num_queries = batch.query_rows.shape
    num_heads, head_dim = rows.shape[1], rows.shape[2]
    num_kv_heads = key_cache.shape[1]
    group_size = num_heads // num_kv_heads
    queries = rows[batch.query_rows]  # [S, Q, H, D]
    grouped = (
        queries.view(num_requests, num_queries, num_kv_heads, group_size, head_dim)
        .permute(0, 2, 3, 1, 4)
        .reshape(num_requests, num_kv_heads, group_size * num_queries, head_dim)
    )
    key_slots = batch.key_slots[group]
    # index_select on the flattened slots: one row copy per key, where advanced indexing with a 2-D index
    # takes a general (and on the CPU several times slower) path.
    flat_slots = key_slots.flatten()
    gathered_shape = (num_requests, key_slots.shape[1], num_kv_heads, head_dim)
    keys = key_cache.index_select(0, flat_slots).view(gathered_shape).transpose(1, 2)  # [S, H_kv, K, D]
    values = value_cache.index_select(0, flat_slots).view(gathered_shape).transpose(1, 2)
    # The grouped rows run (head within its group, query): each row's sink is its head's.
    row_sinks = (
        None
        if sinks is None
        else sinks.view(num_kv_heads, group_size, 1)
        .expand(-1, -1, num_queries)
        .reshape(1, num_kv_heads, -1, 1)
    )
    mask = batch.masks[group]
    if alibi_slopes is not None:
        row_slopes = alibi_slopes.view(num_kv_heads, group_size, 1).expand(-1, -1, num_queries)
        columns = torch.arange(key_slots.shape[1], device=mask.device, dtype=mask.dtype)
        mask = mask + row_slopes.reshape(1, num_kv_heads, -1, 1).to(mask.dtype) * columns
    attended = kernel(grouped, keys, values, mask, scale, softcap, row_sinks)  # [S, H_kv, G*Q, D]
    result = (
        attended.view(num_requests, num_kv_heads, group_size, num_queries, head_dim)
        .permute(0, 3, 1, 2, 4)
        .reshape(num_requests * num_queries, num_heads, head_dim)
    )
    if batch.real_queries is not None:
        result = result.index_select(0, batch.real_queries)
    return result


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
