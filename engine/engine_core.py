"""`EngineCore`: one model, one cache, and the step `schedule() -> launch() -> resolve()`.

It is single-threaded (with async batching the device runs one step while the host prepares the
next); `ContinuousBatchingManager` owns the thread and the queues.
Tests drive it directly: `add_request`, then `step()` until `has_unfinished_requests()` is False.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

import torch

from engine.config import ContinuousBatchingConfig
from engine.errors import UnsupportedModelError
from engine.families import check_model_support, layer_kind_counts
from engine.kv.cache_manager import KVCacheManager, KVCacheStats
from engine.kv.events import KVCacheEvent
from engine.kv.offload import HostBlockPool
from engine.parallel import TensorParallelGroup, tensor_parallel_size
from engine.quantization.model import quantize_model
from engine.request import FIRST_WEIGHT_VERSION, FinishReason, Request, RequestStatus
from engine.runner import latent_attention
from engine.runner.attention import CBSERVE_ATTENTION_PREFIX, register_paged_attention
from engine.runner.batch_invariant import check_linear_invariance, check_table_width
from engine.runner.cache_plan import CachePlan, plan_cache
from engine.runner.kv_cache import HostKVCache, PagedKVCache
from engine.runner.model_runner import LaunchedStep, ModelRunner, StepTimings
from engine.runner.own_attention.registry import InstalledAdapters, unsupported_combination
from engine.runner.packed_linear import PackedLinears
from engine.runner.recurrent import RecurrentForwards, check_recurrent_support
from engine.runner.recurrent.state_cache import StateCache
from engine.sampling.params import SamplingParams
from engine.sampling.sampler import Sampler
from engine.sampling.structured_output import GrammarCompiler
from engine.scheduling.scheduler import Scheduler, SchedulerOutput, SchedulerStats
from engine.system.container_limits import default_num_threads
from engine.system.thread_budget import ThreadBudget
from engine.weights.sleep import move_weights, return_freed_memory

logger = logging.getLogger(__name__)

Result = TypeVar("Result")


@dataclass
class StepResult:
    # Requests that gained a token this step (streaming consumers want each of these).
    advanced: list[Request] = field(default_factory=list)
    # Requests that ended this step: finished, failed by scheduling, or failed with the step.
    finished: list[Request] = field(default_factory=list)
    num_scheduled_tokens: int = 0
    # Requests scheduled for the first time this step (they left the queue).
    num_newly_scheduled: int = 0


@dataclass(frozen=True)
class EngineStats:
    """The engine's counters, each part's made by that part (`EngineCore.make_stats`)."""

    scheduler: SchedulerStats
    kv_cache: KVCacheStats
    step_timings: StepTimings
    failed_steps: int


class KVCacheRelease(NamedTuple):
    """What freeing the KV cache did (`EngineCore.release_kv_cache`)."""

    bytes_released: int
    # Running requests put back in the queue, to be recomputed once the cache is back.
    num_requeued: int


def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


# Implementations that compute standard attention with other kernels: the engine's paged SDPA stands in
# for them (with its Triton kernel on the kernel path), so a model loaded for training with flash
# attention serves as it is.
_STANDS_IN_FOR_SDPA = (
    "flash_attention_2",
    "flash_attention_3",
    "flex_attention",
    "paged|flash_attention_2",
    "paged|flash_attention_3",
)


def cb_attention_implementation(current: str | None) -> str:
    """The paged implementation that stands in for `current` while the engine runs the model."""
    if current is not None and current.startswith(CBSERVE_ATTENTION_PREFIX):
        return current
    if current in (None, "sdpa", "paged|sdpa"):
        return f"{CBSERVE_ATTENTION_PREFIX}sdpa"
    if current in ("eager", "paged|eager"):
        return f"{CBSERVE_ATTENTION_PREFIX}eager"
    if current in _STANDS_IN_FOR_SDPA:
        logger.info(
            "attn_implementation %r: the engine runs cbserve's paged SDPA attention in its place (and its "
            "Triton kernel with max_blocks_per_request); the model gets %r back when the manager is "
            "destroyed",
            current,
            current,
        )
        return f"{CBSERVE_ATTENTION_PREFIX}sdpa"
    supported = ", ".join(repr(name) for name in ("sdpa", "eager", *_STANDS_IN_FOR_SDPA))
    raise ValueError(
        f"attn_implementation {current!r} is not supported by cbserve's engine; supported: {supported}"
    )


def packs_linear_weights(
    model: torch.nn.Module, config: ContinuousBatchingConfig, device: torch.device
) -> bool:
    """Whether the engine runs the model's large linear layers on packed weights (`pack_cpu_weights`):
    on the CPU, when no path compiles (torch.compile traces the model's own layers) and the model is not
    sharded (its layers' forwards are tensor-parallel ones)."""
    return (
        config.pack_cpu_weights
        and device.type == "cpu"
        and torch.backends.mkldnn.is_available()
        and all(config.compile_config_for(path) is None for path in ("varlen", "decode"))
        and tensor_parallel_size(model) == 1
    )


def use_async_batching(config: ContinuousBatchingConfig, device: torch.device) -> bool:
    """Whether steps are launched one ahead of their results (`use_async_batching`).

    Only an explicit request turns it on (None means off). On the CPU it runs the same steps with the
    same results and no overlap (the forward pass runs on the calling thread). Under tensor parallelism
    every rank launches and resolves the same steps at the same ticks (engine.loop.lockstep flushes on every
    rank where the driver does).
    """
    if not config.use_async_batching:
        return False
    if device.type == "cpu":
        logger.info(
            "use_async_batching on the CPU: steps run one ahead with the same results, but nothing overlaps "
            "(the forward pass runs on the calling thread) and each token is delivered one step later"
        )
    return True


def _allocate_caches(
    plan: CachePlan, config: ContinuousBatchingConfig, device: torch.device
) -> tuple[list[PagedKVCache], list[HostKVCache] | None]:
    """The paged cache of each group, and its host copy when CPU offload is on."""
    kv_caches = [
        PagedKVCache(
            plan.shape.for_layers(len(group.layer_indices)),
            count,
            config.page_size,
            device,
            populate=config.populate_kv_cache,
        )
        for group, count in zip(plan.kv_cache_groups, plan.num_blocks, strict=True)
    ]
    if not plan.num_host_blocks:
        return kv_caches, None
    return kv_caches, [HostKVCache(cache, plan.num_host_blocks) for cache in kv_caches]


def _kv_cache_manager(plan: CachePlan, config: ContinuousBatchingConfig) -> KVCacheManager:
    if plan.has_sliding_layers and config.allow_block_sharing:
        logger.info(
            "prefix caching is off: the model has sliding-window layers, whose blocks cannot be shared"
        )
    elif plan.state_group is not None and config.allow_block_sharing:
        logger.info(
            "prefix caching is off: the model's %s layers keep a state of the whole prefix, which a cache "
            "hit would skip computing",
            plan.state_group.kind,
        )
    shares_prefixes = not plan.has_sliding_layers and plan.state_group is None
    return KVCacheManager(
        plan.num_blocks,
        config.page_size,
        enable_prefix_caching=config.allow_block_sharing and shares_prefixes,
        sliding_windows=[group.sliding_window for group in plan.kv_cache_groups],
        num_state_slots=plan.num_state_slots,
    )


class EngineCore:
    """The engine's front door: its callers (the loop, the manager) use these methods, never the parts
    (scheduler, cache manager, runner) behind them, and each part makes its own stats (`make_stats`).

    `parallel`: this rank's tensor-parallel group when the model is sharded. Every rank then builds
    the same cache (the smallest any rank affords) and samples with the same seed (see engine.parallel).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        config: ContinuousBatchingConfig,
        parallel: TensorParallelGroup | None = None,
    ) -> None:
        check_model_support(model.config, type(model).__name__)
        latent_attention.check_combination(model, config, tensor_parallel_size(model))
        combination = unsupported_combination(model, config, tensor_parallel_size(model))
        if combination is not None:
            raise UnsupportedModelError(f"cbserve cannot serve {type(model).__name__}: {combination}")
        self.model = model
        self.config = config
        self.device = model_device(model)
        self.vocab_size: int = model.config.get_text_config().vocab_size  # type: ignore[operator, union-attr]
        # Quantized before packing, which then takes the linear layers that stay full precision.
        quantize_model(model, config.quantization, config.quantize_activations)
        packs = packs_linear_weights(model, config, self.device)
        if config.batch_invariant:
            check_linear_invariance(model, packed=packs)
        # Packed before the cache is sized, so that free memory is measured with the packed copies.
        self.packed_linears = (
            PackedLinears(
                model,
                min_elements=0 if config.batch_invariant else None,
            )
            if packs
            else None
        )
        # Filled by the build; empty if it fails first, when release_model has no cache to stop.
        self.kv_caches: list[PagedKVCache] = []
        self.recurrent_forwards: RecurrentForwards | None = None
        # Taken off again by release_model, like the packed linear layers.
        self.attention_adapters = InstalledAdapters(model)
        try:
            self._build_cache_and_runner(model, config, parallel)
        except BaseException:
            self.release_model()  # a failed build leaves the model as it was
            raise
        self.async_batching = use_async_batching(config, self.device)
        # Intra-op threads of whichever thread runs the steps (`run_steps_thread`).
        self.num_threads = config.num_threads or default_num_threads(torch.get_num_threads())
        # Fewer threads while other processes keep some of the CPUs busy, unless a count was configured,
        # the results must not depend on the thread count (a reduction split over threads may not), or a
        # path is compiled: torch.compile's graphs are specialised to the thread count, so a change would
        # recompile in the middle of serving (measured: the varlen path twice more beside a busy process).
        compiled = any(config.compile_config_for(path) is not None for path in ("varlen", "decode"))
        self.thread_budget = ThreadBudget(
            self.num_threads,
            adaptive=self.device.type == "cpu"
            and config.num_threads is None
            and not config.batch_invariant
            and not compiled,
        )
        # The step launched but not yet resolved (async batching only).
        self._in_flight: _StepInFlight | None = None
        self.requests: dict[str, Request] = {}
        self.num_failed_steps = 0
        # Version of the weights in the model, stamped on every token (`begin_weight_version`).
        self.weight_version = FIRST_WEIGHT_VERSION
        # Structured output's grammars, for the tokenizer's vocabulary (set_tokenizer); None: no tokenizer.
        self.grammars: GrammarCompiler | None = None
        register_paged_attention()

    def _build_cache_and_runner(
        self, model: torch.nn.Module, config: ContinuousBatchingConfig, parallel: TensorParallelGroup | None
    ) -> None:
        """The cache plan, the caches, their manager, the scheduler and the runner."""
        plan = plan_cache(model, config, tensor_parallel_size(model), parallel)
        check_recurrent_support(model, plan.state_group, config, tensor_parallel_size(model))
        text_config = model.config.get_text_config()  # type: ignore[operator, union-attr]
        logger.info("%s: %s layers", type(model).__name__, layer_kind_counts(text_config))
        if config.batch_invariant:
            check_table_width(config, plan.max_model_len)
        self.max_model_len = plan.max_model_len
        self.max_requests_per_batch = plan.max_requests_per_batch
        self.max_batch_tokens = plan.max_batch_tokens
        self.kv_cache_groups = plan.kv_cache_groups
        self.has_sliding_layers = plan.has_sliding_layers
        self.kv_caches, self.host_kv_caches = _allocate_caches(plan, config, self.device)
        state_cache = None
        if plan.state_group is not None:
            state_cache = StateCache(plan.state_group, plan.num_state_slots, plan.shape.dtype, self.device)
            self.recurrent_forwards = RecurrentForwards(model, [state_cache])
        self.kv_cache_manager = _kv_cache_manager(plan, config)
        self.scheduler = Scheduler(
            self.kv_cache_manager,
            max_batch_tokens=plan.max_batch_tokens,
            max_requests_per_batch=plan.max_requests_per_batch,
            safety_margin=config.resolved_safety_margin(),
            policy=config.scheduler_type,
            max_model_len=plan.max_model_len,
            host_block_pool=HostBlockPool(plan.num_host_blocks) if plan.num_host_blocks else None,
        )
        self.runner = ModelRunner(
            model,
            self.kv_cache_groups,
            self.kv_caches,
            Sampler(self.device, plan.seed),
            config,
            self.host_kv_caches,
            state_cache,
        )

    @property
    def hold_admission(self) -> bool:
        """While True (a WAIT pause is pending), requests never scheduled stay queued; in-flight ones run."""
        return self.scheduler.hold_new_admissions

    @hold_admission.setter
    def hold_admission(self, value: bool) -> None:
        self.scheduler.hold_new_admissions = value

    def add_request(self, request: Request) -> bool:
        """Queues `request` and its `pending_forks` (n > 1), which admission took (engine.loop.admission.admit
        decided that they fit), or fails them all at once (returns False) when a grammar does not compile:
        a tensor-parallel rank that replays the request compiles its grammar again here."""
        sequences = [request, *request.pending_forks]
        error = None
        try:
            for sequence in sequences:
                self.init_structured_output(sequence)
        except ValueError as exc:
            error = str(exc)
        if error is not None:
            for sequence in sequences:
                sequence.finish(RequestStatus.FAILED, FinishReason.ERROR, error)
            return False
        for sequence in sequences:
            self.requests[sequence.request_id] = sequence
        self.scheduler.add_request(request)
        return True

    def set_tokenizer(self, tokenizer: Any) -> None:
        """The tokenizer whose vocabulary structured output's grammars are compiled for (None: none)."""
        self.grammars = GrammarCompiler(tokenizer, self.vocab_size) if tokenizer is not None else None

    def init_structured_output(self, request: Request) -> None:
        """Gives a request with `structured_output` its grammar matcher (the grammar compiled once per spec);
        ValueError when the grammar does not compile or no tokenizer is known. Safe on any thread."""
        if request.sampling.structured_output is None or request.structured_state is not None:
            return
        grammars = self.grammars
        if grammars is None:
            raise ValueError(
                "structured_output needs the model's tokenizer: pass tokenizer= to ContinuousBatchingManager "
                "or call its set_tokenizer()"
            )
        request.structured_state = grammars.new_state(request)

    def cancel_request(self, request_id: str) -> Request | None:
        """Cancels a live request and frees its blocks; returns it, or None if it is not live."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        self.scheduler.finish_request(request, RequestStatus.CANCELLED, FinishReason.CANCELLED)
        self.scheduler.remove_finished_running()
        return request

    def fail_all(self, error: str) -> list[Request]:
        # The step in flight only holds rows of these requests: its tokens are dropped with them.
        self._in_flight = None
        failed = []
        for request in list(self.requests.values()):
            self.scheduler.finish_request(request, RequestStatus.FAILED, FinishReason.ERROR, error)
            failed.append(request)
        self.requests.clear()
        self.scheduler.remove_finished_running()
        return failed

    def release_model(self) -> None:
        """Gives the model its own linear and attention forwards back and stops the cache's background work
        (the engine is done with them)."""
        if self.packed_linears is not None:
            self.packed_linears.restore()
            self.packed_linears = None
        if self.recurrent_forwards is not None:
            self.recurrent_forwards.restore()
            self.recurrent_forwards = None
        self.attention_adapters.restore()
        for cache in self.kv_caches:
            cache.close()

    # ------------------------------------------------------------------ operations

    @property
    def prefix_caching_enabled(self) -> bool:
        return self.kv_cache_manager.enable_prefix_caching

    @property
    def max_tokens_per_request(self) -> int | None:
        """The most tokens (prompt + generated) one request can ever hold: the smaller of the whole KV
        cache and the model's positions; None when neither bounds it."""
        bounds = [bound for bound in (self.kv_cache_manager.capacity_tokens, self.max_model_len) if bound]
        return min(bounds) if bounds else None

    def reset_prefix_cache(self) -> int:
        """Drops the prefix cache (its KV was computed by weights now replaced, or is not wanted); returns
        how many blocks it held. Blocks live requests hold are never shared again."""
        return self.kv_cache_manager.reset_prefix_cache()

    def begin_weight_version(self, weight_version: int) -> None:
        """New weights are in the model (the caller flushed the step in flight before writing them): tokens
        from now on carry `weight_version`, the prefix cache drops the old weights' blocks and keys new
        ones by it, and the requests that asked for it recompute their KV under the new weights."""
        assert self._in_flight is None, "flush the step in flight before changing the weights"
        self.weight_version = weight_version
        self.kv_cache_manager.begin_weight_version(weight_version)
        num_recomputing = self.scheduler.recompute_after_weight_update()
        if num_recomputing:
            logger.info(
                "%d requests recompute their KV under weight_version %d", num_recomputing, weight_version
            )

    def record_kv_events(self) -> None:
        """From now on, keeps the prefix cache's changes for `take_kv_events` (engine.kv.events)."""
        self.kv_cache_manager.record_kv_events()

    def take_kv_events(self) -> list[KVCacheEvent]:
        return self.kv_cache_manager.take_kv_events()

    def make_stats(self) -> EngineStats:
        return EngineStats(
            scheduler=self.scheduler.make_stats(),
            kv_cache=self.kv_cache_manager.make_stats(),
            step_timings=self.runner.make_stats(),
            failed_steps=self.num_failed_steps,
        )

    def warm_up(self, prompt_length: int) -> None:
        """Runs two tiny requests through the engine so that the first real step is not slow, captures the
        decode CUDA graphs of every batch size when graphs are on, and leaves no trace in the prefix cache
        or its counters. Runs on a steps thread (`call_on_steps_thread`), with no request live.

        The first request runs alone (a varlen step sampling one row), then the second joins it (a varlen
        step sampling two), then decode steps of two rows and of one: a compiled forward meets every shape
        class before real requests arrive. Dynamic compilation specialises sizes 0 and 1, rows and
        block-table widths alike, so `prompt_length` should reach a second page: with tables one page wide,
        the first request past its first page would compile again in the middle of serving. The prompts
        differ, so that the second's prefill is not a prefix-cache hit of one token.
        """
        first, second = (
            Request(f"__warmup_{index}__", [index] * prompt_length, SamplingParams(max_new_tokens=3))
            for index in range(2)
        )
        self.add_request(first)
        self.step()
        self.add_request(second)
        while self.has_unfinished_requests():
            self.step()
        self.runner.capture_decode_graphs(self.max_requests_per_batch)
        self.kv_cache_manager.reset_prefix_cache()
        self.kv_cache_manager.reset_prefix_cache_stats()

    def release_kv_cache(self) -> KVCacheRelease:
        """Sleep, level 1: puts every running request back in the queue to be recomputed, drops the prefix
        cache and frees the cache tensors' storage (and the CUDA graphs that hold its addresses). The
        caller has flushed the step in flight."""
        assert self._in_flight is None, "flush the step in flight before freeing the KV cache"
        num_requeued = self.scheduler.preempt_all_for_recompute()
        self.kv_cache_manager.reset_prefix_cache()
        released = self.runner.release_kv_cache()
        return_freed_memory(self.device)
        logger.info("KV cache freed: %.1f MiB", released / 2**20)
        return KVCacheRelease(released, num_requeued)

    def restore_kv_cache(self) -> None:
        """Gives the cache tensors their storage back (uninitialised, as at start, but the null block)."""
        self.runner.restore_kv_cache()

    def offload_weights(self) -> int:
        """Sleep, level 2: the weights to host memory, or on the CPU (where they live already) their
        packed copies freed, which the layers make again on their first step after waking;
        returns the bytes freed. The caller has flushed the step in flight."""
        assert self._in_flight is None, "flush the step in flight before moving the weights"
        if self.device.type == "cpu":
            freed = self.packed_linears.drop_copies() if self.packed_linears is not None else 0
            return_freed_memory(self.device)
            logger.info("packed copies of the weights freed: %.1f MiB", freed / 2**20)
            return freed
        moved = move_weights(self.model, torch.device("cpu"))
        self.runner.drop_cuda_graphs()  # they hold the weights' device addresses
        return_freed_memory(self.device)
        logger.info("weights moved to host memory: %.1f MiB", moved / 2**20)
        return moved

    def reload_weights(self) -> None:
        """The weights back on the engine's device after `offload_weights`."""
        if self.device.type != "cpu":
            move_weights(self.model, self.device)

    def _release_host_blocks(self) -> None:
        if self.scheduler.host_block_pool is not None:
            self.scheduler.host_block_pool.release_pending()

    def has_unfinished_requests(self) -> bool:
        """Whether a step remains to run or to be resolved."""
        return self._in_flight is not None or self.scheduler.has_unfinished_requests()

    def has_in_flight_requests(self) -> bool:
        """Whether a request that was scheduled at least once (running, or preempted) has not ended."""
        if self.scheduler.running or self._in_flight is not None:
            return True
        return self.scheduler.has_preempted_waiting()

    @property
    def has_step_in_flight(self) -> bool:
        return self._in_flight is not None

    def step(self) -> StepResult:
        """Schedules and runs one step.

        With async batching the step is only launched, and the result returned is that of the step
        launched before it, which ran while this one was scheduled and prepared: the host's work for
        step N+1 overlaps the device's for step N, and the host waits for N only once N+1 is queued.
        """
        result = StepResult()
        threads = self.thread_budget.update()
        if torch.get_num_threads() != threads:  # per thread: a new steps thread starts at the maximum
            torch.set_num_threads(threads)
        launched = self._schedule_and_launch(result)
        self._resolve_in_flight(result)
        if launched is not None:
            if self.async_batching:
                self._in_flight = launched
            else:
                self._resolve(launched, result)
        return result

    def flush(self) -> StepResult:
        """Waits for the step in flight (async batching) and returns its result; an empty one if none."""
        result = StepResult()
        self._resolve_in_flight(result)
        return result

    def _resolve_in_flight(self, result: StepResult) -> None:
        previous, self._in_flight = self._in_flight, None
        if previous is not None:
            self._resolve(previous, result)

    def _schedule_and_launch(self, result: StepResult) -> _StepInFlight | None:
        timings = self.runner.timings
        started = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        timings.schedule_s += time.perf_counter() - started
        now = time.time()
        for failed in scheduler_output.failed:
            self.requests.pop(failed.request_id, None)
            result.finished.append(failed)
        if not scheduler_output.scheduled:
            if scheduler_output.block_copies:  # sequences forked now, scheduled in a later step
                self.runner.copy_blocks(scheduler_output)
            return None
        for item in scheduler_output.scheduled:
            if item.request.scheduled_time is None:
                item.request.scheduled_time = now
                result.num_newly_scheduled += 1
        result.num_scheduled_tokens = scheduler_output.num_batched_tokens
        previous = self._in_flight.launched if self._in_flight is not None else None
        try:
            launched = self.runner.launch(scheduler_output, previous)
        except Exception as exc:  # a bad step fails its own requests, never the engine
            self._fail_step(scheduler_output, exc, result)
            return None
        self._release_host_blocks()
        return _StepInFlight(launched, self.weight_version)

    def _resolve(self, step: _StepInFlight, result: StepResult) -> None:
        """Folds a launched step's tokens into its requests (waiting for them) and into `result`."""
        scheduler_output = step.launched.scheduler_output
        try:
            runner_output = self.runner.resolve(step.launched)
        except Exception as exc:  # the device failed the step: its requests fail, the engine goes on
            self._fail_step(scheduler_output, exc, result)
            return
        timings = self.runner.timings
        updating = time.perf_counter()
        timings.num_steps += 1
        for request, prompt_logprobs in runner_output.prompt_logprobs:
            prompt_logprobs.add_to(request)
        advanced = self.scheduler.update_from_output(scheduler_output, runner_output.token_ids)
        now = time.time()
        for item, logprob, top, log_kept_mass in zip(
            scheduler_output.scheduled,
            runner_output.logprobs,
            runner_output.top_logprobs,
            runner_output.log_kept_masses,
            strict=True,
        ):
            request = item.request
            if logprob is not None and request.sampling.logprobs:
                request.logprobs.append(logprob)
            if top is not None and request.sampling.top_logprobs:
                request.top_logprobs.append(top)
            if log_kept_mass is not None and request.sampling.return_kept_mass:
                request.log_kept_masses.append(log_kept_mass)
        for item in advanced:
            request = item.request
            request.weight_version = step.weight_version
            if request.first_token_time is None:
                request.first_token_time = now
            if request.record_timestamps:
                request.timestamps.append(now)
            result.advanced.append(request)
            if request.is_finished:
                self.requests.pop(request.request_id, None)
                result.finished.append(request)
        timings.update_s += time.perf_counter() - updating

    def _fail_step(self, scheduler_output: SchedulerOutput, exc: Exception, result: StepResult) -> None:
        live = [item.request for item in scheduler_output.scheduled if not item.request.is_finished]
        failed_ids = {request.request_id for request in live}
        # Sequences forked (n > 1) from KV this step was to copy or to write fail with it: with async
        # batching they may already run in the next step, reading that KV.
        forked_ids = {request.request_id for request in scheduler_output.forked}
        for request in [*scheduler_output.forked, *self.requests.values()]:
            source = request.fork_source
            from_failed = source is not None and source.request_id in failed_ids
            if request.is_finished or request.request_id in failed_ids:
                continue
            if request.request_id in forked_ids or from_failed:
                live.append(request)
                failed_ids.add(request.request_id)
        logger.error(
            "engine step failed; failing the %d requests in it",
            len(live),
            exc_info=(type(exc), exc, exc.__traceback__),
        )
        self.num_failed_steps += 1
        error = f"engine step failed: {type(exc).__name__}: {exc}"
        for request in live:
            self.scheduler.finish_request(request, RequestStatus.FAILED, FinishReason.ERROR, error)
            self.requests.pop(request.request_id, None)
            result.finished.append(request)
        self.scheduler.remove_finished_running()
        # Blocks registered for this step may never have been written, nor offloads copied.
        self.kv_cache_manager.reset_prefix_cache()
        self.scheduler.forget_offloads(scheduler_output)
        self._release_host_blocks()


def run_steps_thread(target: Callable[[], None], num_threads: int, name: str) -> threading.Thread:
    """Starts the thread that runs engine steps, with `num_threads` intra-op threads set in it (the count
    is per thread). Steps run only on such threads, never on a caller's: on the CPU a caller's thread that
    had run them kept an OpenMP team whose idle workers made a later loop thread's steps 1.5x slower."""

    def run() -> None:
        torch.set_num_threads(num_threads)
        target()

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


def call_on_steps_thread(function: Callable[[], Result], num_threads: int, name: str) -> Result:
    """`function()` on a thread of `run_steps_thread`'s, waited for: its result is returned and its
    exception raised here. The thread ends with the call, and its OpenMP team with it.

    For any torch work beside a running engine on the CPU (loading a model, converting weights): a torch
    op large enough to run in parallel leaves the thread that ran it an OpenMP team for as long as that
    thread lives, and once the process holds more OpenMP threads than cores libgomp stops its workers
    spinning, so each of a step's parallel regions waits for them to wake (1.7x slower steps measured).
    """
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["result"] = function()
        except BaseException as error:
            outcome["error"] = error

    run_steps_thread(run, num_threads, name).join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


@dataclass
class _StepInFlight:
    launched: LaunchedStep
    # The weights that compute it (a weight update first waits for the step in flight).
    weight_version: int
