"""Builds one step's packed model inputs and attention batches from a `SchedulerOutput`.

Everything comes from what the scheduler hands over, each request's block tables included
(`ScheduledRequest.block_ids`): the runner never reads the scheduler's cache manager, so a rank that only
receives a step's output can build the same inputs.

A step packs every scheduled token into one sequence. Decode rows (one new token each) come first
in scheduling order only by coincidence; nothing here relies on it: each `AttentionBatch` says which
packed rows it reads and fills.

Padded steps (see engine.runner.padding) add padding rows, tokens and requests; here they get their
block tables (the null block alone), write slots and kernel tiles.

Prompt logprobs (SamplingParams.prompt_logprobs): the logits at position q give the logprob of prompt
token q + 1, so a request that asks for them has logits computed at every position q of its chunk with
q + 1 < its prompt length (`PromptLogprobSpan`). A chunk's last position predicts the next chunk's first
token, which is in the prompt and known here; the position that predicts the first generated token (the
prompt's last) is not one of them. Positions whose logprobs the request already holds (computed again
after a preemption with recompute) are skipped. Requests that do not ask add no logits rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from engine.kv.block_pool import NULL_BLOCK_ID
from engine.kv.layer_groups import KVCacheGroupSpec, StateGroupSpec
from engine.request import Request
from engine.runner.attention import (
    PREFILL_QUERIES_PER_TILE,
    AttentionBatch,
    KernelInputs,
    PagedAttentionMetadata,
)
from engine.runner.padding import PackedTokens, Padding, VarlenShape, round_up
from engine.runner.recurrent.step_inputs import (
    StateSegment,
    StateStepInputs,
    build_state_inputs,
    with_state_inputs,
)
from engine.scheduling.scheduler import SchedulerOutput
from engine.system.device_copies import to_device


@dataclass(frozen=True)
class PreviousTokens:
    """The tokens a step still running samples, on the device: `token_ids[rows[request_id]]`."""

    token_ids: torch.Tensor
    rows: dict[str, int]


@dataclass(frozen=True)
class PromptLogprobSpan:
    """Positions [first_position, first_position + count) of `request` whose logits this step computes for
    its prompt logprobs: those at position q give the logprob of prompt token q + 1. They are consecutive
    rows of the step's prompt logits, spans following each other in scheduling order."""

    request: Request
    first_position: int
    count: int


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
    # Prompt logprobs: which of the L logits rows hold them ([N]), the prompt token each row predicts
    # ([N]), and whose they are; None and empty when no request of the step asks.
    prompt_logits: torch.Tensor | None = None
    prompt_targets: torch.Tensor | None = None
    prompt_spans: list[PromptLogprobSpan] = field(default_factory=list)

    @property
    def is_decode_only(self) -> bool:
        return self.metadata.is_decode_only


@dataclass
class _Chunk:
    """One request's new tokens: packed rows from `row` on, positions [start, end), and its block table
    in each cache group as the scheduler handed it (`ScheduledRequest.block_ids`; None for a padding row,
    which reads the null block alone)."""

    block_ids: tuple[list[int], ...] | None
    row: int
    start: int
    end: int


@dataclass
class _PackedStep:
    """One step's scheduled tokens packed on the host, before any copy to the device."""

    tokens: PackedTokens = field(default_factory=PackedTokens)
    # Every chunk in packed-row order, and the same chunks split by kind (for the gather path).
    chunks: list[_Chunk] = field(default_factory=list)
    decode: list[_Chunk] = field(default_factory=list)
    prefill: list[_Chunk] = field(default_factory=list)
    # Packed rows whose input id is a token of `previous`, and that token's row there.
    placeholder_rows: list[int] = field(default_factory=list)
    previous_rows: list[int] = field(default_factory=list)
    # Prompt logprobs: the spans, and the prompt token each of their rows (`tokens.prompt_rows`) predicts.
    prompt_spans: list[PromptLogprobSpan] = field(default_factory=list)
    prompt_targets: list[int] = field(default_factory=list)

    @property
    def is_decode_only(self) -> bool:
        return not self.prefill

    def pad_decode_rows(self, num_rows: int) -> None:
        padding_chunks = [_Chunk(None, row, 0, 1) for row in range(len(self.decode), num_rows)]
        self.decode.extend(padding_chunks)
        self.chunks.extend(padding_chunks)
        self.tokens.pad_decode_rows(num_rows)


# Decode rows are batched together while the longest row's keys are at most this many times the shortest
# row's, so padding costs at most that factor; a batch of fewer than MIN_DECODE_BUCKET_ROWS rows joins the
# next (one more attention call costs more than a little padding).
DECODE_BUCKET_SPREAD = 1.5
MIN_DECODE_BUCKET_ROWS = 8


def decode_buckets(chunks: list[_Chunk]) -> list[list[_Chunk]]:
    """Decode chunks grouped by key length (their `end`), shortest group first; within a group, in
    packed-row order (a single group then covers the rows in order, as one unsplit batch does)."""
    ordered = sorted(chunks, key=lambda chunk: chunk.end)
    buckets: list[list[_Chunk]] = []
    for chunk in ordered:
        bucket = buckets[-1] if buckets else None
        if bucket is None or (
            chunk.end > DECODE_BUCKET_SPREAD * bucket[0].end and len(bucket) >= MIN_DECODE_BUCKET_ROWS
        ):
            buckets.append([chunk])
        else:
            bucket.append(chunk)
    if len(buckets) > 1 and len(buckets[-1]) < MIN_DECODE_BUCKET_ROWS:
        buckets[-2].extend(buckets.pop())
    return [sorted(bucket, key=lambda chunk: chunk.row) for bucket in buckets]


class InputBuilder:
    def __init__(
        self,
        groups: Sequence[KVCacheGroupSpec],
        key_caches: list[torch.Tensor],
        value_caches: list[torch.Tensor],
        layer_groups: list[int],
        page_size: int,
        num_query_heads_per_kv_head: int,
        dtype: torch.dtype,
        device: torch.device,
        attention_kernel: Callable[..., torch.Tensor] | None = None,
        max_blocks_per_request: int = 0,
        split_decode_rows: bool = False,
        fixed_order: bool = False,
        attention_chunks: Sequence[int | None] = (),
        state_group: StateGroupSpec | None = None,
    ) -> None:
        """With `attention_kernel`, steps whose requests hold at most `max_blocks_per_request` blocks take
        the kernel path (block tables, no gathered keys or masks); other steps gather.

        `split_decode_rows`: on the gather path, an unpadded decode-only step attends its rows in batches of
        similar lengths (`decode_buckets`) instead of one batch padded to the longest; only for a decode
        forward that runs eagerly (a compiled or captured one expects one batch).

        `fixed_order` (batch-invariant mode): the kernel computes each query the same way whatever tile
        serves it, and every step uses tiles of PREFILL_QUERIES_PER_TILE queries, decode steps included,
        so the Triton kernel's dot shapes never change (the CPU kernel's tiles hold a decode request's one
        query either way). Every step then needs the kernel path: a request whose table is wider than
        `max_blocks_per_request` raises instead of gathering.

        `attention_chunks` (per layer: Llama 4's chunked layers' chunk, or None): only the kernels bound a
        chunk, so every step needs the kernel path too.

        `state_group` (a model with recurrent layers): each request's slot is its table in the group after
        the paged ones, and steps carry the state inputs (engine.runner.recurrent.step_inputs)."""
        self.groups = list(groups)
        self.state_group = state_group
        self.key_caches = key_caches
        self.value_caches = value_caches
        self.layer_groups = layer_groups
        self.page_size = page_size
        self.group_size = num_query_heads_per_kv_head
        self.dtype = dtype
        self.device = device
        self.attention_kernel = attention_kernel
        self.max_blocks_per_request = max_blocks_per_request
        self.split_decode_rows = split_decode_rows
        self.fixed_order = fixed_order
        self.attention_chunks = list(attention_chunks) if any(attention_chunks) else []
        if self.attention_chunks and attention_kernel is None:
            raise ValueError(
                "the model has chunked attention layers (Llama 4), which only the attention kernel computes, "
                "and it is off here: max_blocks_per_request is 0, or the kernel could not be built (the log "
                "says why)"
            )

    def build(
        self,
        scheduler_output: SchedulerOutput,
        padding: Padding | None,
        min_rows: int = 0,
        previous: PreviousTokens | None = None,
    ) -> BatchInputs:
        """`padding` says which steps are padded (see engine.runner.padding); a step with prefill chunks is
        padded only on the kernel path.

        With padding, a decode-only step has at least `min_rows` rows: an empty `scheduler_output` and
        `min_rows=n` give a step of padding rows alone, which is how CUDA graphs are captured ahead of use.

        A request may be scheduled for the position of a token the still-running step samples (async
        batching): its input id is copied from `previous` on the device, never read on the host.
        """
        step = self._pack(scheduler_output, previous)
        keys_interval = None
        # Padded decode steps compute every row's logits, prompt rows' included.
        if padding is not None and padding.decode and step.is_decode_only:
            step.pad_decode_rows(padding.decode_rows(len(step.decode), min_rows))
            keys_interval = padding.keys_interval
        kernel_inputs = None
        if self.attention_kernel is not None:
            queries_per_tile = 1 if step.is_decode_only and not self.fixed_order else PREFILL_QUERIES_PER_TILE
            varlen_shape = None
            # A step with prompt rows runs unpadded: its logits count is not one of the padded shapes.
            if padding is not None and not step.is_decode_only and not step.prompt_spans:
                varlen_shape = padding.varlen_shape(len(step.tokens.input_ids), len(step.chunks))
            kernel_inputs = self._kernel_inputs(step.chunks, keys_interval, queries_per_tile, varlen_shape)
            # A step whose tables are too wide for the kernel gathers, unpadded.
            if kernel_inputs is None and self.fixed_order:
                raise RuntimeError(
                    f"batch_invariant: a request holds more than max_blocks_per_request="
                    f"{self.max_blocks_per_request} blocks, and gathering its keys would change its bits"
                )
            if kernel_inputs is None and self.attention_chunks:
                raise RuntimeError(
                    f"a request holds more than max_blocks_per_request={self.max_blocks_per_request} "
                    "blocks, and the model's chunked attention layers cannot gather their keys; raise it or "
                    "leave it None"
                )
            if kernel_inputs is not None and varlen_shape is not None:
                step.tokens.pad_varlen(varlen_shape)
        metadata = self._metadata(step, kernel_inputs, keys_interval)
        tokens = step.tokens
        tokens.add_prompt_logits()
        device = self.device
        sampled_logits = tokens.sampled_logits
        prompt_logits, prompt_targets = tokens.prompt_logits, step.prompt_targets
        return BatchInputs(
            input_ids=self._input_ids(step, previous).unsqueeze(0),
            position_ids=to_device(tokens.positions, torch.long, device).unsqueeze(0),
            logits_indices=to_device(tokens.logits_rows, torch.long, device),
            sampled_logits=None if sampled_logits is None else to_device(sampled_logits, torch.long, device),
            metadata=metadata,
            num_padding_rows=tokens.num_padding_rows,
            num_placeholder_inputs=len(step.placeholder_rows),
            is_padded=tokens.is_padded,
            prompt_logits=None if prompt_logits is None else to_device(prompt_logits, torch.long, device),
            prompt_targets=to_device(prompt_targets, torch.long, device) if prompt_targets else None,
            prompt_spans=step.prompt_spans,
        )

    def _pack(self, scheduler_output: SchedulerOutput, previous: PreviousTokens | None) -> _PackedStep:
        step = _PackedStep()
        tokens = step.tokens
        for item in scheduler_output.scheduled:
            request = item.request
            start, end = item.num_computed_tokens, item.num_computed_tokens + item.num_new_tokens
            chunk = _Chunk(item.block_ids, len(tokens.input_ids), start, end)
            known = request.all_token_ids[start:end]
            tokens.input_ids.extend(known)
            if len(known) < end - start:
                # Scheduling gives a request at most its one placeholder, which is its last token.
                assert previous is not None and len(known) == end - start - 1, (request, previous)
                step.placeholder_rows.append(len(tokens.input_ids))
                step.previous_rows.append(previous.rows[request.request_id])
                tokens.input_ids.append(0)
            tokens.positions.extend(range(start, end))
            if item.samples_token:
                tokens.logits_rows.append(chunk.row + item.num_new_tokens - 1)
            if request.prompt_logprobs is not None:
                self._add_prompt_rows(step, chunk, request)
            step.chunks.append(chunk)
            (step.decode if item.num_new_tokens == 1 else step.prefill).append(chunk)
        return step

    @staticmethod
    def _add_prompt_rows(step: _PackedStep, chunk: _Chunk, request: Request) -> None:
        """The rows of `chunk` whose logits give prompt logprobs `request` does not hold yet: positions q
        with q + 1 < the prompt's length (the prompt's last position predicts the first generated token)
        and q >= the logprobs it holds (a recompute after preemption computes earlier positions again)."""
        assert request.prompt_logprobs is not None
        first = max(chunk.start, len(request.prompt_logprobs))
        stop = min(chunk.end, request.num_prompt_tokens - 1)
        if first >= stop:
            return
        step.tokens.prompt_rows.extend(range(chunk.row + first - chunk.start, chunk.row + stop - chunk.start))
        # Prompt tokens, on the host: a placeholder is only ever a generated token.
        step.prompt_targets.extend(request.all_token_ids[first + 1 : stop + 1])
        step.prompt_spans.append(PromptLogprobSpan(request, first, stop - first))

    def _metadata(
        self, step: _PackedStep, kernel_inputs: KernelInputs | None, keys_interval: int | None
    ) -> PagedAttentionMetadata:
        batches: list[AttentionBatch] = []
        if kernel_inputs is None:
            if step.decode and self.split_decode_rows and keys_interval is None:
                buckets = decode_buckets(step.decode)
                covers_all_rows = step.is_decode_only and len(buckets) == 1
                batches.extend(self._batch(bucket, None, covers_all_rows) for bucket in buckets)
            elif step.decode:
                batches.append(self._batch(step.decode, keys_interval, covers_all_rows=step.is_decode_only))
            batches.extend(self._batch([chunk], None, covers_all_rows=False) for chunk in step.prefill)
        num_rows = len(step.tokens.input_ids)
        metadata = PagedAttentionMetadata(
            key_caches=self.key_caches,
            value_caches=self.value_caches,
            layer_groups=self.layer_groups,
            sliding_windows=[group.sliding_window for group in self.groups],
            write_slots=[
                self._write_slots(group, step.chunks, num_rows) for group in range(len(self.groups))
            ],
            batches=batches,
            is_decode_only=step.is_decode_only,
            page_size=self.page_size,
            attention_kernel=self.attention_kernel if kernel_inputs is not None else None,
            kernel_inputs=kernel_inputs,
            attention_chunks=self.attention_chunks,
        )
        if self.state_group is None:
            return metadata
        return with_state_inputs(metadata, self._state_inputs(step.chunks, num_rows))

    def _state_inputs(self, chunks: list[_Chunk], num_rows: int) -> StateStepInputs:
        """The step's state slots and convolution indices: a padding row reads and writes the null slot."""
        assert self.state_group is not None
        slot_group = len(self.groups)
        segments = [
            StateSegment(
                chunk.row,
                chunk.end - chunk.start,
                NULL_BLOCK_ID if chunk.block_ids is None else chunk.block_ids[slot_group][0],
                chunk.start > 0,
            )
            for chunk in chunks
        ]
        return build_state_inputs(segments, num_rows, self.state_group.spec.kernel_size, self.device)

    def _input_ids(self, step: _PackedStep, previous: PreviousTokens | None) -> torch.Tensor:
        device = self.device
        input_ids = to_device(step.tokens.input_ids, torch.long, device)
        if step.placeholder_rows:
            assert previous is not None
            input_ids.index_copy_(
                0,
                to_device(step.placeholder_rows, torch.long, device),
                previous.token_ids.index_select(0, to_device(step.previous_rows, torch.long, device)),
            )
        return input_ids

    @staticmethod
    def _table(chunk: _Chunk, group: int) -> list[int]:
        """The chunk's block table in `group` (the scheduler's list: read, never changed here)."""
        return [NULL_BLOCK_ID] if chunk.block_ids is None else chunk.block_ids[group]

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
        varlen_shape: VarlenShape | None = None,
    ) -> KernelInputs | None:
        """The kernel path's inputs, or None when a request's table is wider than the kernel takes.

        With `varlen_shape` (a padded step with prefill chunks), padding requests own no tokens and the
        tile list has the most entries that shape can need.
        """
        block_tables = self._block_tables(chunks, keys_interval, varlen_shape)
        if block_tables is None:
            return None
        num_padding_requests = 0 if varlen_shape is None else varlen_shape.num_requests - len(chunks)
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
        if varlen_shape is not None:
            num_tiles = varlen_shape.num_tiles(queries_per_tile)
            tile_requests.extend([-1] * (num_tiles - len(tile_requests)))
            tile_offsets.extend([0] * (num_tiles - len(tile_offsets)))
        device = self.device
        return KernelInputs(
            block_tables=block_tables,
            query_starts=to_device(query_starts, torch.int32, device),
            seq_lens=to_device(seq_lens, torch.int32, device),
            tile_requests=to_device(tile_requests, torch.int32, device),
            tile_offsets=to_device(tile_offsets, torch.int32, device),
            queries_per_tile=queries_per_tile,
            has_unowned_rows=varlen_shape is not None and varlen_shape.num_tokens > num_real_rows,
            fixed_order=self.fixed_order,
        )

    def _block_tables(
        self, chunks: list[_Chunk], keys_interval: int | None, varlen_shape: VarlenShape | None
    ) -> list[torch.Tensor] | None:
        """The kernel's [requests, width] block table of each group, or None when a request's table is
        wider than the kernel takes.

        With `keys_interval` (a padded decode step), the width is rounded up like the key width, so graphs
        see few shapes. With `varlen_shape`, tables are `max_blocks_per_request` wide and padding requests
        get the null block alone.
        """
        tables = [[self._table(chunk, group) for chunk in chunks] for group in range(len(self.groups))]
        width = max(len(table) for group_tables in tables for table in group_tables)
        if keys_interval is not None:
            pages_per_interval = max(1, keys_interval // self.page_size)
            width = round_up(width, pages_per_interval)
        if width > self.max_blocks_per_request:
            return None
        if varlen_shape is not None:
            width = self.max_blocks_per_request
            for group_tables in tables:
                group_tables.extend([[NULL_BLOCK_ID]] * (varlen_shape.num_requests - len(chunks)))
        return [
            to_device(
                [table + [NULL_BLOCK_ID] * (width - len(table)) for table in group_tables],
                torch.int32,
                self.device,
            )
            for group_tables in tables
        ]

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
