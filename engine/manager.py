"""`ContinuousBatchingManager`: the engine's background thread and its user-facing lifecycle.

Threads: callers submit and cancel through an inbox; one loop thread owns the `EngineCore` and is the
only one that touches it (so the engine needs no locks); outputs leave through the `OutputRouter`.

    add_request / cancel_request ──> inbox ──> loop thread: engine.step() ──> OutputRouter ──> get_result,
                                                                                        request_id_iter,
                                                                                        result handlers
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import warnings
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from engine.config import ContinuousBatchingConfig
from engine.engine_core import EngineCore, StepResult, cb_attention_implementation
from engine.errors import QueueFullError
from engine.output_router import OutputRouter
from engine.request import FinishReason, GenerationOutput, Request, RequestStatus, SamplingParams
from engine.weights import apply_weights, stage_weights

logger = logging.getLogger(__name__)

# transformers' GenerationConfig default (max_length=20) read as a number of new tokens.
DEFAULT_MAX_NEW_TOKENS = 20
SAMPLING_KWARGS = ("temperature", "top_k", "top_p", "seed", "do_sample", "logprobs", "top_logprobs")
IDLE_WAIT_S = 0.05
PAUSE_MODES = ("keep", "wait", "abort")


@dataclass
class PauseHandle:
    """What `pause()` yields: its mode and, for "abort", how many requests it cancelled."""

    mode: str = "keep"
    cancelled: int = 0
    # Set by the loop: for "wait", once no in-flight request is left; for "abort", once they are cancelled.
    done: bool = False


@dataclass
class ManagerStats:
    """A snapshot of the engine's counters, safe to read from any thread."""

    running: bool
    paused: bool
    num_pause_holders: int
    num_waiting: int
    num_running: int
    num_blocks_total: int
    num_blocks_used: int
    num_blocks_cached: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    prefix_cache_hit_rate: float
    preemptions: int
    offloaded_blocks: int
    restored_blocks: int
    recomputed_tokens: int
    failed_steps: int
    prefix_caching_enabled: bool
    # Seconds per step phase since the engine was built: schedule, prepare_inputs, forward, sample, update.
    step_timings: dict[str, float]
    # Version of the weights served: 1 at start, +1 per `update_weights`.
    weight_version: int = 1
    weight_version_label: str | None = None


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
    ) -> None:
        self.model = model
        self.generation_config = generation_config or getattr(model, "generation_config", None)
        self.config = continuous_batching_config or ContinuousBatchingConfig()
        self.config.validate()
        self._engine: EngineCore | None = None
        self._router = OutputRouter()
        self._cond = threading.Condition()
        self._inbox: deque[tuple[str, Any]] = deque()
        self._thread: threading.Thread | None = None
        self._accepting = True
        self._stop_requested = False
        self._hard_stop_requested = False
        self._destroyed = False
        self._pause_holders = 0
        self._loop_paused = False
        self._live_ids: set[str] = set()
        self._num_queued = 0
        self._id_counter = itertools.count()
        self._original_attn_implementation: str | None = None
        self._stats: ManagerStats | None = None
        self.warmed_up = False
        # WAIT pauses whose in-flight requests have not all ended yet (the loop keeps stepping for them).
        self._pending_waits: list[PauseHandle] = []
        self._update_lock = threading.Lock()
        self.weight_version = 1
        self.weight_version_label: str | None = None

    # ------------------------------------------------------------------ lifecycle

    def switch_to_cb_friendly_attn(self, model: torch.nn.Module, auto_switch_to_flash: bool = True) -> None:
        """Swaps the model's attention for the paged one (idempotent; `destroy` restores the original).

        `auto_switch_to_flash` is accepted for API compatibility; no flash kernel is used on this path.
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
            self.switch_to_cb_friendly_attn(self.model, self.config.auto_switch_to_flash)
            self._engine = EngineCore(self.model, self.config)
            self._refresh_stats()
        return self._engine

    def warmup(self) -> None:
        """Builds the engine and runs one tiny request through it so the first real step is not slow."""
        engine = self._ensure_engine()
        if self.warmed_up or self.is_running():
            return
        dummy = Request("__warmup__", [0, 0], SamplingParams(max_new_tokens=2))
        if engine.add_request(dummy):
            while engine.has_unfinished_requests():
                engine.step()
        engine.kv_cache_manager.reset_prefix_cache()
        engine.kv_cache_manager.prefix_cache_stats.queried_tokens = 0
        engine.kv_cache_manager.prefix_cache_stats.hit_tokens = 0
        self.warmed_up = True

    def start(self) -> None:
        """Starts the background loop; works again after `stop()`."""
        self._ensure_engine()
        if self.is_running():
            logger.warning("ContinuousBatchingManager.start(): already running")
            return
        with self._cond:
            self._accepting = True
            self._stop_requested = False
            self._hard_stop_requested = False
        self._thread = threading.Thread(target=self._run_loop, name="cbserve-engine", daemon=True)
        self._thread.start()

    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(
        self,
        block: bool = True,
        timeout: float | None = None,
        keep_for_next_session: bool = False,
        hard_stop: bool = False,
    ) -> None:
        """Stops accepting requests; the loop drains queued and active ones, or fails them on `hard_stop`."""
        with self._cond:
            self._accepting = False
            self._stop_requested = True
            self._hard_stop_requested = self._hard_stop_requested or hard_stop
            self._cond.notify_all()
        if keep_for_next_session:
            self.model._cbserve_cached_manager = self  # type: ignore[assignment]
        if block:
            self.join(timeout=timeout)

    def join(self, stop_trigger_time: float | None = None, timeout: float | None = None) -> None:
        """Waits for the loop thread to end (at most `timeout` seconds)."""
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            if thread.is_alive():
                logger.warning("the generation loop is still running after %s s", timeout)

    def destroy(self) -> None:
        """Stops the loop, frees the cache and restores the model's attention. Idempotent and final."""
        if self._destroyed:
            return
        if self.is_running():
            self.stop(block=True)
        if self._original_attn_implementation is not None:
            self.model.set_attn_implementation(self._original_attn_implementation)  # type: ignore[operator]
            self._original_attn_implementation = None
        if getattr(self.model, "_cbserve_cached_manager", None) is self:
            del self.model._cbserve_cached_manager
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
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        handle = PauseHandle(mode)
        with self._cond:
            self._pause_holders += 1
            if mode == "wait":
                self._pending_waits.append(handle)
            elif mode == "abort":
                if self.is_running():
                    self._inbox.append(("abort", handle))
                elif self._engine is not None:
                    self._abort_all(self._engine, handle)
            self._cond.notify_all()
        try:
            with self._cond:
                while self.is_running() and not (self._loop_paused and (handle.done or mode == "keep")):
                    self._cond.wait(IDLE_WAIT_S)
                handle.done = True
            yield handle
        finally:
            with self._cond:
                self._pause_holders -= 1
                if handle in self._pending_waits:
                    self._pending_waits.remove(handle)
                self._cond.notify_all()

    # ------------------------------------------------------------------ weights

    def update_weights(self, state_dict_or_path: Any, version: str | None = None) -> int:
        """Replaces model weights in place and returns the new `weight_version`.

        `state_dict_or_path`: a mapping (or iterable of pairs) of name -> tensor, or the path of a
        safetensors file, of a folder of them, or of a "*.safetensors.index.json". Every tensor is
        checked (known parameter or buffer, equal shape, castable dtype) before any is written: a bad
        update raises ValueError naming the tensor and changes nothing. Runs under a KEEP pause (joining
        any pause the caller holds): in-flight requests keep their cache and continue, their later tokens
        come from the new weights. Prefix-cache entries (computed with the old weights) are dropped.
        Concurrent updates are serialised.
        """
        engine = self._ensure_engine()
        with self._update_lock, self.pause():
            staged = stage_weights(self.model, state_dict_or_path)
            apply_weights(staged)
            engine.kv_cache_manager.reset_prefix_cache()
            with self._cond:
                self.weight_version += 1
                self.weight_version_label = version
                engine.weight_version = self.weight_version
            self._refresh_stats()
            logger.info(
                "weights updated: %d tensors, weight_version %d%s",
                len(staged),
                self.weight_version,
                f" ({version})" if version else "",
            )
            return self.weight_version

    # ------------------------------------------------------------------ submissions

    def add_request(
        self,
        input_ids: list[int],
        request_id: str | None = None,
        max_new_tokens: int | None = None,
        streaming: bool = False,
        record_timestamps: bool = False,
        eos_token_id: int | list[int] | None = None,
        **logit_processor_kwargs: Any,
    ) -> str | None:
        """Queues one request and returns its id; None (with a warning) once the manager is stopped.

        Raises ValueError for a request that is malformed (empty prompt, token outside the vocabulary,
        bad sampling value, duplicate live id) and QueueFullError when `max_queue_size` requests wait.
        """
        engine = self._ensure_engine()
        request = self._build_request(
            engine,
            input_ids,
            request_id,
            max_new_tokens,
            streaming,
            record_timestamps,
            eos_token_id,
            logit_processor_kwargs,
        )
        with self._cond:
            if not self._accepting:
                warnings.warn("the manager is stopped: request ignored; call start() first", stacklevel=2)
                return None
            if request.request_id in self._live_ids:
                raise ValueError(f"request_id {request.request_id!r} is already in flight")
            if self.config.max_queue_size and self._num_queued >= self.config.max_queue_size:
                raise QueueFullError(
                    f"the request queue is full ({self._num_queued} waiting, max_queue_size="
                    f"{self.config.max_queue_size}); retry later"
                )
            self._live_ids.add(request.request_id)
            self._num_queued += 1
            self._router.open(request.request_id)
            self._inbox.append(("add", request))
            self._cond.notify_all()
        return request.request_id

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
        if engine.kv_cache_manager.enable_prefix_caching:
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

    def cancel_request(self, request_id: str) -> None:
        """Cancels a request; it ends with one CANCELLED output. Unknown or finished ids are ignored."""
        with self._cond:
            self._inbox.append(("cancel", request_id))
            self._cond.notify_all()

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
        if self._stats is None:
            self._refresh_stats()
        assert self._stats is not None
        return self._stats

    # ------------------------------------------------------------------ the loop

    def _run_loop(self) -> None:
        engine = self._engine
        assert engine is not None
        while True:
            with self._cond:
                commands = list(self._inbox)
                self._inbox.clear()
            for command, payload in commands:
                self._apply(engine, command, payload)
            if commands:
                self._refresh_stats()
            with self._cond:
                if self._hard_stop_requested:
                    break
                engine.hold_admission = bool(self._pending_waits)
                if self._pause_holders > 0 and self._should_park(engine):
                    self._hold_pause(engine)
                    continue
                if not engine.has_unfinished_requests():
                    if self._stop_requested and not self._inbox:
                        break
                    if not self._inbox:
                        self._cond.wait(IDLE_WAIT_S)
                    continue
            try:
                result = engine.step()
            except Exception as exc:  # a scheduler bug must not leave requests hanging forever
                logger.exception("generation loop error; failing every live request")
                result = StepResult(finished=engine.fail_all(f"engine error: {type(exc).__name__}: {exc}"))
            self._publish(result)
            self._refresh_stats()
        if self._hard_stop_requested:
            self._fail_everything(engine, "the manager was hard-stopped before this request finished")
        self._refresh_stats()
        self._router.wake_all()

    def _should_park(self, engine: EngineCore) -> bool:
        """With `_cond` held and a pause held: park unless only WAIT pauses hold, with requests in flight."""
        holding = self._pause_holders - len(self._pending_waits)
        return holding > 0 or not engine.has_in_flight_requests()

    def _hold_pause(self, engine: EngineCore) -> None:
        """Called with `_cond` held: parks the loop until the last pause holder leaves.

        While parked it still applies ABORT pauses (cancelling runs no step), and WAIT pauses are
        satisfied once no request is in flight.
        """
        self._loop_paused = True
        while True:
            if any(command == "abort" for command, _ in self._inbox):
                commands = list(self._inbox)
                self._inbox.clear()
                for command, payload in commands:
                    self._apply(engine, command, payload)
            if not engine.has_in_flight_requests():
                for handle in self._pending_waits:
                    handle.done = True
                self._pending_waits.clear()
            self._refresh_stats()
            self._cond.notify_all()
            if self._pause_holders == 0 or self._hard_stop_requested or not self._should_park(engine):
                break
            self._cond.wait()
        self._loop_paused = False
        engine.hold_admission = bool(self._pending_waits)
        self._refresh_stats()

    def _abort_all(self, engine: EngineCore, handle: PauseHandle) -> None:
        for request_id in list(engine.requests):
            cancelled = engine.cancel_request(request_id)
            if cancelled is not None:
                handle.cancelled += 1
                self._finish(cancelled)
        handle.done = True

    def _apply(self, engine: EngineCore, command: str, payload: Any) -> None:
        if command == "add":
            request: Request = payload
            if not engine.add_request(request):
                self._finish(request)
        elif command == "cancel":
            cancelled = engine.cancel_request(payload)
            if cancelled is not None:
                self._finish(cancelled)
        elif command == "abort":
            self._abort_all(engine, payload)

    def _publish(self, result: StepResult) -> None:
        for request in result.advanced:
            if request.streaming and not request.is_finished:
                self._router.publish(request.to_output())
        for request in result.finished:
            self._finish(request)
        if result.num_newly_scheduled:
            with self._cond:
                self._num_queued -= result.num_newly_scheduled

    def _finish(self, request: Request) -> None:
        with self._cond:
            self._live_ids.discard(request.request_id)
            if request.scheduled_time is None:
                self._num_queued -= 1
        self._router.publish(request.to_output())

    def _fail_everything(self, engine: EngineCore, error: str) -> None:
        for request in engine.fail_all(error):
            self._finish(request)
        with self._cond:
            leftovers = [payload for command, payload in self._inbox if command == "add"]
            self._inbox.clear()
        for request in leftovers:
            request.status = RequestStatus.FAILED
            request.finish_reason = FinishReason.ERROR
            request.error = error
            self._finish(request)

    def _refresh_stats(self) -> None:
        engine = self._engine
        if engine is None:
            return
        pool = engine.kv_cache_manager.block_pool
        prefix = engine.kv_cache_manager.prefix_cache_stats
        self._stats = ManagerStats(
            running=self.is_running(),
            paused=self._loop_paused,
            num_pause_holders=self._pause_holders,
            num_waiting=self._num_queued,
            num_running=engine.scheduler.num_running,
            num_blocks_total=pool.num_usable_blocks,
            num_blocks_used=pool.num_used_blocks,
            num_blocks_cached=pool.num_cached_blocks,
            prefix_cache_queried_tokens=prefix.queried_tokens,
            prefix_cache_hit_tokens=prefix.hit_tokens,
            prefix_cache_hit_rate=prefix.hit_rate,
            preemptions=engine.scheduler.counters.preemptions,
            offloaded_blocks=engine.scheduler.counters.offloaded_blocks,
            restored_blocks=engine.scheduler.counters.restored_blocks,
            recomputed_tokens=engine.scheduler.counters.recomputed_tokens,
            failed_steps=engine.num_failed_steps,
            prefix_caching_enabled=engine.kv_cache_manager.enable_prefix_caching,
            step_timings=engine.runner.timings.as_dict(),
            weight_version=self.weight_version,
            weight_version_label=self.weight_version_label,
        )

    # ------------------------------------------------------------------ validation

    def _build_request(
        self,
        engine: EngineCore,
        input_ids: Any,
        request_id: str | None,
        max_new_tokens: int | None,
        streaming: bool,
        record_timestamps: bool,
        eos_token_id: int | list[int] | None,
        kwargs: dict[str, Any],
    ) -> Request:
        if isinstance(input_ids, torch.Tensor):
            input_ids = input_ids.flatten().tolist()
        if not isinstance(input_ids, (list, tuple)) or not input_ids:
            raise ValueError("input_ids must be a non-empty list of token ids")
        vocab_size = engine.vocab_size
        for token in input_ids:
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
                raise ValueError(f"input_ids contains {token!r}; token ids must be ints in [0, {vocab_size})")
        if request_id is None:
            request_id = f"req_{next(self._id_counter)}"
        elif not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        generation_config = self.generation_config
        if max_new_tokens is None:
            max_new_tokens = getattr(generation_config, "max_new_tokens", None) or DEFAULT_MAX_NEW_TOKENS
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        sampling = self._sampling_params(max_new_tokens, eos_token_id, kwargs)
        return Request(
            request_id, list(input_ids), sampling, streaming=streaming, record_timestamps=record_timestamps
        )

    def _sampling_params(
        self, max_new_tokens: int, eos_token_id: int | list[int] | None, kwargs: dict[str, Any]
    ) -> SamplingParams:
        unknown = sorted(set(kwargs) - set(SAMPLING_KWARGS))
        if unknown:
            message = f"unsupported generation parameters {unknown}; supported: {list(SAMPLING_KWARGS)}"
            if not self.config.drop_unsupported_processors:
                raise ValueError(message)
            warnings.warn(f"{message}; dropped (drop_unsupported_processors=True)", stacklevel=4)
        generation_config = self.generation_config
        if eos_token_id is None:
            eos_token_id = getattr(generation_config, "eos_token_id", None)
        eos_ids = _as_id_set(eos_token_id)
        do_sample = kwargs.get("do_sample", getattr(generation_config, "do_sample", False))
        defaults = {
            name: getattr(generation_config, name, None) if do_sample else None
            for name in ("temperature", "top_k", "top_p")
        }
        temperature = kwargs.get("temperature", defaults["temperature"])
        top_k = kwargs.get("top_k", defaults["top_k"])
        top_p = kwargs.get("top_p", defaults["top_p"])
        seed = kwargs.get("seed")
        if temperature is not None and (not _is_number(temperature) or temperature < 0):
            raise ValueError(f"temperature must be a number >= 0, got {temperature!r}")
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0):
            raise ValueError(f"top_k must be an int >= 0 (0 disables it), got {top_k!r}")
        if top_p is not None and (not _is_number(top_p) or not 0 < top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"seed must be an int, got {seed!r}")
        if do_sample and temperature is None:
            temperature = 1.0
        if not do_sample and "temperature" not in kwargs:
            temperature = None
        top_logprobs = kwargs.get("top_logprobs", 0) or 0
        if isinstance(top_logprobs, bool) or not isinstance(top_logprobs, int) or not 0 <= top_logprobs <= 20:
            raise ValueError(f"top_logprobs must be an int in [0, 20], got {top_logprobs!r}")
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            eos_token_ids=eos_ids,
            temperature=float(temperature) if temperature is not None else None,
            top_k=top_k or None,
            top_p=float(top_p) if top_p is not None else None,
            seed=seed,
            logprobs=bool(kwargs.get("logprobs", False) or self.config.return_logprobs),
            top_logprobs=top_logprobs,
        )


def _is_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and value == value


def _as_id_set(eos_token_id: Any) -> frozenset[int]:
    if eos_token_id is None:
        return frozenset()
    if isinstance(eos_token_id, torch.Tensor):
        eos_token_id = eos_token_id.flatten().tolist()
    if isinstance(eos_token_id, int):
        return frozenset([eos_token_id])
    return frozenset(int(token) for token in eos_token_id)
