"""Builds one step's packed model inputs and attention batches from a `SchedulerOutput`.

A step packs every scheduled token into one sequence. Decode rows (one new token each) come first
in scheduling order only by coincidence; nothing here relies on it: each `AttentionBatch` says which
packed rows it reads and fills.

Padding (for CUDA graphs and static-shape compilation) rounds a step up to a bounded set of shapes.

- A decode-only step: the number of rows to `padded_size(rows, rows_interval)` and the key width to a
  multiple of the KV interval. Padding rows are fake requests at position 0 whose block table is the
  null block alone, so they write their keys to the null block's first slot and attend to it.
- A step with prefill chunks of at most `varlen_max_tokens` tokens, on the kernel path only (varlen CUDA
  graphs): the packed tokens to `padded_size(tokens, tokens_interval)`, the requests to
  `padded_size(requests, rows_interval)` and the block tables to `max_blocks_per_request` columns.
  Padding tokens belong to no request (no kernel tile reads them; their attention output is zero) and
  write their keys to the null block's first slot; padding requests own no tokens.

Padded logits rows are never sampled. The null block therefore holds finite values that only masked
columns and padding rows ever read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.kv.block_pool import NULL_BLOCK_ID
from engine.kv.cache_manager import KVCacheManager
from engine.kv.layer_groups import KVCacheGroupSpec
from engine.runner.attention import (
    PREFILL_QUERIES_PER_TILE,
    AttentionBatch,
    KernelInputs,
    PagedAttentionMetadata,
)
from engine.runner.device_copies import to_device
from engine.scheduler import SchedulerOutput


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def padded_size(size: int, interval: int) -> int:
    """`size` rounded up to a power of two below `interval`, to a multiple of `interval` from there on:
    small decode batches waste little, large ones need few distinct shapes."""
    if size >= interval:
        return round_up(size, interval)
    return 1 << max(size - 1, 0).bit_length()


def padded_sizes(max_size: int, interval: int) -> list[int]:
    """Every distinct `padded_size` of 1 .. max_size, ascending."""
    sizes = []
    size = 1
    while size <= max_size:
        sizes.append(padded_size(size, interval))
        size = sizes[-1] + 1
    return sizes


@dataclass(frozen=True)
class Padding:
    """Which steps are padded, and the granularity of their shapes in tokens: rows (requests), key width,
    and packed tokens of steps with prefill chunks."""

    rows_interval: int
    keys_interval: int
    tokens_interval: int
    decode: bool = True
    varlen: bool = False
    # Steps with prefill chunks are padded only up to this many packed tokens (larger ones run unpadded).
    varlen_max_tokens: int = 0


@dataclass(frozen=True)
class PreviousTokens:
    """The tokens a step still running samples, on the device: `token_ids[rows[request_id]]`."""

    token_ids: torch.Tensor
    rows: dict[str, int]


@dataclass
class BatchInputs:
    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]
    logits_indices: torch.Tensor  # [L] packed rows whose logits the model computes
    # [R] which of those L logits rows are sampled, in scheduling order; None when all of them are.
    sampled_logits: torch.Tensor | None
    metadata: PagedAttentionMetadata
    num_padding_rows: int
    # Input ids copied on the device from the previous step's sampled tokens (async batching).
    num_placeholder_inputs: int = 0
    # Whether the step's shapes come from the padded set (the only steps a CUDA graph can replay).
    is_padded: bool = False

    @property
    def is_decode_only(self) -> bool:
        return self.metadata.is_decode_only


@dataclass
class _Chunk:
    """One request's new tokens: packed rows from `row` on, positions [start, end)."""

    request_id: str | None  # None for a padding row
    row: int
    start: int
    end: int


class InputBuilder:
    def __init__(
        self,
        groups: Sequence[KVCacheGroupSpec],
        key_caches: list[torch.Tensor],
        value_caches: list[torch.Tensor],
        layer_groups: list[int],
        kv_cache_manager: KVCacheManager,
        page_size: int,
        num_query_heads_per_kv_head: int,
        dtype: torch.dtype,
        device: torch.device,
        attention_kernel: Callable[..., torch.Tensor] | None = None,
        max_blocks_per_request: int = 0,
    ) -> None:
        """With `attention_kernel`, steps whose requests hold at most `max_blocks_per_request` blocks take
        the kernel path (block tables, no gathered keys or masks); other steps gather."""
        self.groups = list(groups)
        self.key_caches = key_caches
        self.value_caches = value_caches
        self.layer_groups = layer_groups
        self.kv_cache_manager = kv_cache_manager
        self.page_size = page_size
        self.group_size = num_query_heads_per_kv_head
        self.dtype = dtype
        self.device = device
        self.attention_kernel = attention_kernel
        self.max_blocks_per_request = max_blocks_per_request
        # Block tables read during the step being built, by (request id, group); callers never mutate them.
        self._step_tables: dict[tuple[str, int], list[int]] = {}

    def build(
        self,
        scheduler_output: SchedulerOutput,
        padding: Padding | None,
        min_rows: int = 0,
        previous: PreviousTokens | None = None,
    ) -> BatchInputs:
        """`padding` says which steps are padded (see the module docstring); a step with prefill chunks is
        padded only on the kernel path.

        With padding, a decode-only step has at least `min_rows` rows: an empty `scheduler_output` and
        `min_rows=n` give a step of padding rows alone, which is how CUDA graphs are captured ahead of use.

        A request may be scheduled for the position of a token the still-running step samples (async
        batching): its input id is copied from `previous` on the device, never read on the host.
        """
        input_ids: list[int] = []
        # Packed rows whose input id is a token of `previous`, and that token's row there.
        placeholder_rows: list[int] = []
        previous_rows: list[int] = []
        positions: list[int] = []
        logits_rows: list[int] = []
        # Every chunk in packed-row order, and the same chunks split by kind (for the gather path).
        chunks: list[_Chunk] = []
        decode: list[_Chunk] = []
        prefill: list[_Chunk] = []
        self._step_tables.clear()
        for item in scheduler_output.scheduled:
            request = item.request
            start, end = item.num_computed_tokens, item.num_computed_tokens + item.num_new_tokens
            chunk = _Chunk(request.request_id, len(input_ids), start, end)
            known = request.all_token_ids[start:end]
            input_ids.extend(known)
            if len(known) < end - start:
                # Scheduling gives a request at most its one placeholder, which is its last token.
                assert previous is not None and len(known) == end - start - 1, (request, previous)
                placeholder_rows.append(len(input_ids))
                previous_rows.append(previous.rows[request.request_id])
                input_ids.append(0)
            positions.extend(range(start, end))
            if item.samples_token:
                logits_rows.append(chunk.row + item.num_new_tokens - 1)
            chunks.append(chunk)
            (decode if item.num_new_tokens == 1 else prefill).append(chunk)

        is_decode_only = not prefill
        sampled_logits = None
        num_padding_rows = 0
        pads_decode = is_decode_only and padding is not None and padding.decode
        if pads_decode:
            assert padding is not None
            num_rows = padded_size(max(len(decode), min_rows), padding.rows_interval)
            num_padding_rows = num_rows - len(decode)
            padding_chunks = [_Chunk(None, row, 0, 1) for row in range(len(decode), num_rows)]
            decode.extend(padding_chunks)
            chunks.extend(padding_chunks)
            input_ids.extend([0] * num_padding_rows)
            positions.extend([0] * num_padding_rows)
            # Logits of every row, so their count depends on the padded shape alone.
            sampled_logits = to_device(logits_rows, torch.long, self.device)
            logits_rows = list(range(num_rows))

        keys_interval = padding.keys_interval if pads_decode and padding is not None else None
        kernel_inputs = None
        pads_varlen = False
        if self.attention_kernel is not None:
            queries_per_tile = 1 if is_decode_only else PREFILL_QUERIES_PER_TILE
            padded_shape = None
            if (
                not is_decode_only
                and padding is not None
                and padding.varlen
                and len(input_ids) <= padding.varlen_max_tokens
            ):
                padded_shape = (
                    padded_size(len(input_ids), padding.tokens_interval),
                    padded_size(len(chunks), padding.rows_interval),
                )
            kernel_inputs = self._kernel_inputs(chunks, keys_interval, queries_per_tile, padded_shape)
            pads_varlen = kernel_inputs is not None and padded_shape is not None
            if pads_varlen:
                assert padded_shape is not None
                num_tokens, num_requests = padded_shape
                num_padding_rows = num_tokens - len(input_ids)
                input_ids.extend([0] * num_padding_rows)
                positions.extend([0] * num_padding_rows)
                # Logits of one row per request, so their count depends on the padded shape alone.
                sampled_logits = to_device(list(range(len(logits_rows))), torch.long, self.device)
                logits_rows.extend([0] * (num_requests - len(logits_rows)))
        batches = []
        if kernel_inputs is None:
            if decode:
                batches.append(self._batch(decode, keys_interval, covers_all_rows=is_decode_only))
            batches.extend(self._batch([chunk], None, covers_all_rows=False) for chunk in prefill)
        metadata = PagedAttentionMetadata(
            key_caches=self.key_caches,
            value_caches=self.value_caches,
            layer_groups=self.layer_groups,
            sliding_windows=[group.sliding_window for group in self.groups],
            write_slots=[
                self._write_slots(group, chunks, len(input_ids)) for group in range(len(self.groups))
            ],
            batches=batches,
            is_decode_only=is_decode_only,
            page_size=self.page_size,
            attention_kernel=self.attention_kernel if kernel_inputs is not None else None,
            kernel_inputs=kernel_inputs,
        )
        device = self.device
        packed_ids = to_device(input_ids, torch.long, device)
        if placeholder_rows:
            assert previous is not None
            packed_ids.index_copy_(
                0,
                to_device(placeholder_rows, torch.long, device),
                previous.token_ids.index_select(0, to_device(previous_rows, torch.long, device)),
            )
        return BatchInputs(
            input_ids=packed_ids.unsqueeze(0),
            position_ids=to_device(positions, torch.long, device).unsqueeze(0),
            logits_indices=to_device(logits_rows, torch.long, device),
            sampled_logits=sampled_logits,
            metadata=metadata,
            num_padding_rows=num_padding_rows,
            num_placeholder_inputs=len(placeholder_rows),
            is_padded=pads_decode or pads_varlen,
        )

    def _table(self, chunk: _Chunk, group: int) -> list[int]:
        """The chunk's block table in `group`, read from the cache manager once per step (the write slots
        and the attention inputs both need it)."""
        if chunk.request_id is None:
            return [NULL_BLOCK_ID]
        key = (chunk.request_id, group)
        table = self._step_tables.get(key)
        if table is None:
            table = self._step_tables[key] = self.kv_cache_manager.block_ids(chunk.request_id, group)
        return table

    def _write_slots(self, group: int, chunks: list[_Chunk], num_rows: int) -> torch.Tensor:
        """[T] cache slot of every packed row's new key, in packed-row order; rows no chunk owns (padding
        tokens) write to the null block's first slot."""
        page_size = self.page_size
        slots = [NULL_BLOCK_ID * page_size] * num_rows
        for chunk in chunks:
            table = self._table(chunk, group)
            for offset, position in enumerate(range(chunk.start, chunk.end)):
                slots[chunk.row + offset] = table[position // page_size] * page_size + position % page_size
        return to_device(slots, torch.long, self.device)

    def _first_key_position(self, group: int, first_query_position: int) -> int:
        """The first position any query from `first_query_position` on may attend to in `group`: 0 for
        full attention, the start of the earliest query's window for a sliding group, so its attention
        costs O(window), not O(length). Pages before it may be the null block in a sliding table."""
        window = self.groups[group].sliding_window
        return 0 if window is None else max(0, first_query_position - window + 1)

    def _batch(
        self, chunks: list[_Chunk], keys_interval: int | None, covers_all_rows: bool
    ) -> AttentionBatch:
        device = self.device
        num_queries = [chunk.end - chunk.start for chunk in chunks]
        width = max(num_queries)
        query_offsets = torch.arange(width, device=device)
        counts = to_device(num_queries, torch.long, device)
        # Padding queries repeat the request's last query: same row, same mask, so never an empty row.
        clamped = torch.minimum(query_offsets.unsqueeze(0), counts.unsqueeze(1) - 1)  # [S, Q]
        first_rows = to_device([chunk.row for chunk in chunks], torch.long, device)
        starts = to_device([chunk.start for chunk in chunks], torch.long, device)
        query_positions = starts.unsqueeze(1) + clamped
        real_queries = None
        if any(count != width for count in num_queries):
            # Built on the host: a device `nonzero()` would wait for the device.
            real_queries = to_device(
                [
                    index * width + offset
                    for index, count in enumerate(num_queries)
                    for offset in range(count)
                ],
                torch.long,
                device,
            )
        key_slots: list[torch.Tensor] = []
        masks: list[torch.Tensor] = []
        for group in range(len(self.groups)):
            slots, mask = self._group_keys(group, chunks, query_positions, keys_interval)
            key_slots.append(slots)
            masks.append(mask)
        output_rows = None
        if not covers_all_rows:
            rows = [
                chunk.row + offset
                for chunk, count in zip(chunks, num_queries, strict=True)
                for offset in range(count)
            ]
            output_rows = to_device(rows, torch.long, device)
        return AttentionBatch(
            query_rows=first_rows.unsqueeze(1) + clamped,
            real_queries=real_queries,
            output_rows=output_rows,
            key_slots=key_slots,
            masks=masks,
        )

    def _kernel_inputs(
        self,
        chunks: list[_Chunk],  # in packed-row order
        keys_interval: int | None,
        queries_per_tile: int,
        padded_shape: tuple[int, int] | None = None,
    ) -> KernelInputs | None:
        """The kernel path's inputs, or None when a request's table is wider than the kernel takes.

        With `keys_interval` (a padded decode step), the table width is rounded up like the key width, so
        graphs see few shapes. With `padded_shape` (a padded step with prefill chunks: packed tokens,
        requests), tables are `max_blocks_per_request` wide, padding requests own no tokens, and the tile
        list has the most entries that many tokens and requests can need.
        """
        device = self.device
        tables = [[self._table(chunk, group) for chunk in chunks] for group in range(len(self.groups))]
        width = max(len(table) for group_tables in tables for table in group_tables)
        if keys_interval is not None:
            pages_per_interval = max(1, keys_interval // self.page_size)
            width = round_up(width, pages_per_interval)
        if width > self.max_blocks_per_request:
            return None
        num_padding_requests = 0
        if padded_shape is not None:
            width = self.max_blocks_per_request
            num_padding_requests = padded_shape[1] - len(chunks)
            for group_tables in tables:
                group_tables.extend([[NULL_BLOCK_ID]] * num_padding_requests)
        block_tables = [
            to_device(
                [table + [NULL_BLOCK_ID] * (width - len(table)) for table in group_tables],
                torch.int32,
                device,
            )
            for group_tables in tables
        ]
        # Each request's rows follow the previous request's: packing puts a request's new tokens together.
        query_starts = [chunk.row for chunk in chunks]
        num_real_rows = query_starts[-1] + chunks[-1].end - chunks[-1].start
        query_starts.extend([num_real_rows] * (num_padding_requests + 1))
        seq_lens = [chunk.end for chunk in chunks] + [0] * num_padding_requests
        tile_requests: list[int] = []
        tile_offsets: list[int] = []
        for index, chunk in enumerate(chunks):
            offsets = range(0, chunk.end - chunk.start, queries_per_tile)
            tile_requests.extend([index] * len(offsets))
            tile_offsets.extend(offsets)
        if padded_shape is not None:
            # Each request's tiles cover its queries with less than one tile to spare.
            num_tiles = padded_shape[0] // queries_per_tile + padded_shape[1]
            tile_requests.extend([-1] * (num_tiles - len(tile_requests)))
            tile_offsets.extend([0] * (num_tiles - len(tile_offsets)))
        return KernelInputs(
            block_tables=block_tables,
            query_starts=to_device(query_starts, torch.int32, device),
            seq_lens=to_device(seq_lens, torch.int32, device),
            tile_requests=to_device(tile_requests, torch.int32, device),
            tile_offsets=to_device(tile_offsets, torch.int32, device),
            queries_per_tile=queries_per_tile,
            has_unowned_rows=padded_shape is not None and padded_shape[0] > num_real_rows,
        )

    def _group_keys(
        self, group: int, chunks: list[_Chunk], query_positions: torch.Tensor, keys_interval: int | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Key slots [S, K] and additive mask [S, 1, G * Q, K] of one cache group.

        Row s reads keys at positions first[s] .. end[s] - 1; columns past that read the null block and
        are masked.
        """
        page_size = self.page_size
        device = self.device
        firsts = [self._first_key_position(group, chunk.start) for chunk in chunks]
        num_keys = max(chunk.end - first for chunk, first in zip(chunks, firsts, strict=True))
        if keys_interval is not None:
            num_keys = round_up(num_keys, keys_interval)
        tables = [self._table(chunk, group) for chunk in chunks]
        num_pages = max(len(table) for table in tables)
        block_table = to_device(
            [table + [NULL_BLOCK_ID] * (num_pages - len(table)) for table in tables], torch.long, device
        )
        first_positions = to_device(firsts, torch.long, device)
        ends = to_device([chunk.end for chunk in chunks], torch.long, device)
        key_positions = first_positions.unsqueeze(1) + torch.arange(num_keys, device=device)  # [S, K]
        past_end = key_positions >= ends.unsqueeze(1)
        safe_positions = key_positions.masked_fill(past_end, 0)
        blocks = torch.gather(block_table, 1, safe_positions // page_size)
        slots = (blocks * page_size + safe_positions % page_size).masked_fill_(
            past_end, NULL_BLOCK_ID * page_size
        )

        # allowed[s, q, k]: key k is one of row s's keys and causal (and inside the window) for query q.
        keys = key_positions.unsqueeze(1)  # [S, 1, K]
        queries = query_positions.unsqueeze(2)  # [S, Q, 1]
        allowed = ~past_end.unsqueeze(1) & (keys <= queries)
        window = self.groups[group].sliding_window
        if window is not None:
            allowed &= keys > queries - window
        num_rows, width = query_positions.shape
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=device).masked_fill_(
            ~allowed, torch.finfo(self.dtype).min
        )
        folded = mask.unsqueeze(1).expand(num_rows, self.group_size, width, num_keys)
        return slots, folded.reshape(num_rows, 1, self.group_size * width, num_keys)
