"""`ContinuousBatchingManager`: the engine's background thread and its user-facing lifecycle.

Threads: callers submit and cancel through an inbox; one loop thread owns the `EngineCore` and is the
only one that touches it (so the engine needs no locks); outputs leave through the `OutputRouter`.

    add_request / cancel_request ──> inbox ──> loop thread: engine.step() ──> OutputRouter ──> get_result,
                                                                                        request_id_iter,
                                                                                        result handlers
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import os
import threading
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from engine.config import ContinuousBatchingConfig
from engine.engine_core import EngineCore, StepResult, cb_attention_implementation
from engine.errors import QueueFullError
from engine.output_router import OutputRouter
from engine.parallel import (
    DRIVER_RANK,
    END,
    EXIT,
    IDLE,
    PARK,
    RESTART,
    STEP,
    StoppedHeartbeat,
    TensorBroadcast,
    TensorParallelGroup,
    tensor_parallel_size,
)
from engine.request import FinishReason, GenerationOutput, Request, RequestStatus, SamplingParams
from engine.weights import apply_weights, stage_weights

logger = logging.getLogger(__name__)

# transformers' GenerationConfig default (max_length=20) read as a number of new tokens.
DEFAULT_MAX_NEW_TOKENS = 20
SAMPLING_KWARGS = (
    "temperature",
    "top_k",
    "top_p",
    "seed",
    "do_sample",
    "logprobs",
    "top_logprobs",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "min_new_tokens",
    "logit_bias",
)
MAX_TOP_LOGPROBS = 20
# OpenAI's bounds on presence_penalty and frequency_penalty, and on logit_bias values.
MAX_ABS_PRESENCE_FREQUENCY_PENALTY = 2.0
MAX_ABS_LOGIT_BIAS = 100.0
IDLE_WAIT_S = 0.05
# How often an idle or parked tensor-parallel driver still ticks (well inside any cpu_group_timeout).
IDLE_TICK_S = 1.0
TOKEN_SUM_MODULUS = 1 << 61
PAUSE_MODES = ("keep", "wait", "abort")


@dataclass
class PauseHandle:
    """What `pause()` yields: its mode and, for "abort", how many requests it cancelled."""

    mode: str = "keep"
    cancelled: int = 0
    # Set by the loop: for "wait", once no in-flight request is left; for "abort", once they are cancelled.
    done: bool = False


@dataclass(frozen=True)
class WeightUpdate:
    """An `update_weights` call as the loop applies it (and sends it to the other tensor-parallel ranks)."""

    # A safetensors path, or a list of (name, tensor) pairs; in a tick to the other tensor-parallel ranks,
    # a `TensorBroadcast` in place of the pairs, whose bytes follow the tick.
    source: Any
    label: str | None


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
        # Under tensor parallelism, on the driver while its loop is stopped (engine.parallel).
        self._stopped_heartbeat: StoppedHeartbeat | None = None
        self._stats: ManagerStats | None = None
        self.warmed_up = False
        # WAIT pauses whose in-flight requests have not all ended yet (the loop keeps stepping for them).
        self._pending_waits: list[PauseHandle] = []
        self._update_lock = threading.Lock()
        self.weight_version = 1
        self.weight_version_label: str | None = None
        # Tensor parallelism: only the driver (rank 0) takes requests; the group is made with the engine.
        self.is_driver = tensor_parallel_size(model) == 1 or _global_rank() == DRIVER_RANK
        self._parallel: TensorParallelGroup | None = None
        # Why the loop ended on its own (a tensor-parallel rank died, hung or diverged); None otherwise.
        self.loop_error: str | None = None
        self._loop_exit_handlers: list[Callable[[], None]] = []
        # Running digest of the tokens sampled, compared across tensor-parallel ranks every iteration.
        self._tokens_emitted = 0
        self._token_sum = 0
        self._last_action: str | None = None

    # ------------------------------------------------------------------ lifecycle

    def switch_to_cb_friendly_attn(self, model: torch.nn.Module, auto_switch_to_flash: bool = True) -> None:
        """Swaps the model's attention for the paged one (idempotent; `destroy` restores the original).

        `auto_switch_to_flash` is accepted for API compatibility; no flash kernel is used on this path (a
        model loaded with a flash implementation runs cbserve's paged SDPA: `cb_attention_implementation`).
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
            self._parallel = TensorParallelGroup.for_model(self.model, self.config.cpu_group_timeout)
            self._engine = EngineCore(self.model, self.config, self._parallel)
            self._refresh_stats()
        return self._engine

    def warmup(self) -> None:
        """Builds the engine, runs one tiny request through it so the first real step is not slow, and
        captures the decode CUDA graphs of every batch size when graphs are on."""
        engine = self._ensure_engine()
        if self.warmed_up or self.is_running():
            return
        if self._parallel is not None:
            # A step runs collectives that every rank must join, and only the loop keeps ranks in step.
            logger.info("warmup() is skipped under tensor parallelism: the first steps warm the engine")
            return
        # Two requests of different lengths: a varlen step, then decode steps of two rows and of one, so a
        # compiled forward has met every shape class (dynamic compilation specialises size 1) before real
        # requests arrive.
        for index, num_tokens in enumerate((2, 3)):
            engine.add_request(
                Request(f"__warmup_{index}__", [0] * num_tokens, SamplingParams(max_new_tokens=num_tokens))
            )
        while engine.has_unfinished_requests():
            engine.step()
        engine.kv_cache_manager.reset_prefix_cache()
        engine.kv_cache_manager.prefix_cache_stats.queried_tokens = 0
        engine.kv_cache_manager.prefix_cache_stats.hit_tokens = 0
        engine.runner.capture_decode_graphs(engine.max_requests_per_batch)
        self.warmed_up = True

    def start(self) -> None:
        """Starts the background loop; works again after `stop()`.

        Under tensor parallelism every rank calls it once; a stop on the driver stops every rank's loop,
        and the driver's `start()` restarts them all (the other ranks' loop threads wait for it, and end
        with the driver's `destroy()`). A group that lost a rank cannot start again.
        """
        self._ensure_engine()
        if self.is_running():
            logger.warning("ContinuousBatchingManager.start(): already running")
            return
        if self._parallel is not None and self.loop_error is not None:
            raise RuntimeError(f"{self.loop_error}; restart the processes to serve again")
        try:
            self._end_stopped_heartbeat(RESTART)
        except RuntimeError as exc:
            self.loop_error = str(exc)
            raise
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
        """Stops accepting requests; the loop drains queued and active ones, or fails them on `hard_stop`.

        Under tensor parallelism the driver decides for every rank: on another rank this only waits
        (with `block`) for the loop to end with the driver's.
        """
        if not self.is_driver:
            if block:
                self.join(timeout=timeout)
            return
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
        try:
            self._end_stopped_heartbeat(END)
        except RuntimeError as exc:
            logger.warning("%s", exc)
        if self._parallel is not None and not self.is_running():
            self._parallel.close()
        self._parallel = None
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
        Concurrent updates are serialised. Under tensor parallelism, call it on the driver with full
        tensors: every rank applies its own shard of each.
        """
        if not self.is_driver:
            raise RuntimeError("update_weights is called on the driver rank (0); it reaches every rank")
        engine = self._ensure_engine()
        source: Any
        if isinstance(state_dict_or_path, (str, os.PathLike)):
            source = os.fspath(state_dict_or_path)
        elif isinstance(state_dict_or_path, Mapping):
            source = list(state_dict_or_path.items())
        else:
            source = list(state_dict_or_path)
        update = WeightUpdate(source, version)
        with self._update_lock, self.pause():
            if not self.is_running():
                if self._parallel is not None:
                    raise RuntimeError("under tensor parallelism, update_weights needs the running loop")
                return self._apply_update(engine, update)
            # The loop thread owns the model while it runs: it applies the update between two steps.
            future: Future[int] = Future()
            with self._cond:
                self._inbox.append(("update", (update, future)))
                self._cond.notify_all()
            return future.result()

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
        bad sampling value, duplicate live id) or that can never run (prompt + max_new_tokens larger than
        the whole KV cache or the model's positions), and QueueFullError when `max_queue_size` requests
        wait.
        """
        if not self.is_driver:
            logger.debug("add_request ignored on tensor-parallel rank %d: rank 0 takes them", _global_rank())
            return None
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
        # Sizes only (blocks in the pool, positions of the model): fixed once the engine exists, so this
        # thread may read them while the loop runs.
        error = engine.scheduler.admission_error(request)
        if error is not None:
            raise ValueError(error)
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
        if not self.is_driver:
            return
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

    def add_loop_exit_handler(self, callback: Callable[[], None]) -> None:
        """Calls `callback()` from the loop thread when the loop ends, for whatever reason (`loop_error`
        says whether it failed); a server turns its health NOT_SERVING on it."""
        self._loop_exit_handlers.append(callback)

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
        parallel = self._parallel
        try:
            if self.is_driver:
                self._run_session(engine, self._drive)
            else:
                # A stop on the driver ends a session; this thread waits for the next or the end.
                assert parallel is not None
                self._run_session(engine, self._follow)
                while parallel.await_restart():
                    self._run_session(engine, self._follow)
        except Exception as exc:  # only the tensor-parallel exchange raises: a rank died, hung or diverged
            self.loop_error = f"the generation loop failed: {type(exc).__name__}: {exc}"
            logger.exception("generation loop failed; failing every live request")
            self._fail_everything(engine, self.loop_error)
        else:
            if parallel is not None and self.is_driver:
                self._stopped_heartbeat = StoppedHeartbeat(parallel, self._tick_interval_s())
        with self._cond:
            self._loop_paused = False
            self._cond.notify_all()
        self._refresh_stats()
        self._router.wake_all()
        for handler in list(self._loop_exit_handlers):
            handler()

    def _end_stopped_heartbeat(self, decision: str) -> None:
        """Under tensor parallelism, on a stopped driver: tells the other ranks `decision` (RESTART or
        END); raises RuntimeError if a rank was lost while stopped. A no-op otherwise."""
        heartbeat, self._stopped_heartbeat = self._stopped_heartbeat, None
        if heartbeat is not None:
            heartbeat.end(decision)

    def _run_session(self, engine: EngineCore, iterate: Callable[[EngineCore], bool]) -> None:
        """Iterates until the loop stops, then fails what a hard stop left live."""
        while iterate(engine):
            pass
        if self._hard_stop_requested:
            self._fail_everything(engine, "the manager was hard-stopped before this request finished")
            if not self.is_driver:  # the driver's start() clears its own
                self._hard_stop_requested = False

    def _drive(self, engine: EngineCore) -> bool:
        """One iteration on the driver (or a single process): apply the inbox, then step, wait or exit."""
        with self._cond:
            commands = list(self._inbox)
            self._inbox.clear()
        parallel = self._parallel
        digest = self._state_digest(engine)
        replayable = [_replayable(entry) for entry in commands] if parallel else []
        encoded = parallel.encode_commands(replayable) if parallel else b""
        for command, payload in commands:
            self._apply(engine, command, payload)
        if engine.has_step_in_flight:
            with self._cond:
                stepping = self._next_action(engine) == STEP
            if not stepping:  # a step launched ahead (async batching) delivers before the loop parks
                self._flush(engine)
        with self._cond:
            action = self._next_action(engine)
            self._enter(engine, action)
            hold, hard = engine.hold_admission, self._hard_stop_requested
        if parallel is not None:
            parallel.send_tick(encoded, action, hold, hard, digest)
            for (command, payload), (_, replayed) in zip(commands, replayable, strict=True):
                if command == "update" and isinstance(replayed[0].source, TensorBroadcast):
                    parallel.send_tensors(payload[0].source)
        if commands or action != self._last_action:  # an idle loop polls 20 times a second: no refresh
            self._refresh_stats()
        self._last_action = action
        if action == EXIT:
            return False
        if action == STEP:
            self._step(engine)
        else:
            self._wait(engine, action)
        return True

    def _follow(self, engine: EngineCore) -> bool:
        """One iteration on a non-driver rank: replay the driver's next tick."""
        assert self._parallel is not None
        commands, tick = self._parallel.receive_tick()
        commands = [self._with_broadcast_tensors(command, payload) for command, payload in commands]
        digest = self._state_digest(engine)
        if tick.digest != digest:
            raise RuntimeError(
                f"rank {self._parallel.rank} diverged from the driver: (weight_version, failed steps, "
                f"tokens, token sum) is {digest} here and {tick.digest} on the driver"
            )
        for command, payload in commands:
            self._apply(engine, command, payload)
        if tick.action != STEP and engine.has_step_in_flight:
            self._flush(engine)  # where the driver flushed: it flushes exactly when it does not step
        engine.hold_admission = tick.hold_admission
        self._loop_paused = tick.action == PARK
        if tick.action == EXIT:
            if tick.hard_stop:
                self._hard_stop_requested = True
            return False
        if tick.action == STEP:
            self._step(engine)
        elif commands:
            self._refresh_stats()
        return True

    def _with_broadcast_tensors(self, command: str, payload: Any) -> tuple[str, Any]:
        """A replayed command with the tensors that followed its tick in place of their description."""
        if command == "update" and isinstance(payload[0].source, TensorBroadcast):
            assert self._parallel is not None
            update = payload[0]
            return command, (WeightUpdate(self._parallel.receive_tensors(update.source), update.label), None)
        return command, payload

    def _next_action(self, engine: EngineCore) -> str:
        """With `_cond` held: what the loop does now. Reads state only, so `_wait` can ask it again."""
        if self._hard_stop_requested:
            return EXIT
        if self._pause_holders > 0 and self._should_park(engine):
            return PARK
        if not engine.has_unfinished_requests():
            return EXIT if self._stop_requested and not self._inbox else IDLE
        return STEP

    def _should_park(self, engine: EngineCore) -> bool:
        """With `_cond` held and a pause held: park unless only WAIT pauses hold, with requests in flight."""
        holding = self._pause_holders - len(self._pending_waits)
        return holding > 0 or not engine.has_in_flight_requests()

    def _enter(self, engine: EngineCore, action: str) -> None:
        """With `_cond` held: WAIT pauses are satisfied once parked with nothing in flight; pause() waiters
        learn that the loop is parked."""
        parked = action == PARK
        if parked and not engine.has_in_flight_requests():
            for handle in self._pending_waits:
                handle.done = True
            self._pending_waits.clear()
        engine.hold_admission = bool(self._pending_waits)
        self._loop_paused = parked
        if parked:
            self._cond.notify_all()

    def _wait(self, engine: EngineCore, action: str) -> None:
        """Idle or parked: sleep until a command or a state change (an idle or parked tensor-parallel
        driver still ticks now and then, so that the other ranks' collectives never time out)."""
        with self._cond:
            if self._inbox or self._next_action(engine) != action:
                return
            if self._parallel is not None:
                timeout: float | None = self._tick_interval_s()
            else:
                timeout = IDLE_WAIT_S if action == IDLE else None
            self._cond.wait(timeout)

    def _tick_interval_s(self) -> float:
        """How often an idle, parked or stopped tensor-parallel driver tells the other ranks it lives."""
        assert self._parallel is not None
        return min(IDLE_TICK_S, (self._parallel.timeout_s or IDLE_TICK_S) / 4)

    def _step(self, engine: EngineCore) -> None:
        self._run_step(engine, engine.step)

    def _flush(self, engine: EngineCore) -> None:
        """Waits for the step launched ahead (async batching) and publishes its tokens."""
        self._run_step(engine, engine.flush)

    def _run_step(self, engine: EngineCore, run: Callable[[], StepResult]) -> None:
        try:
            result = run()
        except Exception as exc:  # a scheduler bug must not leave requests hanging forever
            logger.exception("generation loop error; failing every live request")
            result = StepResult(finished=engine.fail_all(f"engine error: {type(exc).__name__}: {exc}"))
        if self._parallel is not None:  # only tensor-parallel ranks compare digests
            for request in result.advanced:
                self._tokens_emitted += 1
                self._token_sum = (self._token_sum + request.all_token_ids[-1]) % TOKEN_SUM_MODULUS
        self._publish(result)
        self._refresh_stats()

    def _state_digest(self, engine: EngineCore) -> tuple[int, int, int, int]:
        """What every rank must agree on after each iteration; a mismatch means the lockstep broke."""
        return (self.weight_version, engine.num_failed_steps, self._tokens_emitted, self._token_sum)

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
        elif command == "update":
            update, future = payload
            try:
                version = self._apply_update(engine, update)
            except Exception as exc:  # a bad update is the caller's error; the loop goes on
                if future is None:
                    logger.warning("weight update not applied on this rank: %s", exc)
                else:
                    future.set_exception(exc)
            else:
                if future is not None:
                    future.set_result(version)

    def _apply_update(self, engine: EngineCore, update: WeightUpdate) -> int:
        # Tokens of a step launched ahead are the old weights' and are stamped with their version.
        if engine.has_step_in_flight:
            self._flush(engine)
        staged = stage_weights(self.model, update.source)
        apply_weights(staged)
        engine.kv_cache_manager.reset_prefix_cache()
        with self._cond:
            self.weight_version += 1
            self.weight_version_label = update.label
            engine.weight_version = self.weight_version
        self._refresh_stats()
        logger.info(
            "weights updated: %d tensors, weight_version %d%s",
            len(staged),
            self.weight_version,
            f" ({update.label})" if update.label else "",
        )
        return self.weight_version

    def _publish(self, result: StepResult) -> None:
        for request in result.advanced:
            if request.streaming and not request.is_finished and self.is_driver:
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
        if self.is_driver:  # other tensor-parallel ranks replay requests nobody reads
            self._router.publish(request.to_output())

    def _fail_everything(self, engine: EngineCore, error: str) -> None:
        for request in engine.fail_all(error):
            self._finish(request)
        with self._cond:
            leftovers = [payload for command, payload in self._inbox if command == "add"]
            updates = [payload for command, payload in self._inbox if command == "update"]
            self._inbox.clear()
        for _update, future in updates:
            if future is not None:
                future.set_exception(RuntimeError(f"weights not updated: {error}"))
        for request in leftovers:
            request.status = RequestStatus.FAILED
            request.finish_reason = FinishReason.ERROR
            request.error = error
            self._finish(request)

    def _refresh_stats(self) -> None:
        engine = self._engine
        if engine is None:
            return
        # Every cache group counts: a hybrid model's sliding-window blocks are memory too.
        pools = [group.block_pool for group in engine.kv_cache_manager.groups]
        prefix = engine.kv_cache_manager.prefix_cache_stats
        self._stats = ManagerStats(
            running=self.is_running(),
            paused=self._loop_paused,
            num_pause_holders=self._pause_holders,
            num_waiting=self._num_queued,
            num_running=engine.scheduler.num_running,
            num_blocks_total=sum(pool.num_usable_blocks for pool in pools),
            num_blocks_used=sum(pool.num_used_blocks for pool in pools),
            num_blocks_cached=sum(pool.num_cached_blocks for pool in pools),
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
        if (
            isinstance(top_logprobs, bool)
            or not isinstance(top_logprobs, int)
            or not 0 <= top_logprobs <= MAX_TOP_LOGPROBS
        ):
            raise ValueError(f"top_logprobs must be an int in [0, {MAX_TOP_LOGPROBS}], got {top_logprobs!r}")
        penalties = self._penalties(max_new_tokens, kwargs)
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            eos_token_ids=eos_ids,
            temperature=float(temperature) if temperature is not None else None,
            top_k=top_k or None,
            top_p=float(top_p) if top_p is not None else None,
            seed=seed,
            logprobs=bool(kwargs.get("logprobs", False) or self.config.return_logprobs),
            top_logprobs=top_logprobs,
            **penalties,
        )

    def _penalties(self, max_new_tokens: int, kwargs: dict[str, Any]) -> dict[str, Any]:
        """engine.penalties' parameters; as in `generate`, the model's generation config supplies
        `repetition_penalty` and `min_new_tokens` when the call does not."""
        generation_config = self.generation_config
        repetition_penalty = kwargs.get(
            "repetition_penalty", getattr(generation_config, "repetition_penalty", None)
        )
        if repetition_penalty is not None and (
            not _is_number(repetition_penalty) or not 0 < repetition_penalty < math.inf
        ):
            raise ValueError(
                f"repetition_penalty must be a finite number > 0 (1 disables it), got {repetition_penalty!r}"
            )
        penalties: dict[str, Any] = {
            "repetition_penalty": float(repetition_penalty) if repetition_penalty is not None else None
        }
        for name in ("presence_penalty", "frequency_penalty"):
            value = kwargs.get(name)
            bound = MAX_ABS_PRESENCE_FREQUENCY_PENALTY
            if value is not None and (not _is_number(value) or not -bound <= value <= bound):
                raise ValueError(f"{name} must be a number in [-{bound:g}, {bound:g}], got {value!r}")
            penalties[name] = float(value) if value is not None else None
        min_new_tokens = kwargs.get("min_new_tokens", getattr(generation_config, "min_new_tokens", None)) or 0
        if isinstance(min_new_tokens, bool) or not isinstance(min_new_tokens, int) or min_new_tokens < 0:
            raise ValueError(f"min_new_tokens must be an int >= 0, got {min_new_tokens!r}")
        if min_new_tokens > max_new_tokens and "min_new_tokens" not in kwargs:
            min_new_tokens = max_new_tokens  # the model's default yields to this request's own limit
        elif min_new_tokens > max_new_tokens:
            raise ValueError(
                f"min_new_tokens ({min_new_tokens}) must not exceed max_new_tokens ({max_new_tokens})"
            )
        penalties["min_new_tokens"] = min_new_tokens
        penalties["logit_bias"] = self._logit_bias(kwargs.get("logit_bias"))
        return penalties

    def _logit_bias(self, logit_bias: Any) -> tuple[tuple[int, float], ...]:
        if logit_bias is None:
            return ()
        if not isinstance(logit_bias, Mapping):
            kind = type(logit_bias).__name__
            raise ValueError(f"logit_bias must be a mapping of token id to bias, got {kind}")
        vocab_size = self._ensure_engine().vocab_size
        bound = MAX_ABS_LOGIT_BIAS
        pairs = []
        for token, bias in logit_bias.items():
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
                raise ValueError(f"logit_bias: token id {token!r} is not in [0, {vocab_size})")
            if not _is_number(bias) or not -bound <= bias <= bound:
                raise ValueError(
                    f"logit_bias[{token}] must be a number in [-{bound:g}, {bound:g}], got {bias!r}"
                )
            pairs.append((token, float(bias)))
        return tuple(sorted(pairs))


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


def _global_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _replayable(entry: tuple[str, Any]) -> tuple[str, Any]:
    """A command as the other tensor-parallel ranks replay it: without the caller's future, and with
    in-memory tensors described rather than pickled (their bytes follow the tick)."""
    command, payload = entry
    if command == "update":
        update, _future = payload
        if not isinstance(update.source, str):
            # Entries that are not (name, tensor) pairs go pickled, and every rank rejects them alike.
            with contextlib.suppress(TypeError, ValueError):
                update = WeightUpdate(TensorBroadcast.describe(update.source), update.label)
        return command, (update, None)
    return entry
