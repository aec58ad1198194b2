"""Turns a `SchedulerOutput` into one packed forward pass over the paged cache, then samples."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.kv.block_pool import NULL_BLOCK_ID
from engine.kv.cache_manager import KVCacheManager
from engine.kv.layer_groups import KVCacheGroupSpec
from engine.request import SamplingParams
from engine.runner.attention import GroupSlots, PagedAttentionMetadata, PrefillSegment
from engine.runner.kv_cache import HostKVCache, PagedKVCache
from engine.sampling import Sampler, request_generator
from engine.scheduler import SchedulerOutput


@dataclass
class StepTimings:
    """Seconds spent in each phase of the steps so far (host wall clock).

    On a GPU the forward pass is asynchronous: its time shows up where the host first waits for it,
    in sampling (`.tolist()`), so compare phases on the CPU or with CUDA_LAUNCH_BLOCKING=1.
    """

    schedule_s: float = 0.0
    prepare_inputs_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0
    update_s: float = 0.0
    num_steps: int = 0

    def as_dict(self) -> dict[str, float]:
        return {name: round(value, 4) for name, value in vars(self).items()}


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
    """Runs the model over the paged cache of every cache group.

    `kv_caches[g]` holds the layers `groups[g].layer_indices`, and `host_kv_caches[g]` (when CPU
    offload is on) its host copies.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        groups: Sequence[KVCacheGroupSpec],
        kv_caches: Sequence[PagedKVCache],
        kv_cache_manager: KVCacheManager,
        sampler: Sampler,
        host_kv_caches: Sequence[HostKVCache] | None = None,
    ) -> None:
        self.model = model
        self.groups = list(groups)
        self.kv_caches = list(kv_caches)
        self.kv_cache_manager = kv_cache_manager
        self.sampler = sampler
        self.timings = StepTimings()
        self.host_kv_caches = list(host_kv_caches) if host_kv_caches is not None else None
        self.device = kv_caches[0].device
        self.page_size = kv_caches[0].page_size
        num_layers = sum(len(group.layer_indices) for group in groups)
        self._layer_groups = [0] * num_layers
        self._key_caches: list[torch.Tensor] = [kv_caches[0].key_caches[0]] * num_layers
        self._value_caches: list[torch.Tensor] = [kv_caches[0].value_caches[0]] * num_layers
        for group_index, (group, cache) in enumerate(zip(groups, kv_caches, strict=True)):
            for local_index, layer in enumerate(group.layer_indices):
                self._layer_groups[layer] = group_index
                self._key_caches[layer] = cache.key_caches[local_index]
                self._value_caches[layer] = cache.value_caches[local_index]
        self._placeholder_mask = torch.zeros(1, 1, 0, 0, device=self.device)

    def prepare_inputs(self, scheduler_output: SchedulerOutput) -> BatchInputs:
        input_ids: list[int] = []
        positions: list[int] = []
        logits_indices: list[int] = []
        decode_rows: list[int] = []
        decode_lengths: list[int] = []
        prefill: list[PrefillSegment] = []
        decode_items: list[tuple[str, int]] = []  # (request id, first new position)
        prefill_items: list[tuple[str, int, int]] = []  # (request id, first new position, end)
        for item in scheduler_output.scheduled:
            request = item.request
            start, end = item.num_computed_tokens, item.num_computed_tokens + item.num_new_tokens
            row = len(input_ids)
            input_ids.extend(request.all_token_ids[start:end])
            positions.extend(range(start, end))
            if item.samples_token:
                logits_indices.append(row + item.num_new_tokens - 1)
            if item.num_new_tokens == 1:
                decode_rows.append(row)
                decode_lengths.append(end)
                decode_items.append((request.request_id, start))
            else:
                prefill.append(PrefillSegment(row, row + item.num_new_tokens, start))
                prefill_items.append((request.request_id, start, end))

        device = self.device
        lengths = torch.tensor(decode_lengths, dtype=torch.long, device=device) if decode_rows else None
        metadata = PagedAttentionMetadata(
            key_caches=self._key_caches,
            value_caches=self._value_caches,
            layer_groups=self._layer_groups,
            groups=[
                self._group_slots(index, scheduler_output, decode_items, lengths, prefill_items)
                for index in range(len(self.groups))
            ],
            decode_rows=torch.tensor(decode_rows, dtype=torch.long, device=device) if decode_rows else None,
            decode_lengths=lengths,
            prefill_segments=prefill,
            decode_rows_are_all_rows=not prefill,
        )
        return BatchInputs(
            input_ids=torch.tensor([input_ids], dtype=torch.long, device=device),
            position_ids=torch.tensor([positions], dtype=torch.long, device=device),
            logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=device),
            metadata=metadata,
        )

    def _first_key_position(self, group: int, first_query_position: int) -> int:
        """The first position any query from `first_query_position` on may attend to in `group`."""
        window = self.groups[group].sliding_window
        return 0 if window is None else max(0, first_query_position - window + 1)

    def _group_slots(
        self,
        group: int,
        scheduler_output: SchedulerOutput,
        decode_items: list[tuple[str, int]],
        decode_lengths: torch.Tensor | None,
        prefill_items: list[tuple[str, int, int]],
    ) -> GroupSlots:
        page_size = self.page_size
        device = self.device
        manager = self.kv_cache_manager
        write_slots: list[int] = []
        for item in scheduler_output.scheduled:
            table = manager.block_ids(item.request.request_id, group)
            start, end = item.num_computed_tokens, item.num_computed_tokens + item.num_new_tokens
            write_slots.extend(table[p // page_size] * page_size + p % page_size for p in range(start, end))
        slots = GroupSlots(
            write_slots=torch.tensor(write_slots, dtype=torch.long, device=device),
            decode_key_slots=None,
            decode_first_key_positions=None,
            prefill_key_slots=[],
            prefill_first_key_positions=[],
        )
        if decode_items:
            assert decode_lengths is not None
            tables = [manager.block_ids(request_id, group) for request_id, _ in decode_items]
            firsts = [self._first_key_position(group, start) for _, start in decode_items]
            first_positions = torch.tensor(firsts, dtype=torch.long, device=device)
            slots.decode_first_key_positions = first_positions
            slots.decode_key_slots = self._padded_slots(tables, first_positions, decode_lengths)
        for request_id, start, end in prefill_items:
            table = manager.block_ids(request_id, group)
            first = self._first_key_position(group, start)
            first_page = first // page_size
            blocks = torch.tensor(table[first_page : -(-end // page_size)], dtype=torch.long, device=device)
            page_slots = (blocks.unsqueeze(1) * page_size + torch.arange(page_size, device=device)).flatten()
            offset = first - first_page * page_size
            slots.prefill_key_slots.append(page_slots[offset : offset + end - first])
            slots.prefill_first_key_positions.append(first)
        return slots

    def _padded_slots(
        self, tables: list[list[int]], first_positions: torch.Tensor, lengths: torch.Tensor
    ) -> torch.Tensor:
        """[B, max_keys] cache slots of each decode row's keys, from its first key position to its
        length; slots past a row's length read the null block."""
        page_size = self.page_size
        num_pages = max(len(table) for table in tables)
        padded = [table + [NULL_BLOCK_ID] * (num_pages - len(table)) for table in tables]
        block_table = torch.tensor(padded, dtype=torch.long, device=self.device)
        max_keys = int((lengths - first_positions).max())
        key_positions = first_positions.unsqueeze(1) + torch.arange(max_keys, device=self.device)
        past_length = key_positions >= lengths.unsqueeze(1)
        key_positions = key_positions.masked_fill(past_length, 0)
        blocks = torch.gather(block_table, 1, key_positions // page_size)
        slots = blocks * page_size + key_positions % page_size
        # Slots past the length may hold bytes never written; NaN there would survive a -inf mask.
        return slots.masked_fill_(past_length, NULL_BLOCK_ID * page_size)

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
        if self.host_kv_caches is None:
            return
        for copy in scheduler_output.offloads:
            self.host_kv_caches[copy.group].offload(list(copy.device_block_ids), list(copy.host_block_ids))
        for copy in scheduler_output.restores:
            self.host_kv_caches[copy.group].restore(list(copy.device_block_ids), list(copy.host_block_ids))

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        timings = self.timings
        started = time.perf_counter()
        self.copy_blocks(scheduler_output)
        inputs = self.prepare_inputs(scheduler_output)
        prepared = time.perf_counter()
        logits = self.forward(inputs)
        forwarded = time.perf_counter()
        timings.prepare_inputs_s += prepared - started
        timings.forward_s += forwarded - prepared
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
        timings.sample_s += time.perf_counter() - forwarded
        return ModelRunnerOutput(token_ids, logprobs, top_logprobs)
