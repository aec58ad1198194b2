"""Turns a `SchedulerOutput` into one packed forward pass over the paged cache, then samples.

Prompt logprobs (SamplingParams.prompt_logprobs) come from the same forward pass: the rows of the
requests that ask are among its logits rows (engine.runner.inputs), and are reduced on the device to the
prompt token's logprob and the top alternatives before anything is copied to the host, so a long prompt
never brings vocabulary-wide rows to the host.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from engine.config import ContinuousBatchingConfig
from engine.families import num_key_value_heads
from engine.kv.layer_groups import KVCacheGroupSpec, attention_chunks
from engine.request import Request
from engine.runner.forward_paths import ForwardPaths
from engine.runner.inputs import BatchInputs, InputBuilder, PreviousTokens, PromptLogprobSpan
from engine.runner.kv_cache import HostKVCache, PagedKVCache
from engine.runner.recurrent.state_cache import StateCache
from engine.sampling.sampler import SampledTokens, Sampler, request_generator
from engine.scheduling.scheduler import SchedulerOutput
from engine.system.device_copies import HostCopies

logger = logging.getLogger(__name__)

# Prompt logprob rows are reduced this many at a time, which bounds the fp32 log_softmax's memory.
PROMPT_LOGPROB_ROWS_PER_SLICE = 1024


@dataclass
class StepTimings:
    """Seconds spent in each phase of the steps so far (host wall clock).

    On a GPU the forward pass is asynchronous: its time shows up where the host first waits for it,
    in sampling (the wait for the sampled tokens), so compare phases on the CPU or with
    CUDA_LAUNCH_BLOCKING=1.
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
class PromptLogprobs:
    """Prompt logprobs one step computed for one request: `entries[i]` is (the logprob of prompt token
    `first_position + 1 + i`, its top alternatives {token id: logprob})."""

    first_position: int
    entries: list[tuple[float, dict[int, float]]]

    def add_to(self, request: Request) -> None:
        """Appends the entries `request` does not hold yet. Steps resolve in order and every position
        from the first the request lacks is computed (its prompt never comes from the prefix cache past
        the logprobs it holds: engine.kv.cache_manager), so the entries continue its list; those it
        already holds, computed again by a recompute after preemption, are dropped."""
        collected = request.prompt_logprobs
        if collected is None:
            return
        skip = len(collected) - self.first_position
        if skip < 0:  # never: it would leave a gap in the list
            logger.error(
                "request %r: prompt logprobs from position %d arrived while it holds %d; dropped",
                request.request_id,
                self.first_position,
                len(collected),
            )
            return
        collected.extend(self.entries[skip:])


class PromptLogprobsOnDevice:
    """One step's prompt logprobs reduced on the device (the prompt token's logprob, the top-k values and
    ids), on their way to the host."""

    def __init__(self, logits: torch.Tensor, targets: torch.Tensor, spans: list[PromptLogprobSpan]) -> None:
        """`logits` [N, V]: the raw logits of the spans' rows, in order; `targets` [N]: the prompt token
        each row predicts."""
        self.spans = spans
        self.num_top = [span.request.sampling.prompt_logprobs or 0 for span in spans]
        max_top = max(self.num_top)
        chosen: list[torch.Tensor] = []
        top_values: list[torch.Tensor] = []
        top_ids: list[torch.Tensor] = []
        for start in range(0, logits.shape[0], PROMPT_LOGPROB_ROWS_PER_SLICE):
            stop = start + PROMPT_LOGPROB_ROWS_PER_SLICE
            log_probs = torch.log_softmax(logits[start:stop].float(), dim=-1)
            chosen.append(log_probs.gather(1, targets[start:stop].unsqueeze(1)).squeeze(1))
            if max_top:
                values, ids = log_probs.topk(max_top, dim=-1)
                top_values.append(values)
                top_ids.append(ids)
        tensors = [torch.cat(chosen)]
        if max_top:
            tensors.extend([torch.cat(top_values), torch.cat(top_ids)])
        self._copies = HostCopies(tensors)

    def to_host(self) -> list[tuple[Request, PromptLogprobs]]:
        """Waits for the copies; each span's request with its entries, in scheduling order."""
        chosen_tensor, *top = self._copies.wait()
        chosen = chosen_tensor.tolist()
        values, ids = (top[0].tolist(), top[1].tolist()) if top else ([], [])
        results = []
        row = 0
        for span, num_top in zip(self.spans, self.num_top, strict=True):
            entries = [
                (
                    chosen[index],
                    dict(zip(ids[index][:num_top], values[index][:num_top], strict=True)) if num_top else {},
                )
                for index in range(row, row + span.count)
            ]
            results.append((span.request, PromptLogprobs(span.first_position, entries)))
            row += span.count
        return results


@dataclass
class LaunchedStep:
    """A step whose work is queued on the device; `ModelRunner.resolve` waits for its tokens."""

    scheduler_output: SchedulerOutput
    sampled: SampledTokens | None
    # Row of each sampling request in `sampled.token_ids`.
    sampled_rows: dict[str, int]
    prompt_logprobs: PromptLogprobsOnDevice | None = None


@dataclass
class ModelRunnerOutput:
    # One entry per scheduled request, in scheduling order: the sampled token, or None when the
    # request only advanced through its prompt this step.
    token_ids: list[int | None]
    logprobs: list[float | None]
    top_logprobs: list[dict[int, float] | None]
    # The prompt logprobs of the requests that asked and had prompt positions in the step.
    prompt_logprobs: list[tuple[Request, PromptLogprobs]] = field(default_factory=list)
    # Per scheduled request, the log of the mass its sampled token's truncation kept, or None when no
    # request of the step asked (SamplingParams.return_kept_mass).
    log_kept_masses: list[float | None] = field(default_factory=list)


class ModelRunner:
    """Runs the model over the paged cache of every cache group.

    `kv_caches[g]` holds the layers `groups[g].layer_indices`, and `host_kv_caches[g]` (when CPU
    offload is on) its host copies. `state_cache` holds the recurrent layers' states (the cache group
    after the paged ones), which the engine's recurrent forwards read and write.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        groups: Sequence[KVCacheGroupSpec],
        kv_caches: Sequence[PagedKVCache],
        sampler: Sampler,
        config: ContinuousBatchingConfig,
        host_kv_caches: Sequence[HostKVCache] | None = None,
        state_cache: StateCache | None = None,
    ) -> None:
        self.model = model
        self.groups = list(groups)
        self.kv_caches = list(kv_caches)
        self.state_cache = state_cache
        self.sampler = sampler
        self.timings = StepTimings()
        # Padding rows (decode rows, or tokens of steps with prefill chunks) run by padded steps so far:
        # the compute static shapes cost.
        self.num_padding_rows = 0
        # Input ids fed from the previous step's tokens on the device, never seen by the host in time
        # (async batching): how often a step was prepared before its predecessor's tokens came back.
        self.num_placeholder_inputs = 0
        self.host_kv_caches = list(host_kv_caches) if host_kv_caches is not None else None
        self.device = kv_caches[0].device
        self.page_size = kv_caches[0].page_size
        # Recurrent layers read no KV: their entries keep the first group's caches, never used.
        num_state_layers = len(state_cache.group.layer_indices) if state_cache is not None else 0
        num_layers = sum(len(group.layer_indices) for group in groups) + num_state_layers
        self._layer_groups = [0] * num_layers
        self._key_caches: list[torch.Tensor] = [kv_caches[0].key_caches[0]] * num_layers
        self._value_caches: list[torch.Tensor] = [kv_caches[0].value_caches[0]] * num_layers
        for group_index, (group, cache) in enumerate(zip(groups, kv_caches, strict=True)):
            for local_index, layer in enumerate(group.layer_indices):
                self._layer_groups[layer] = group_index
                self._key_caches[layer] = cache.key_caches[local_index]
                self._value_caches[layer] = cache.value_caches[local_index]
        text_config = model.config.get_text_config()  # type: ignore[operator, union-attr]
        num_heads = text_config.num_attention_heads
        num_kv_heads = num_key_value_heads(text_config)
        if kv_caches[0].shape.values_are_keys:  # latent attention: every query head reads the one latent head
            num_kv_heads = 1
        self.forward_paths = ForwardPaths(model, config, self.device, self._key_caches[0].dtype)
        self.input_builder = InputBuilder(
            self.groups,
            self._key_caches,
            self._value_caches,
            self._layer_groups,
            self.page_size,
            num_heads // num_kv_heads,
            self._key_caches[0].dtype,
            self.device,
            self.forward_paths.attention_kernel,
            self.forward_paths.max_blocks_per_request,
            split_decode_rows=self.forward_paths.decode_runs_eagerly,
            fixed_order=config.batch_invariant,
            attention_chunks=attention_chunks(text_config),
            state_group=state_cache.group if state_cache is not None else None,
        )

    def capture_decode_graphs(self, max_rows: int) -> int:
        """Pre-captures decode CUDA graphs when they are on; returns how many exist."""
        empty = SchedulerOutput()
        return self.forward_paths.capture_decode_graphs(
            lambda padding, rows: self.input_builder.build(empty, padding, min_rows=rows), max_rows
        )

    def release_kv_cache(self) -> int:
        """Frees the storage of every group's cache tensors (sleep) and the CUDA graphs that hold their
        addresses; returns the bytes freed. The tensors stay: the per-layer lists see the memory again
        after `restore_kv_cache`."""
        released = sum(cache.release_storage() for cache in self._caches())
        self.forward_paths.drop_cuda_graphs()
        return released

    def restore_kv_cache(self) -> None:
        for cache in self._caches():
            cache.restore_storage()

    def _caches(self) -> list[PagedKVCache | StateCache]:
        """Every cache group's tensors, in group order (the state group's last)."""
        return [*self.kv_caches, self.state_cache] if self.state_cache is not None else list(self.kv_caches)

    def drop_cuda_graphs(self) -> None:
        """Forgets the captured graphs, which hold raw addresses of the weights (moved to host memory)."""
        self.forward_paths.drop_cuda_graphs()

    def make_stats(self) -> StepTimings:
        """Seconds per step phase since the runner was built, as a copy."""
        return replace(self.timings)

    def forward(self, inputs: BatchInputs) -> torch.Tensor:
        """Logits [L, V] of the rows in `inputs.logits_indices`: the rows that sample this step (those
        `inputs.sampled_logits` selects, or all of them), then prompt logprob rows."""
        return self.forward_paths.run(inputs)

    @torch.inference_mode()
    def _prompt_logprobs(self, inputs: BatchInputs, logits: torch.Tensor) -> PromptLogprobsOnDevice | None:
        if inputs.prompt_logits is None or inputs.prompt_targets is None:
            return None
        return PromptLogprobsOnDevice(
            logits.index_select(0, inputs.prompt_logits), inputs.prompt_targets, inputs.prompt_spans
        )

    def copy_blocks(self, scheduler_output: SchedulerOutput) -> None:
        """Forked sequences' copies first (their source blocks may be freed by this step's preemptions and
        refilled by its restores), then offloads before restores: a restore may land in a device block an
        offload just freed."""
        caches = self._caches()
        for fork in scheduler_output.block_copies:
            caches[fork.group].copy_blocks(list(fork.source_block_ids), list(fork.target_block_ids))
        if self.host_kv_caches is None:
            return
        for copy in scheduler_output.offloads:
            self.host_kv_caches[copy.group].offload(list(copy.device_block_ids), list(copy.host_block_ids))
        for copy in scheduler_output.restores:
            self.host_kv_caches[copy.group].restore(list(copy.device_block_ids), list(copy.host_block_ids))

    def launch(self, scheduler_output: SchedulerOutput, previous: LaunchedStep | None = None) -> LaunchedStep:
        """Queues one step's copies, forward pass and sampling without waiting for the device.

        `previous` is the step still running when this one was scheduled: requests scheduled for the
        position of a token it samples read that token from it on the device.
        """
        timings = self.timings
        started = time.perf_counter()
        self.copy_blocks(scheduler_output)
        previous_tokens = None
        if previous is not None and previous.sampled is not None:
            previous_tokens = PreviousTokens(previous.sampled.token_ids, previous.sampled_rows)
        inputs = self.input_builder.build(
            scheduler_output, self.forward_paths.padding, previous=previous_tokens
        )
        self.num_padding_rows += inputs.num_padding_rows
        self.num_placeholder_inputs += inputs.num_placeholder_inputs
        prepared = time.perf_counter()
        logits = self.forward(inputs)
        forwarded = time.perf_counter()
        timings.prepare_inputs_s += prepared - started
        timings.forward_s += forwarded - prepared
        # Before sampling, which may process its logits in place.
        prompt_logprobs = self._prompt_logprobs(inputs, logits)
        if inputs.sampled_logits is not None:
            logits = logits.index_select(0, inputs.sampled_logits)
        sampling_items = [item for item in scheduler_output.scheduled if item.samples_token]
        requests = [item.request for item in sampling_items]
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
        sampled = self.sampler.sample(logits, requests, generators) if sampling_items else None
        timings.sample_s += time.perf_counter() - forwarded
        rows = {item.request.request_id: row for row, item in enumerate(sampling_items)}
        return LaunchedStep(scheduler_output, sampled, rows, prompt_logprobs)

    def resolve(self, launched: LaunchedStep) -> ModelRunnerOutput:
        """Waits for a launched step's tokens; one entry per scheduled request, in scheduling order."""
        waiting = time.perf_counter()
        sampled = launched.sampled.to_output() if launched.sampled is not None else None
        prompt_logprobs = launched.prompt_logprobs.to_host() if launched.prompt_logprobs is not None else []
        token_ids: list[int | None] = []
        logprobs: list[float | None] = []
        top_logprobs: list[dict[int, float] | None] = []
        kept_masses = sampled.log_kept_masses if sampled is not None else None
        log_kept_masses: list[float | None] = []
        row = 0
        for item in launched.scheduler_output.scheduled:
            if item.samples_token and sampled is not None:
                token_ids.append(sampled.token_ids[row])
                logprobs.append(sampled.logprobs[row] if sampled.logprobs is not None else None)
                top_logprobs.append(sampled.top_logprobs[row] if sampled.top_logprobs is not None else None)
                log_kept_masses.append(kept_masses[row] if kept_masses is not None else None)
                row += 1
            else:
                token_ids.append(None)
                logprobs.append(None)
                top_logprobs.append(None)
                log_kept_masses.append(None)
        self.timings.sample_s += time.perf_counter() - waiting
        return ModelRunnerOutput(token_ids, logprobs, top_logprobs, prompt_logprobs, log_kept_masses)
