"""`ContinuousBatchingManager`: the engine's user-facing lifecycle, submissions and results.

The manager validates what callers pass and posts it to the generation loop
(engine.loop.generation_loop), which owns the engine on a thread of its own; outputs come back through
the `OutputRouter`. Whether a request is taken is decided once, by `engine.loop.admission.admit`; weight
updates, the trainer's group and sleep go through a composed `engine.weights.operations.WeightsAndMemory`,
whose methods the manager forwards with their signatures unchanged.

    add_request / cancel_request ──> GenerationLoop: engine.step() ──> OutputRouter ──> get_result,
    pause / update_weights                                                          request_id_iter,
                                                                                    result handlers
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from engine.config import ContinuousBatchingConfig
from engine.engine_core import EngineCore, call_on_steps_thread, cb_attention_implementation
from engine.families import check_model_support
from engine.kv.events import KVCacheEvent
from engine.loop.admission import RejectionReason, build_request
from engine.loop.commands import PauseHandle, PauseMode, PrefixCacheReset, SleepOutcome
from engine.loop.generation_loop import IDLE_WAIT_S, GenerationLoop
from engine.loop.listeners import LoopListeners
from engine.loop.lockstep import generation_loop_for
from engine.loop.output_router import OutputRouter
from engine.parallel import DRIVER_RANK, TensorParallelGroup, global_rank, tensor_parallel_size
from engine.request import GenerationOutput, KVOnWeightUpdate
from engine.sampling.params import SamplingParams, build_sampling_params
from engine.stats import ManagerStats
from engine.system.container_limits import default_num_threads
from engine.weights.checksum import WeightsChecksum
from engine.weights.cuda_ipc import CudaIpcHandle
from engine.weights.operations import WeightsAndMemory
from engine.weights.transfer import DEFAULT_GROUP_NAME, DEFAULT_GROUP_TIMEOUT_S, BucketPlan, JoinedGroup

logger = logging.getLogger(__name__)


class ContinuousBatchingManager:
    """Submits requests to a background generation loop and hands their results back.

    Create it with `init_continuous_batching`, `continuous_batching_context_manager` or
    `generate_batch` (engine.api), or directly.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        generation_config: Any = None,
        continuous_batching_config: ContinuousBatchingConfig | None = None,
        tokenizer: Any = None,
    ) -> None:
        self.model = model
        # The model's tokenizer: structured output compiles its grammars for its vocabulary.
        self._tokenizer = tokenizer
        self.generation_config = generation_config or getattr(model, "generation_config", None)
        self.config = continuous_batching_config or ContinuousBatchingConfig()
        self.config.validate()
        self._engine: EngineCore | None = None
        self._loop: GenerationLoop | None = None
        self._router = OutputRouter()
        self._destroyed = False
        self._id_counter = itertools.count()
        self._original_attn_implementation: str | None = None
        self._listeners = LoopListeners()
        self.warmed_up = False
        # Tensor parallelism: only the driver (rank 0) takes requests; the group is made with the engine.
        self.is_driver = tensor_parallel_size(model) == 1 or global_rank() == DRIVER_RANK
        self._weights = WeightsAndMemory(model, self.is_driver, self._running_loop, self._built_loop)

    # ------------------------------------------------------------------ lifecycle

    def switch_to_cb_friendly_attn(self, model: torch.nn.Module, auto_switch_to_flash: bool = True) -> None:
        """Swaps the model's attention for the paged one (idempotent; `destroy` restores the original).

        `auto_switch_to_flash` is accepted for API compatibility and changes nothing: cbserve has no flash
        kernel, so a model loaded with a flash implementation runs cbserve's paged SDPA
        (`cb_attention_implementation`).
        """
        current: str | None = model.config._attn_implementation  # type: ignore[union-attr, assignment]
        target = cb_attention_implementation(current)
        if target != current:
            from engine.runner.attention import register_paged_attention

            register_paged_attention()
            model.set_attn_implementation(target)  # type: ignore[operator]
            if self._original_attn_implementation is None:
                self._original_attn_implementation = current

    def _ensure_engine(self) -> EngineCore:
        if self._destroyed:
            raise RuntimeError("this ContinuousBatchingManager was destroyed; create a new one")
        if self._engine is None:
            # Before the attention switch, which some refused families fail in ways that name no reason.
            check_model_support(self.model.config, type(self.model).__name__)
            self.switch_to_cb_friendly_attn(self.model, self.config.auto_switch_to_flash)
            engine, self._loop = _build_engine(self.model, self.config, self._router, self._listeners)
            engine.set_tokenizer(self._tokenizer)
            self._engine = engine
        return self._engine

    def set_tokenizer(self, tokenizer: Any) -> None:
        """The model's tokenizer, which requests with `structured_output` need (their grammars are compiled
        for its vocabulary); requests already added keep the grammars they have."""
        self._tokenizer = tokenizer
        if self._engine is not None:
            self._engine.set_tokenizer(tokenizer)

    def _built_loop(self) -> GenerationLoop | None:
        return self._loop

    def _running_loop(self) -> GenerationLoop:
        self._ensure_engine()
        assert self._loop is not None
        return self._loop

    def warmup(self) -> None:
        """Builds the engine, runs one tiny request through it so the first real step is not slow, and
        captures the decode CUDA graphs of every batch size when graphs are on."""
        engine = self._ensure_engine()
        if self.warmed_up or self.is_running():
            return
        if tensor_parallel_size(self.model) > 1:
            # A step runs collectives that every rank must join, and only the loop keeps ranks in step.
            logger.info("warmup() is skipped under tensor parallelism: the first steps warm the engine")
            return

        # Long enough that warmup's decode steps read block tables two pages wide, short enough that each
        # warmup request (3 new tokens at most) fits the cache and the model's positions.
        wanted = engine.config.page_size + 1
        longest = engine.max_tokens_per_request
        prompt_length = wanted if longest is None else max(1, min(wanted, longest - 3))
        call_on_steps_thread(lambda: engine.warm_up(prompt_length), engine.num_threads, "cbserve-warmup")
        self.warmed_up = True

    def start(self) -> None:
        """Starts the background loop; works again after `stop()`.

        Under tensor parallelism every rank calls it once; a stop on the driver stops every rank's loop,
        and the driver's `start()` restarts them all (the other ranks' loop threads wait for it, and end
        with the driver's `destroy()`). A group that lost a rank cannot start again.
        """
        loop = self._running_loop()
        if loop.is_running():
            logger.warning("ContinuousBatchingManager.start(): already running")
            return
        loop.start()

    def is_running(self) -> bool:
        return self._loop is not None and self._loop.is_running()

    @property
    def loop_error(self) -> str | None:
        """Why the loop ended on its own (a tensor-parallel rank died, hung or diverged); None otherwise."""
        return self._loop.loop_error if self._loop is not None else None

    def stop(
        self,
        block: bool = True,
        timeout: float | None = None,
        keep_for_next_session: bool = False,
        hard_stop: bool = False,
    ) -> None:
        """Stops accepting requests; the loop drains queued and active ones, or fails them on `hard_stop`.

        Under tensor parallelism the driver decides for every rank: on another rank this only waits
        (with `block`) for the loop to end with the driver's.
        """
        stop_trigger_time = time.perf_counter()
        if self.is_driver and self._loop is not None:
            self._loop.request_stop(hard_stop)
        if keep_for_next_session and self.is_driver:
            self.model._cbserve_cached_manager = self  # type: ignore[assignment]
        if block:
            self.join(stop_trigger_time, timeout)

    def join(self, stop_trigger_time: float | None = None, timeout: float | None = None) -> None:
        """Waits for the loop thread to end (at most `timeout` seconds). `stop_trigger_time`, the
        `time.perf_counter()` of the stop, only serves the log line saying how long the stop took."""
        if self._loop is None:
            return
        if not self._loop.join(timeout):
            logger.warning("the generation loop is still running after %s s", timeout)
        elif stop_trigger_time is not None:
            elapsed = time.perf_counter() - stop_trigger_time
            logger.debug("the generation loop stopped %.3f s after stop()", elapsed)

    def destroy(self) -> None:
        """Stops the loop, frees the cache and gives the model its own attention and linear layers back.
        Idempotent and final."""
        if self._destroyed:
            return
        if self.is_running():
            self.stop(block=True)
        if self._original_attn_implementation is not None:
            self.model.set_attn_implementation(self._original_attn_implementation)  # type: ignore[operator]
            self._original_attn_implementation = None
        if getattr(self.model, "_cbserve_cached_manager", None) is self:
            del self.model._cbserve_cached_manager
        if self._loop is not None:
            self._loop.close()
        if self._engine is not None:
            self._engine.release_model()
        self._loop = None
        self._engine = None
        self._destroyed = True

    @contextmanager
    def pause(self, mode: str = "keep") -> Iterator[PauseHandle]:
        """Holds the loop between two steps while the block runs (e.g. to update weights in place).

        `mode`: "keep" (default) holds at once; the cache and every in-flight request are kept and
        continue after the resume. "wait" admits no new request (they stay queued), lets the in-flight
        ones finish, then holds. "abort" cancels every in-flight and queued request (each ends
        CANCELLED), then holds. Pauses nest across threads: the loop resumes when the last holder leaves.
        """
        modes = tuple(PauseMode)
        if mode not in modes:
            raise ValueError(f"pause mode must be one of {tuple(str(each) for each in modes)}, got {mode!r}")
        with self._running_loop().pause(PauseMode(mode)) as handle:
            yield handle

    # ------------------------------------------------------------------ submissions

    def add_request(
        self,
        input_ids: list[int],
        request_id: str | None = None,
        max_new_tokens: int | None = None,
        streaming: bool = False,
        record_timestamps: bool = False,
        eos_token_id: int | list[int] | None = None,
        sampling_params: SamplingParams | None = None,
        priority: int = 0,
        kv_on_weight_update: KVOnWeightUpdate | str = KVOnWeightUpdate.KEEP,
        **logit_processor_kwargs: Any,
    ) -> str | None:
        """Queues one request and returns its id; None (with a warning) once the manager is stopped.

        Generation parameters come either as generate's keyword arguments (`max_new_tokens`,
        `eos_token_id`, temperature, ...; the model's generation config fills the rest), or as one
        `sampling_params` built with `engine.sampling.params.build_sampling_params`, not both.
        `priority` orders requests under `scheduler_type="priority"` (smaller first; ignored otherwise).
        `kv_on_weight_update` says what a weight update while the request lives does to its KV
        (`engine.request.KVOnWeightUpdate`): "keep" (the default) goes on from it, "recompute" computes the
        prompt and the tokens so far again under the new weights.

        With `num_return_sequences` (or `n`) > 1, the request samples that many completions of the prompt,
        which is computed once: sequence i has its own id (`engine.request.sequence_request_id`: the
        request's id for the first, `{request_id}__child#{i - 1}` for the others, as in transformers) and
        its own outputs (`GenerationOutput.index` is i), and with a `seed` samples with seed + i.

        Raises ValueError for a request that is malformed (empty prompt, token outside the vocabulary,
        bad sampling value, duplicate live id) or that can never run (prompt + max_new_tokens larger than
        the whole KV cache or the model's positions), and QueueFullError when `max_queue_size` requests
        wait.
        """
        if not self.is_driver:
            logger.debug("add_request ignored on tensor-parallel rank %d: rank 0 takes them", global_rank())
            return None
        engine = self._ensure_engine()
        if sampling_params is None:
            settings = {
                "max_new_tokens": max_new_tokens,
                "eos_token_id": eos_token_id,
                **logit_processor_kwargs,
            }
            sampling_params = self.sampling_params(**settings)
        elif max_new_tokens is not None or eos_token_id is not None or logit_processor_kwargs:
            raise TypeError("add_request takes sampling_params or generation keyword arguments, not both")
        elif self.config.return_logprobs and not sampling_params.logprobs:
            sampling_params = dataclasses.replace(sampling_params, logprobs=True)
        request = build_request(
            f"req_{next(self._id_counter)}" if request_id is None else request_id,
            input_ids,
            sampling_params,
            engine.vocab_size,
            streaming=streaming,
            record_timestamps=record_timestamps,
            priority=priority,
            kv_on_weight_update=kv_on_weight_update,
        )
        for sequence in (request, *request.pending_forks):
            engine.init_structured_output(sequence)  # its grammar compiles here (once), or ValueError
        rejection = self._running_loop().submit(request)  # engine.loop.admission.admit decides
        if rejection is None:
            return request.request_id
        if rejection.reason == RejectionReason.STOPPED:
            warnings.warn("the manager is stopped: request ignored; call start() first", stacklevel=2)
            return None
        raise rejection.error()

    def sampling_params(self, field_prefix: str = "", **settings: Any) -> SamplingParams:
        """The `SamplingParams` that generate's keyword arguments `settings` give with this model's
        generation config; raises ValueError naming a bad parameter (prefixed with `field_prefix`)."""
        return build_sampling_params(
            settings,
            self.generation_config,
            self._ensure_engine().vocab_size,
            return_logprobs=self.config.return_logprobs,
            drop_unsupported=self.config.drop_unsupported_processors,
            field_prefix=field_prefix,
            default_logprobs_mode=self.config.logprobs_mode,
        )

    def add_requests(
        self,
        inputs: list[list[int]],
        max_new_tokens: int | None = None,
        streaming: bool = False,
        record_timestamps: bool = False,
        **logit_processor_kwargs: Any,
    ) -> list[str | None]:
        """Queues several requests; ids come back in input order.

        With prefix caching on, they are submitted sorted by prompt so that requests sharing a prefix
        run back to back and find each other's blocks.
        """
        engine = self._ensure_engine()
        ids = [f"req_{next(self._id_counter)}" for _ in inputs]
        order = list(range(len(inputs)))
        if engine.prefix_caching_enabled:
            order.sort(key=lambda index: inputs[index])
        for index in order:
            self.add_request(
                inputs[index],
                request_id=ids[index],
                max_new_tokens=max_new_tokens,
                streaming=streaming,
                record_timestamps=record_timestamps,
                **logit_processor_kwargs,
            )
        return list(ids)

    def cancel_request(self, request_id: str, index: int | None = None) -> None:
        """Cancels a request, each of its sequences ending with one CANCELLED output; with `index`, only
        that sequence of it (n > 1). Unknown or finished ids are ignored."""
        if self.is_driver and self._loop is not None:
            self._loop.cancel(request_id, index)

    # ------------------------------------------------------------------ results

    def get_result(
        self, request_id: str | None = None, timeout: float | None = None
    ) -> GenerationOutput | None:
        """The next output (of `request_id` when given); None after `timeout` seconds."""
        return self._router.get(request_id, timeout)

    def request_id_iter(self, request_id: str) -> Iterator[GenerationOutput]:
        """Yields one request's outputs until its last one (blocking)."""
        while True:
            output = self._router.get(request_id, timeout=IDLE_WAIT_S)
            if output is not None:
                yield output
                if output.is_finished():
                    return
            elif not self.is_running() and not self._router.has_pending(request_id):
                return

    def add_loop_exit_handler(self, callback: Callable[[], None]) -> None:
        """Calls `callback()` from the loop thread when the loop ends, for whatever reason (`loop_error`
        says whether it failed); a server turns its health NOT_SERVING on it."""
        self._listeners.add_exit_handler(callback)

    def add_kv_event_listener(self, listener: Callable[[list[KVCacheEvent]], None]) -> None:
        """Calls `listener(events)` from the loop thread after each iteration that changed the prefix
        cache: the blocks stored, removed or all cleared, in order (engine.kv.events), for a router
        that routes by prefix. Events are recorded only once a listener exists."""
        self._listeners.add_kv_event_listener(listener)
        if self._engine is not None:
            self._engine.record_kv_events()

    def reset_prefix_cache(self, abort: bool = False) -> PrefixCacheReset:
        """Drops every reusable prefix block (SGLang's flush_cache, vLLM's reset_prefix_cache), so that no
        later request reuses KV computed before: after a weight update that kept the cache, for instance.

        Only an idle engine is reset: with requests in flight (queued or running) it raises
        EngineBusyError and changes nothing, unless `abort`, which cancels them first (each ends
        CANCELLED). Returns how many blocks were dropped and requests cancelled.
        """
        return self._running_loop().reset_prefix_cache(abort)

    @property
    def max_requests_per_batch(self) -> int:
        return self._ensure_engine().max_requests_per_batch

    def max_tokens_per_request(self) -> int | None:
        """The most tokens (prompt + generated) one request can ever hold: the smaller of the whole KV
        cache and the model's positions; None when neither bounds it."""
        return self._ensure_engine().max_tokens_per_request

    def register_result_handler(
        self, request_id: str, callback: Callable[[GenerationOutput], object]
    ) -> None:
        """Calls `callback(output)` on the caller's asyncio loop for each output of this request."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = asyncio.get_event_loop_policy().get_event_loop()
        self._router.register_handler(request_id, callback, loop)

    def __iter__(self) -> Iterator[GenerationOutput]:
        while True:
            output = self._router.get(timeout=IDLE_WAIT_S)
            if output is not None:
                yield output
            elif not self.is_running() and not self._router.has_pending():
                return

    def stats(self) -> ManagerStats:
        """Counters as of the end of the last step."""
        return self._running_loop().stats()

    # ------------------------------------------------------------------ weights and memory
    # Each forwards to `engine.weights.operations.WeightsAndMemory`, whose docstrings say the rest.

    @property
    def weight_version(self) -> int:
        """Version of the weights served: 1 at start, +1 per update."""
        return self._weights.weight_version

    @property
    def weight_version_label(self) -> str | None:
        """The label the last update gave its weights; None at start."""
        return self._weights.weight_version_label

    def label_weights(self, label: str) -> None:
        """Sets `weight_version_label` of the weights served now, changing nothing else."""
        self._weights.label_weights(label)

    def weights_checksum(self) -> WeightsChecksum:
        """A digest of every tensor of the model and of them all, with the weight version it is of."""
        return self._weights.weights_checksum()

    def update_weights(self, state_dict_or_path: Any, version: str | None = None) -> int:
        """Replaces weights in place (tensors or safetensors files); returns the new `weight_version`."""
        return self._weights.update_weights(state_dict_or_path, version)

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        backend: str = "auto",
        group_name: str = DEFAULT_GROUP_NAME,
        timeout_s: float = DEFAULT_GROUP_TIMEOUT_S,
    ) -> JoinedGroup:
        """Joins the weight-update group a trainer created at `master_address:master_port`."""
        return self._weights.init_weights_update_group(
            master_address, master_port, rank_offset, world_size, backend, group_name, timeout_s
        )

    def check_weights_update(self, plan: BucketPlan) -> None:
        """Raises ValueError naming the first tensor or bucket of `plan` the model cannot take."""
        self._weights.check_weights_update(plan)

    def update_weights_from_distributed(
        self, plan: BucketPlan, version: str | None = None, on_ready: Callable[[], None] | None = None
    ) -> int:
        """Receives new weights the trainer broadcasts over the group; returns the new `weight_version`."""
        return self._weights.update_weights_from_distributed(plan, version, on_ready)

    def abort_weights_transfer(self) -> None:
        """Ends a transfer in progress (its caller gave up before the trainer broadcast)."""
        self._weights.abort_weights_transfer()

    def destroy_weights_update_group(self) -> bool:
        """Leaves the trainer's group; False when in none."""
        return self._weights.destroy_weights_update_group()

    def update_weights_from_ipc(self, handles: Iterable[CudaIpcHandle], version: str | None = None) -> int:
        """Copies new weights from a colocated trainer's CUDA tensors; returns the new `weight_version`."""
        return self._weights.update_weights_from_ipc(handles, version)

    def sleep(self, level: int = 1, mode: str = "keep") -> SleepOutcome:
        """Frees memory for a colocated trainer: level 1 the KV cache, level 2 the weights too."""
        return self._weights.sleep(level, mode)

    def wake_up(self, tags: list[str] | tuple[str, ...] | None = None) -> int:
        """Takes back what sleep freed; returns the sleep level left (0: serving)."""
        return self._weights.wake_up(tags)


def _build_engine(
    model: torch.nn.Module,
    config: ContinuousBatchingConfig,
    router: OutputRouter,
    listeners: LoopListeners,
) -> tuple[EngineCore, GenerationLoop]:
    """The engine for `model` (its attention already paged) and the loop that will own it."""
    group = TensorParallelGroup.for_model(model, config.cpu_group_timeout)
    # Built on a thread that ends, like every step: building runs torch ops (zeroing the null block), and
    # one large enough to go parallel would leave the caller's thread an OpenMP team for good. With more
    # OpenMP threads than cores, libgomp's workers stop spinning between parallel regions, and every step
    # waits for them to wake: 1.7x slower on SmolLM2.
    engine = call_on_steps_thread(
        lambda: EngineCore(model, config, group),
        config.num_threads or default_num_threads(torch.get_num_threads()),
        "cbserve-build",
    )
    return engine, generation_loop_for(engine, router, listeners, config.max_queue_size, group)
