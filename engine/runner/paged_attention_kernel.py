"""A Triton kernel for paged attention that reads keys and values in place through block tables.

The gather path (`attention.attend`) copies each batch's keys into a dense `[S, K, H_kv, D]` tensor and
runs SDPA with a mask, one batch per prefill chunk. This kernel serves a whole step in one launch instead,
decode rows and prefill chunks alike: nothing the size of the context is materialised, no mask is built,
and the launch has the same shape whatever the mix of chunks, so a step can be captured in a CUDA graph.

Work is split into tiles: a tile is up to `queries_per_tile` consecutive queries of one request, and one
program handles one (tile, KV head). The query heads that share the KV head are folded into the tile's
rows (grouped-query attention), so each tile of keys is loaded once for all of them. The program walks
the request's pages through its block table from the first key any of its queries may see (sliding
windows start late) to its last query's position, with an online softmax. Decode steps use one query per
tile; steps with prefill chunks use `PREFILL_QUERIES_PER_TILE`, where scores are tensor-core dots.

Which tiles exist is decided on the host (`tile_requests`, `tile_offsets`); an entry of -1 is a padding
tile that does nothing, which lets a padded step keep a fixed grid.

It runs on CUDA, and anywhere under Triton's interpreter (TRITON_INTERPRET=1, set before this module is
imported), which is how the tests check it on the CPU. Scores and the softmax are computed in fp32; with
fp32 inputs the dots run in IEEE precision (not TF32), so fp32 outputs match the gather path to rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.runner.attention import kernel_queries_and_output

# Keys per tile of the key loop. A tile may span pages: each key finds its own page in the block table.
KEYS_PER_TILE = 32
# Queries per tile in steps with prefill chunks; decode-only steps use one.
PREFILL_QUERIES_PER_TILE = 16
# Stands for "no sliding window": larger than any position, small enough for int32 arithmetic.
NO_WINDOW = 1 << 30
# tl.dot needs every dimension of at least 16 on GPUs; smaller tiles multiply and sum instead.
MIN_DOT_SIZE = 16


@triton.jit
def _paged_attention_kernel(
    query_ptr,  # [T, H, D]
    key_cache_ptr,  # [num_slots, H_kv, D]
    value_cache_ptr,
    block_table_ptr,  # [R, max_blocks]
    query_starts_ptr,  # [R + 1] first packed row of each request's queries, then T
    seq_lens_ptr,  # [R] keys of each request once this step's are written (last query position + 1)
    tile_requests_ptr,  # [P] request of each tile, -1 for a padding tile
    tile_offsets_ptr,  # [P] index of the tile's first query among its request's queries
    output_ptr,  # [T, H, D]
    sinks_ptr,  # [H] float32 logit per query head added to every softmax (read when USE_SINKS)
    alibi_ptr,  # [H] float32 ALiBi slope per query head (read when USE_ALIBI)
    scale,
    softcap,
    sliding_window,
    attention_chunk,
    stride_query_row,
    stride_query_head,
    stride_cache_slot,
    stride_cache_head,
    stride_table_row,
    stride_output_row,
    stride_output_head,
    page_size,
    head_dim,
    GROUP_SIZE: tl.constexpr,
    BLOCK_GROUP: tl.constexpr,
    QUERIES_PER_TILE: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
    BLOCK_KEYS: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_SINKS: tl.constexpr,
    USE_ALIBI: tl.constexpr,
    USE_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile_request = tl.load(tile_requests_ptr + tile)
    request = tl.maximum(tile_request, 0)
    query_offset = tl.load(tile_offsets_ptr + tile)
    query_start = tl.load(query_starts_ptr + request)
    query_len = tl.load(query_starts_ptr + request + 1) - query_start
    seq_len = tl.load(seq_lens_ptr + request)
    context_len = seq_len - query_len

    # Row r of the tile is query r // BLOCK_GROUP of the tile, head r % BLOCK_GROUP of the KV head's group.
    rows = tl.arange(0, QUERIES_PER_TILE * BLOCK_GROUP)
    queries = query_offset + rows // BLOCK_GROUP
    group_heads = rows % BLOCK_GROUP
    # The tile's realness is broadcast to rows before the `&`: the interpreter rejects a scalar operand.
    row_valid = (group_heads < GROUP_SIZE) & (queries < query_len) & (rows * 0 + tile_request >= 0)
    heads = kv_head * GROUP_SIZE + group_heads
    dims = tl.arange(0, BLOCK_DIM)
    dim_mask = dims < head_dim
    query_mask = row_valid[:, None] & dim_mask[None, :]
    query = tl.load(
        query_ptr
        + (query_start + queries)[:, None] * stride_query_row
        + heads[:, None] * stride_query_head
        + dims[None, :],
        mask=query_mask,
        other=0.0,
    )
    query_positions = context_len + queries
    if USE_ALIBI:
        slopes = tl.load(alibi_ptr + heads, mask=row_valid, other=0.0)

    # Keys this tile reads: from the window (or chunk) start of its first query to its last query's position.
    first_query_position = context_len + query_offset
    first_position = tl.maximum(first_query_position - sliding_window + 1, 0)
    first_position = tl.maximum(first_position, first_query_position // attention_chunk * attention_chunk)
    end_position = tl.minimum(context_len + query_offset + QUERIES_PER_TILE, seq_len)
    end_position = tl.where(tile_request >= 0, end_position, first_position)

    running_max = tl.full([QUERIES_PER_TILE * BLOCK_GROUP], float("-inf"), tl.float32)
    running_sum = tl.full([QUERIES_PER_TILE * BLOCK_GROUP], 0.0, tl.float32)
    accumulator = tl.full([QUERIES_PER_TILE * BLOCK_GROUP, BLOCK_DIM], 0.0, tl.float32)
    tile_start = (first_position // BLOCK_KEYS) * BLOCK_KEYS
    for start in range(tile_start, end_position, BLOCK_KEYS):
        positions = start + tl.arange(0, BLOCK_KEYS)
        key_valid = (positions >= first_position) & (positions < end_position)
        safe_positions = tl.where(key_valid, positions, first_position)
        blocks = tl.load(block_table_ptr + request * stride_table_row + safe_positions // page_size)
        slots = blocks.to(tl.int64) * page_size + safe_positions % page_size
        offsets = slots[:, None] * stride_cache_slot + kv_head * stride_cache_head + dims[None, :]
        load_mask = key_valid[:, None] & dim_mask[None, :]
        keys = tl.load(key_cache_ptr + offsets, mask=load_mask, other=0.0)
        values = tl.load(value_cache_ptr + offsets, mask=load_mask, other=0.0)

        if USE_DOT:
            scores = tl.dot(query, tl.trans(keys), input_precision=DOT_PRECISION) * scale
        else:
            scores = (
                tl.sum(query.to(tl.float32)[:, None, :] * keys.to(tl.float32)[None, :, :], axis=2) * scale
            )
        if USE_SOFTCAP:
            # tanh(x) = 1 - 2 / (exp(2x) + 1), finite for every x.
            scores = softcap * (1.0 - 2.0 / (tl.exp(2.0 * scores / softcap) + 1.0))
        if USE_ALIBI:
            distances = (positions[None, :] - query_positions[:, None]).to(tl.float32)
            scores += slopes[:, None] * distances
        allowed = (
            key_valid[None, :]
            & (positions[None, :] <= query_positions[:, None])
            & (positions[None, :] > query_positions[:, None] - sliding_window)
            & (positions[None, :] >= query_positions[:, None] // attention_chunk * attention_chunk)
        )
        scores = tl.where(allowed, scores, float("-inf"))
        tile_max = tl.maximum(running_max, tl.max(scores, axis=1))
        # A row may see no key in a tile (a later query's window starts past it, or a padding row):
        # subtracting 0 instead of -inf keeps its probabilities at 0 rather than NaN.
        safe_max = tl.where(tile_max == float("-inf"), 0.0, tile_max)
        probabilities = tl.exp(scores - safe_max[:, None])
        correction = tl.exp(running_max - safe_max)
        running_sum = running_sum * correction + tl.sum(probabilities, axis=1)
        if USE_DOT:
            attended = tl.dot(probabilities.to(values.dtype), values, input_precision=DOT_PRECISION)
        else:
            attended = tl.sum(probabilities[:, :, None] * values.to(tl.float32)[None, :, :], axis=1)
        accumulator = accumulator * correction[:, None] + attended
        running_max = tile_max

    if USE_SINKS:
        # The sink is one more score in the softmax that contributes no value; a real row's maximum is
        # finite (it saw its own key), and padding rows add nothing.
        sinks = tl.load(sinks_ptr + heads, mask=row_valid, other=0.0)
        running_sum += tl.where(row_valid, tl.exp(sinks - running_max), 0.0)
    # Every real row saw at least its own key; padding rows are not stored.
    result = accumulator / tl.where(running_sum == 0.0, 1.0, running_sum)[:, None]
    tl.store(
        output_ptr
        + (query_start + queries)[:, None] * stride_output_row
        + heads[:, None] * stride_output_head
        + dims[None, :],
        result.to(output_ptr.dtype.element_ty),
        mask=query_mask,
    )


def paged_attention(
    queries: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_starts: torch.Tensor,
    seq_lens: torch.Tensor,
    tile_requests: torch.Tensor,
    tile_offsets: torch.Tensor,
    queries_per_tile: int,
    page_size: int,
    scale: float,
    softcap: float | None,
    sliding_window: int | None,
    has_unowned_rows: bool = False,
    fixed_order: bool = False,
    sinks: torch.Tensor | None = None,
    attention_chunk: int | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """queries [T, H, D] -> [T, H, D].

    Request r owns packed rows query_starts[r] .. query_starts[r + 1] - 1, the last of its seq_lens[r]
    positions, and finds its keys through block_table[r]. Each query attends causally (and within
    `sliding_window`) to its request's keys; `sinks` [H] (gpt-oss) adds one logit per query head to every
    softmax, a score with no value; with `attention_chunk` (Llama 4), a query sees only its own chunk's
    keys; `alibi_slopes` [H] (ALiBi) add slope * (key position - query position) to each score. With
    `has_unowned_rows` (a padded step), rows no request owns are zero; otherwise every row is written.

    `fixed_order` (batch-invariant mode) asks that each query's output have the same bits whatever tile
    serves it. A row's dots, maxima and sums here depend only on the tile's shape (its keys start at
    multiples of KEYS_PER_TILE, and keys a row may not see add exact zeros), so the caller keeps that
    shape fixed: tiles of PREFILL_QUERIES_PER_TILE queries for every step, decode steps included.
    """
    if fixed_order and queries_per_tile != PREFILL_QUERIES_PER_TILE:
        raise ValueError(
            f"fixed_order needs tiles of {PREFILL_QUERIES_PER_TILE} queries in every step, "
            f"got {queries_per_tile}"
        )
    num_heads, head_dim, num_kv_heads = queries.shape[1], queries.shape[2], key_cache.shape[1]
    group_size = num_heads // num_kv_heads
    queries, output = kernel_queries_and_output(queries, has_unowned_rows)
    block_group, block_dim = triton.next_power_of_2(group_size), triton.next_power_of_2(head_dim)
    use_dot = queries_per_tile * block_group >= MIN_DOT_SIZE and block_dim >= MIN_DOT_SIZE
    _paged_attention_kernel[(tile_requests.shape[0], num_kv_heads)](
        queries,
        key_cache,
        value_cache,
        block_table,
        query_starts,
        seq_lens,
        tile_requests,
        tile_offsets,
        output,
        *(output if bias is None else bias.float().contiguous() for bias in (sinks, alibi_slopes)),
        scale,
        softcap if softcap is not None else 1.0,
        sliding_window if sliding_window is not None else NO_WINDOW,
        attention_chunk if attention_chunk is not None else NO_WINDOW,
        queries.stride(0),
        queries.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        block_table.stride(0),
        output.stride(0),
        output.stride(1),
        page_size,
        head_dim,
        GROUP_SIZE=group_size,
        BLOCK_GROUP=block_group,
        QUERIES_PER_TILE=queries_per_tile,
        BLOCK_DIM=block_dim,
        BLOCK_KEYS=KEYS_PER_TILE,
        USE_SOFTCAP=softcap is not None,
        USE_SINKS=sinks is not None,
        USE_ALIBI=alibi_slopes is not None,
        USE_DOT=use_dot,
        DOT_PRECISION="ieee" if queries.dtype == torch.float32 else "tf32",
    )
    return output
