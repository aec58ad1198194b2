"""Turns a `SchedulerOutput` into one packed forward pass over the paged cache, then samples."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kv.block_pool import NULL_BLOCK_ID
from engine.kv.cache_manager import KVCacheManager
from engine.request import SamplingParams
from engine.runner.attention import PagedAttentionMetadata, PrefillSegment
from engine.runner.kv_cache import HostKVCache, PagedKVCache
from engine.sampling import Sampler, request_generator
from engine.scheduler import SchedulerOutput


@dataclass
class ModelRunnerOutput:
    # One entry per scheduled request, in scheduling order: the sampled token, or None when the
    # request only advanced through its prompt this step.
    token_ids: list[int | None]
    logprobs: list[float | None]
    top_logprobs: list[dict[int, float] | None]


@dataclass
class BatchInputs:
    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]
    logits_indices: torch.Tensor  # [R] packed rows whose logits are sampled
    metadata: PagedAttentionMetadata


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: PagedKVCache,
        kv_cache_manager: KVCacheManager,
        sampler: Sampler,
        host_kv_cache: HostKVCache | None = None,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.kv_cache_manager = kv_cache_manager
        self.sampler = sampler
        self.host_kv_cache = host_kv_cache
        self.device = kv_cache.device
        self.page_size = kv_cache.page_size
        self._placeholder_mask = torch.zeros(1, 1, 0, 0, device=self.device)

    def prepare_inputs(self, scheduler_output: SchedulerOutput) -> BatchInputs:
        page_size = self.page_size
        input_ids: list[int] = []
        positions: list[int] = []
        write_slots: list[int] = []
        logits_indices: list[int] = []
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lengths: list[int] = []
        prefill: list[tuple[int, int, list[int], int, int]] = []
        for item in scheduler_output.scheduled:
            request = item.request
            start, end = item.num_computed_tokens, item.num_computed_tokens + item.num_new_tokens
            table = self.kv_cache_manager.block_ids(request.request_id)
            row = len(input_ids)
            input_ids.extend(request.all_token_ids[start:end])
            positions.extend(range(start, end))
            write_slots.extend(table[p // page_size] * page_size + p % page_size for p in range(start, end))
            if item.samples_token:
                logits_indices.append(row + item.num_new_tokens - 1)
            if item.num_new_tokens == 1:
                decode_rows.append(row)
                decode_tables.append(table)
                decode_lengths.append(end)
            else:
                prefill.append((row, row + item.num_new_tokens, table, end, start))

        device = self.device
        metadata = PagedAttentionMetadata(
            key_caches=self.kv_cache.key_caches,
            value_caches=self.kv_cache.value_caches,
            write_slots=torch.tensor(write_slots, dtype=torch.long, device=device),
            decode_rows=None,
            decode_key_slots=None,
            decode_lengths=None,
            prefill_segments=[],
            decode_rows_are_all_rows=not prefill,
        )
        if decode_rows:
            lengths = torch.tensor(decode_lengths, dtype=torch.long, device=device)
            metadata.decode_rows = torch.tensor(decode_rows, dtype=torch.long, device=device)
            metadata.decode_lengths = lengths
            metadata.decode_key_slots = self._padded_slots(decode_tables, lengths, max(decode_lengths))
        for query_start, query_end, table, num_keys, first_position in prefill:
            blocks = torch.tensor(table[: -(-num_keys // page_size)], dtype=torch.long, device=device)
            slots = (blocks.unsqueeze(1) * page_size + torch.arange(page_size, device=device)).flatten()[
                :num_keys
            ]
            metadata.prefill_segments.append(PrefillSegment(query_start, query_end, slots, first_position))
        return BatchInputs(
            input_ids=torch.tensor([input_ids], dtype=torch.long, device=device),
            position_ids=torch.tensor([positions], dtype=torch.long, device=device),
            logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=device),
            metadata=metadata,
        )

    def _padded_slots(self, tables: list[list[int]], lengths: torch.Tensor, max_length: int) -> torch.Tensor:
        """[B, max_length] cache slots of each decode row; slots past a row's length read the null block."""
        page_size = self.page_size
        num_blocks = -(-max_length // page_size)
        padded = [
            table[:num_blocks] + [NULL_BLOCK_ID] * (num_blocks - len(table[:num_blocks])) for table in tables
        ]
        block_table = torch.tensor(padded, dtype=torch.long, device=self.device)
        key_positions = torch.arange(max_length, device=self.device)
        slots = block_table[:, key_positions // page_size] * page_size + key_positions % page_size
        # Slots past the length may hold bytes never written; NaN there would survive a -inf mask.
        return slots.masked_fill_(
            key_positions.unsqueeze(0) >= lengths.unsqueeze(1), NULL_BLOCK_ID * page_size
        )

    @torch.inference_mode()
    def forward(self, inputs: BatchInputs) -> torch.Tensor:
        """Returns logits [R, V] for the rows in `inputs.logits_indices`."""
        outputs = self.model(
            input_ids=inputs.input_ids,
            position_ids=inputs.position_ids,
            # A ready 4-D mask makes transformers skip mask creation; paged attention masks by itself.
            attention_mask=self._placeholder_mask,
            use_cache=False,
            logits_to_keep=inputs.logits_indices,
            paged_metadata=inputs.metadata,
        )
        return outputs.logits[0]

    def copy_blocks(self, scheduler_output: SchedulerOutput) -> None:
        """Offloads before restores: a restore may land in a device block an offload just freed."""
        if self.host_kv_cache is None:
            return
        for copy in scheduler_output.offloads:
            self.host_kv_cache.offload(list(copy.device_block_ids), list(copy.host_block_ids))
        for copy in scheduler_output.restores:
            self.host_kv_cache.restore(list(copy.device_block_ids), list(copy.host_block_ids))

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.copy_blocks(scheduler_output)
        inputs = self.prepare_inputs(scheduler_output)
        logits = self.forward(inputs)
        sampling_items = [item for item in scheduler_output.scheduled if item.samples_token]
        params: list[SamplingParams] = [item.request.sampling for item in sampling_items]
        generators = []
        for item in sampling_items:
            request = item.request
            if (
                request.sampling.seed is not None
                and not request.sampling.is_greedy
                and request.generator is None
            ):
                request.generator = request_generator(request.sampling.seed, self.device)
            generators.append(request.generator if isinstance(request.generator, torch.Generator) else None)
        sampled = self.sampler(logits, params, generators) if sampling_items else None

        token_ids: list[int | None] = []
        logprobs: list[float | None] = []
        top_logprobs: list[dict[int, float] | None] = []
        row = 0
        for item in scheduler_output.scheduled:
            if item.samples_token and sampled is not None:
                token_ids.append(sampled.token_ids[row])
                logprobs.append(sampled.logprobs[row] if sampled.logprobs is not None else None)
                top_logprobs.append(sampled.top_logprobs[row] if sampled.top_logprobs is not None else None)
                row += 1
            else:
                token_ids.append(None)
                logprobs.append(None)
                top_logprobs.append(None)
        return ModelRunnerOutput(token_ids, logprobs, top_logprobs)
