"""A Triton kernel for decode attention that reads keys and values in place through a block table.

The gather path (`attention.attend`) copies every decode row's keys into a dense `[B, K, H_kv, D]` tensor,
then runs SDPA with a mask. This kernel is the decode fast path instead: one program per (row, KV head)
walks the row's pages through its block table, loads each tile of keys once for all the query heads that
share it (grouped-query attention), and keeps an online softmax, so nothing the size of the context is
materialised and no mask is built.

It runs on CUDA, and anywhere under Triton's interpreter (TRITON_INTERPRET=1, set before this module is
imported), which is how the tests check it on the CPU. Sliding windows are supported: a row attends from
its first key position on. Scores and the softmax are computed in fp32 without tensor-core dots, so fp32
outputs match the gather path to rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Keys per tile. A tile may span pages: each key finds its own page in the block table.
KEYS_PER_TILE = 32


@triton.jit
def _paged_decode_kernel(
    query_ptr,  # [B, H, D]
    key_cache_ptr,  # [num_slots, H_kv, D]
    value_cache_ptr,
    block_table_ptr,  # [B, max_blocks]
    seq_lens_ptr,  # [B] keys of each row (its position + 1)
    first_positions_ptr,  # [B] first key position each row attends to (sliding windows)
    output_ptr,  # [B, H, D]
    scale,
    softcap,
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
    BLOCK_DIM: tl.constexpr,
    BLOCK_KEYS: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + row)
    first = tl.load(first_positions_ptr + row)

    groups = tl.arange(0, BLOCK_GROUP)
    dims = tl.arange(0, BLOCK_DIM)
    group_mask = groups < GROUP_SIZE
    dim_mask = dims < head_dim
    heads = kv_head * GROUP_SIZE + groups
    query = tl.load(
        query_ptr + row * stride_query_row + heads[:, None] * stride_query_head + dims[None, :],
        mask=group_mask[:, None] & dim_mask[None, :],
        other=0.0,
    ).to(tl.float32)

    running_max = tl.full([BLOCK_GROUP], float("-inf"), tl.float32)
    running_sum = tl.full([BLOCK_GROUP], 0.0, tl.float32)
    accumulator = tl.full([BLOCK_GROUP, BLOCK_DIM], 0.0, tl.float32)
    # The first tile holds `first`, a valid key, and every later tile holds at least one: no tile is fully
    # masked, so the running maximum is finite after the first.
    tile_start = (first // BLOCK_KEYS) * BLOCK_KEYS
    for start in range(tile_start, seq_len, BLOCK_KEYS):
        positions = start + tl.arange(0, BLOCK_KEYS)
        valid = (positions >= first) & (positions < seq_len)
        safe_positions = tl.where(valid, positions, first)
        blocks = tl.load(block_table_ptr + row * stride_table_row + safe_positions // page_size)
        slots = blocks.to(tl.int64) * page_size + safe_positions % page_size
        offsets = slots[:, None] * stride_cache_slot + kv_head * stride_cache_head + dims[None, :]
        load_mask = valid[:, None] & dim_mask[None, :]
        keys = tl.load(key_cache_ptr + offsets, mask=load_mask, other=0.0).to(tl.float32)
        values = tl.load(value_cache_ptr + offsets, mask=load_mask, other=0.0).to(tl.float32)

        scores = tl.sum(query[:, None, :] * keys[None, :, :], axis=2) * scale  # [G, N]
        if USE_SOFTCAP:
            # tanh(x) = 1 - 2 / (exp(2x) + 1), finite for every x.
            scores = softcap * (1.0 - 2.0 / (tl.exp(2.0 * scores / softcap) + 1.0))
        scores = tl.where(valid[None, :], scores, float("-inf"))
        tile_max = tl.maximum(running_max, tl.max(scores, axis=1))
        probabilities = tl.exp(scores - tile_max[:, None])
        correction = tl.exp(running_max - tile_max)
        running_sum = running_sum * correction + tl.sum(probabilities, axis=1)
        accumulator = accumulator * correction[:, None] + tl.sum(
            probabilities[:, :, None] * values[None, :, :], axis=1
        )
        running_max = tile_max

    result = accumulator / running_sum[:, None]
    tl.store(
        output_ptr + row * stride_output_row + heads[:, None] * stride_output_head + dims[None, :],
        result.to(output_ptr.dtype.element_ty),
        mask=group_mask[:, None] & dim_mask[None, :],
    )


def paged_decode_attention(
    queries: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    first_positions: torch.Tensor,
    page_size: int,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """queries [B, H, D] -> [B, H, D]: row b attends to its keys at positions
    first_positions[b] .. seq_lens[b] - 1, found through block_table[b]."""
    num_rows, num_heads, head_dim = queries.shape
    num_kv_heads = key_cache.shape[1]
    group_size = num_heads // num_kv_heads
    queries = queries.contiguous()
    output = torch.empty_like(queries)
    _paged_decode_kernel[(num_rows, num_kv_heads)](
        queries,
        key_cache,
        value_cache,
        block_table,
        seq_lens,
        first_positions,
        output,
        scale,
        softcap if softcap is not None else 1.0,
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
        BLOCK_GROUP=triton.next_power_of_2(group_size),
        BLOCK_DIM=triton.next_power_of_2(head_dim),
        BLOCK_KEYS=KEYS_PER_TILE,
        USE_SOFTCAP=softcap is not None,
    )
    return output
