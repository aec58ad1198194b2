"""`GenerationLoop`: the thread that owns the engine, applies posted commands between steps, and decides
each iteration whether to step, idle, park for a pause, or exit.

    callers ──post──> inbox ──> loop thread: apply commands ──> decide ──> engine.step() ──> OutputRouter

Threads: every field below `_cond` is shared with callers and read or written only with `_cond` held;
the engine itself is touched by the loop thread alone while the thread runs (so it needs no locks), and
by callers only while it does not.

Tensor parallelism (engine.loop.lockstep) subclasses this loop: the `_share_*` and `_on_*` hooks are where
the other ranks are kept in step; in a single process they do nothing.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, TypeVar

from engine.engine_core import EngineCore, StepResult, call_on_steps_thread, run_steps_thread
from engine.errors import EngineBusyError, QueueFullError, WeightTransferError
from engine.kv.events import KVCacheEvent
from engine.loop.commands import (
    COLLECTIVE_COMMANDS,
    AbortAll,
    AddRequest,
    CancelRequest,
    ChecksumWeights,
    JoinWeightsUpdateGroup,
    LeaveWeightsUpdateGroup,
    LoopAction,
    LoopCommand,
    PauseHandle,
    PauseMode,
    PrefixCacheReset,
    ResetPrefixCache,
    Sleep,
    SleepOutcome,
    UpdateWeights,
    UpdateWeightsFromGroup,
    WakeUp,
    WeightUpdate,
    caller_futures,
)
from engine.loop.output_router import OutputRouter
from engine.request import FinishReason, Request, RequestStatus
from engine.stats import ManagerStats
from engine.weights.checksum import WeightsChecksum, model_weights, weights_checksum
from engine.weights.sleep import (
    SleepLevel,
    SleepTag,
    offload_weights,
    release_kv_cache,
    reload_weights,
    resident_memory,
    restore_kv_cache,
)
from engine.weights.tensors import apply_weights, model_tensors, stage_weights
from engine.weights.transfer import (
    BucketPlan,
    GroupSpec,
    IncompleteWeights,
    JoinedGroup,
    TransferProgress,
    WeightsUpdateGroup,
    receive_buckets,
)

logger = logging.getLogger(__name__)
T = TypeVar("T")

# How long an idle loop, or a caller waiting on it, sleeps between looks at the shared state.
IDLE_WAIT_S = 0.05


class GenerationLoop:
    """The engine's loop thread and the state callers share with it (the inbox, pauses, admissions)."""

    def __init__(self, engine: EngineCore, router: OutputRouter, max_queue_size: int) -> None:
        self.engine = engine
        self.router = router
        self.max_queue_size = max_queue_size
        self._thread: threading.Thread | None = None
        # Why the loop ended on its own (a tensor-parallel rank died, hung or diverged); None otherwise.
        self.loop_error: str | None = None
        self._exit_handlers: list[Callable[[], None]] = []
        self._kv_event_listeners: list[Callable[[list[KVCacheEvent]], None]] = []
        # Tokens sampled since the engine was built (a rate for routers: tokens per second).
        self._num_generated_tokens = 0
        self._last_action: LoopAction | None = None
        self._update_lock = threading.Lock()
        self._cond = threading.Condition()
        self._inbox: deque[LoopCommand] = deque()
        self._accepting = True
        self._stop_requested = False
        self._hard_stop_requested = False
        self._pause_holders = 0
        # WAIT pauses whose in-flight requests have not all ended yet (the loop keeps stepping for them).
        self._pending_waits: list[PauseHandle] = []
        self._paused = False
        # Ids of the live sequences (a request with n > 1 has n), and each n > 1 request's sequence ids.
        self._live_ids: set[str] = set()
        self._sequence_ids: dict[str, tuple[str, ...]] = {}
        # Requests submitted and not yet scheduled (or ended): what `max_queue_size` bounds.
        self._num_queued = 0
        self.weight_version = 1
        self.weight_version_label: str | None = None
        # The trainer's weight-update group this rank joined, and the ranks this engine holds in it.
        self._weights_update_group: WeightsUpdateGroup | None = None
        self._weights_update_group_ranks: tuple[int, ...] = ()
        # What sleep gave back (engine.weights.sleep); empty when awake. Steps wait while it is not empty.
        self._asleep: set[SleepTag] = set()
        # Set when a transfer failed after writing some weights; steps wait until an update covers it.
        self._incomplete_weights: IncompleteWeights | None = None
        self._stats = self._collect_stats()

    # ------------------------------------------------------------------ callers' side

    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        self._before_start()
        with self._cond:
            self._accepting = True
            self._stop_requested = False
            self._hard_stop_requested = False
        self._thread = run_steps_thread(self._run, self.engine.num_threads, "cbserve-engine")

    def request_stop(self, hard: bool) -> None:
        """Refuses new requests; the loop exits once nothing is left, or at once, failing the rest, if
        `hard`."""
        with self._cond:
            self._accepting = False
            self._stop_requested = True
            self._hard_stop_requested = self._hard_stop_requested or hard
            self._cond.notify_all()

    def join(self, timeout: float | None) -> bool:
        """Waits for the loop thread to end; False if it still runs after `timeout` seconds."""
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            return not thread.is_alive()
        return True

    def close(self) -> None:
        """Releases what the loop holds beyond its thread: its weight-update group."""
        self._leave_weights_update_group()

    def add_exit_handler(self, callback: Callable[[], None]) -> None:
        self._exit_handlers.append(callback)

    def add_kv_event_listener(self, listener: Callable[[list[KVCacheEvent]], None]) -> None:
        """`listener(events)` runs on the loop thread after each iteration that changed the prefix
        cache, with the changes in order; it must be quick and must not raise."""
        self._kv_event_listeners.append(listener)
        self.engine.kv_cache_manager.record_kv_events()

    def reset_prefix_cache(self, abort: bool) -> PrefixCacheReset:
        """Drops every reusable prefix block between two steps (see ContinuousBatchingManager)."""
        return self._call(lambda result: ResetPrefixCache(abort, result))

    def weights_checksum(self) -> WeightsChecksum:
        """The digest of the weights between two steps, with the version it is of."""
        return self._call(ChecksumWeights)

    def submit(self, request: Request) -> bool:
        """Queues a validated request and its `pending_forks` (n > 1: each sequence counts as one queued
        request); False once stopped. Raises ValueError for a live duplicate id and QueueFullError when
        `max_queue_size` requests wait."""
        ids = tuple(sequence.request_id for sequence in (request, *request.pending_forks))
        with self._cond:
            if not self._accepting:
                return False
            for request_id in ids:
                if request_id in self._live_ids or request_id in self._sequence_ids:
                    raise ValueError(f"request_id {request_id!r} is already in flight")
            if self.max_queue_size and self._num_queued >= self.max_queue_size:
                raise QueueFullError(
                    f"the request queue is full ({self._num_queued} waiting, max_queue_size="
                    f"{self.max_queue_size}); retry later"
                )
            self._live_ids.update(ids)
            if len(ids) > 1:
                self._sequence_ids[request.request_id] = ids
            self._num_queued += len(ids)
            for request_id in ids:
                self.router.open(request_id)
            self._post(AddRequest(request))
        return True

    def cancel(self, request_id: str, index: int | None = None) -> None:
        """Cancels a request, every sequence of it (n > 1), or with `index` only that sequence."""
        with self._cond:
            ids = self._sequence_ids.get(request_id, (request_id,))
            if index is not None:
                ids = ids[index : index + 1] if index >= 0 else ()
            for sequence_id in ids:
                self._post(CancelRequest(sequence_id))

    @contextmanager
    def pause(self, mode: PauseMode) -> Iterator[PauseHandle]:
        """Holds the loop between two steps while the block runs (see ContinuousBatchingManager.pause)."""
        handle = PauseHandle(mode)
        with self._cond:
            self._pause_holders += 1
            if mode == PauseMode.WAIT:
                self._pending_waits.append(handle)
            elif mode == PauseMode.ABORT:
                if self.is_running():
                    self._post(AbortAll(handle))
                else:
                    self._abort_all(handle)
            self._cond.notify_all()
        try:
            with self._cond:
                while self.is_running() and not (self._paused and (handle.done or mode == PauseMode.KEEP)):
                    self._cond.wait(IDLE_WAIT_S)
                handle.done = True
                self._publish_pause_state()
            yield handle
        finally:
            with self._cond:
                self._pause_holders -= 1
                if handle in self._pending_waits:
                    self._pending_waits.remove(handle)
                if self._pause_holders == 0 and not self._holds_steps():
                    # The loop resumes as soon as it wakes; saying so now means a caller that reads the
                    # stats right after leaving its pause never sees the loop still paused.
                    self._paused = False
                self._publish_pause_state()
                self._cond.notify_all()

    def _publish_pause_state(self) -> None:
        """With `_cond` held: the snapshot carries the pause state as of now, not of the loop's last
        refresh (the loop thread may not have run since the pause was taken or left)."""
        self._stats = replace(self._stats, paused=self._paused, num_pause_holders=self._pause_holders)

    def update_weights(self, update: WeightUpdate) -> int:
        """Applies `update` between two steps under a KEEP pause; returns the new weight version.
        Concurrent updates are serialised."""
        with self._update_lock, self.pause(PauseMode.KEEP):
            return self._call(lambda result: UpdateWeights(update, result))

    def join_weights_update_group(self, spec: GroupSpec) -> JoinedGroup:
        """Joins a trainer's weight-update group (blocking the loop until every member joined)."""
        with self._update_lock:
            stale = self._weights_update_group
            if stale is not None and not stale.trainer_alive():
                # The trainer died between pushes: nothing noticed, since nothing was being received.
                logger.warning("the trainer of the weight-update group this server is in is gone: leaving it")
                self._call(LeaveWeightsUpdateGroup)
            if self._weights_update_group_ranks:
                raise RuntimeError(
                    f"already in a weight-update group (ranks {list(self._weights_update_group_ranks)}); "
                    "destroy it first"
                )
            return self._call(lambda result: JoinWeightsUpdateGroup(spec, result))

    def leave_weights_update_group(self) -> bool:
        """Leaves the weight-update group; False when there was none."""
        with self._update_lock:
            return self._call(LeaveWeightsUpdateGroup)

    def update_weights_from_group(
        self, plan: BucketPlan, label: str | None, on_ready: Callable[[], None] | None
    ) -> int:
        """Receives `plan` from the trainer under a KEEP pause; returns the new weight version.
        `on_ready()` runs on the loop thread once it waits for the first bucket."""
        ready: Future[None] = Future()
        if on_ready is not None:
            ready.add_done_callback(lambda _: on_ready())
        with self._update_lock, self.pause(PauseMode.KEEP):
            if not self._weights_update_group_ranks:
                raise RuntimeError("not in a weight-update group: join one first")
            return self._call(lambda result: UpdateWeightsFromGroup(plan, label, ready, result))

    def abort_weights_transfer(self) -> None:
        """Ends a transfer in progress from another thread (its caller gave up): the receive fails,
        and the update with it."""
        group = self._weights_update_group
        if group is not None:
            group.abort()

    def sleep(self, level: SleepLevel, mode: PauseMode) -> SleepOutcome:
        """Gives memory back (engine.weights.sleep) once `mode` has dealt with the requests in flight."""
        with self._update_lock, self.pause(mode) as handle:
            outcome: SleepOutcome = self._call(lambda result: Sleep(level, result))
        return replace(outcome, cancelled_requests=handle.cancelled)

    def wake_up(self, tags: frozenset[SleepTag]) -> int:
        """Takes back what `tags` name; returns the sleep level left."""
        with self._update_lock:
            return self._call(lambda result: WakeUp(tags, result))

    def _call(self, command_for: Callable[[Future[T]], LoopCommand]) -> T:
        """Runs a command on the loop thread between two steps (on this thread when the loop is
        stopped) and returns its result."""
        result: Future[T] = Future()
        command = command_for(result)
        if self.is_running():
            with self._cond:
                self._post(command)
        else:
            self._check_can_apply_stopped()

            def apply_while_stopped() -> None:
                self._apply(command)
                self._refresh_stats()
                self._publish_kv_events()

            # On a thread that ends, as a step would run: commands copy weights and caches, and a copy
            # large enough to go parallel would leave the caller's thread an OpenMP team, which slows
            # every later step (`ContinuousBatchingManager._ensure_engine` says how).
            call_on_steps_thread(apply_while_stopped, self.engine.num_threads, "cbserve-command")
        return result.result()

    def stats(self) -> ManagerStats:
        return self._stats

    def _post(self, command: LoopCommand) -> None:
        """With `_cond` held."""
        self._inbox.append(command)
        self._cond.notify_all()

    # ------------------------------------------------------------------ the loop thread

    def _run(self) -> None:
        try:
            self._run_until_stopped()
        except Exception as exc:  # only the tensor-parallel exchange raises: a rank died, hung or diverged
            self.loop_error = f"the generation loop failed: {type(exc).__name__}: {exc}"
            logger.exception("generation loop failed; failing every live request")
            self._fail_everything(self.loop_error)
        else:
            self._on_stopped()
        with self._cond:
            self._paused = False
            self._cond.notify_all()
        self._refresh_stats()
        self.router.wake_all()
        for handler in list(self._exit_handlers):
            handler()

    def _run_until_stopped(self) -> None:
        """Iterates until stopped, then fails what a hard stop left live."""
        while self._iterate():
            pass
        if self._hard_stop_requested:
            self._fail_everything("the manager was hard-stopped before this request finished")

    def _iterate(self) -> bool:
        """One iteration: apply the inbox, then step, wait or exit (False)."""
        with self._cond:
            commands = list(self._inbox)
            self._inbox.clear()
        shared = self._share_commands(commands)
        local, collective = split_collective(commands)
        for command in local:
            self._apply(command)
        engine = self.engine
        if engine.has_step_in_flight:
            with self._cond:
                stepping = self._next_action() == LoopAction.STEP
            if not stepping:  # a step launched ahead (async batching) delivers before the loop parks
                self._flush()
        with self._cond:
            action = self._next_action()
            self._enter(action)
            hold, hard = engine.hold_admission, self._hard_stop_requested
        self._share_decision(shared, commands, action, hold, hard)
        for command in collective:
            self._apply(command)
        if commands or action != self._last_action:  # an idle loop polls 20 times a second: no refresh
            self._refresh_stats()
        self._last_action = action
        if action == LoopAction.EXIT:
            self._publish_kv_events()
            return False
        if action == LoopAction.STEP:
            self._step()
            self._publish_kv_events()
        else:
            self._publish_kv_events()
            self._wait(action)
        return True

    def _next_action(self) -> LoopAction:
        """With `_cond` held: what the loop does now. Reads state only, so `_wait` can ask it again."""
        if self._hard_stop_requested:
            return LoopAction.EXIT
        if self._pause_holders > 0 and self._should_park():
            return LoopAction.PARK
        if not self.engine.has_unfinished_requests():
            return LoopAction.EXIT if self._stop_requested and not self._inbox else LoopAction.IDLE
        if self._holds_steps():
            return LoopAction.PARK
        return LoopAction.STEP

    def _holds_steps(self) -> bool:
        """Whether requests must wait: asleep, or the weights a mix of two versions."""
        return bool(self._asleep) or self._incomplete_weights is not None

    def _should_park(self) -> bool:
        """With `_cond` held and a pause held: park unless only WAIT pauses hold, with requests in flight."""
        holding = self._pause_holders - len(self._pending_waits)
        return holding > 0 or not self.engine.has_in_flight_requests()

    def _enter(self, action: LoopAction) -> None:
        """With `_cond` held: WAIT pauses are satisfied once parked with nothing in flight; pause() waiters
        learn that the loop is parked."""
        parked = action == LoopAction.PARK
        # Requests held by sleep or incomplete weights cannot finish: a WAIT pause does not wait for them.
        if parked and (not self.engine.has_in_flight_requests() or self._holds_steps()):
            for handle in self._pending_waits:
                handle.done = True
            self._pending_waits.clear()
        self.engine.hold_admission = bool(self._pending_waits)
        self._paused = parked
        if parked:
            self._cond.notify_all()

    def _wait(self, action: LoopAction) -> None:
        """Idle or parked: sleep until a command or a state change."""
        with self._cond:
            if self._inbox or self._next_action() != action:
                return
            self._cond.wait(self._wait_timeout(action))

    def _step(self) -> None:
        self._run_step(self.engine.step)

    def _flush(self) -> None:
        """Waits for the step launched ahead (async batching) and publishes its tokens."""
        self._run_step(self.engine.flush)

    def _run_step(self, run: Callable[[], StepResult]) -> None:
        try:
            result = run()
        except Exception as exc:  # a scheduler bug must not leave requests hanging forever
            logger.exception("generation loop error; failing every live request")
            result = StepResult(finished=self.engine.fail_all(f"engine error: {type(exc).__name__}: {exc}"))
        self._on_step_result(result)
        self._publish(result)
        self._refresh_stats()

    # ------------------------------------------------------------------ commands

    def _apply(self, command: LoopCommand) -> None:
        engine = self.engine
        if isinstance(command, AddRequest):
            if not engine.add_request(command.request):
                for sequence in (command.request, *command.request.pending_forks):
                    self._finish(sequence)
        elif isinstance(command, CancelRequest):
            cancelled = engine.cancel_request(command.request_id)
            if cancelled is not None:
                self._finish(cancelled)
        elif isinstance(command, AbortAll):
            self._abort_all(command.handle)
        elif isinstance(command, ResetPrefixCache):
            self._settle(command.result, lambda: self._reset_prefix_cache(command.abort))
        elif isinstance(command, ChecksumWeights):
            self._settle(command.result, self._weights_checksum)
        elif isinstance(command, UpdateWeights):
            self._settle(command.result, lambda: self._apply_update(command.update))
        elif isinstance(command, JoinWeightsUpdateGroup):
            self._settle(command.result, lambda: self._join_weights_update_group(command.spec))
        elif isinstance(command, LeaveWeightsUpdateGroup):
            self._settle(command.result, self._leave_weights_update_group)
        elif isinstance(command, UpdateWeightsFromGroup):
            self._settle(command.result, lambda: self._update_from_group(command))
        elif isinstance(command, Sleep):
            self._settle(command.result, lambda: self._sleep(command.level))
        else:
            self._settle(command.result, lambda: self._wake_up(command.tags))

    def _settle(self, result: Future[T] | None, run: Callable[[], T]) -> None:
        """Runs a command and hands its outcome to the caller waiting on `result`, with the stats
        already showing it; a failure is the caller's error and the loop goes on (a replaying rank,
        with nobody waiting, logs it)."""
        try:
            value = run()
        except Exception as exc:
            self._refresh_stats()
            if result is None:
                logger.warning("command not applied on this rank: %s", exc)
            else:
                result.set_exception(exc)
        else:
            self._refresh_stats()
            if result is not None:
                result.set_result(value)

    def _abort_all(self, handle: PauseHandle) -> None:
        handle.cancelled += self._cancel_all()
        handle.done = True

    def _cancel_all(self) -> int:
        """Cancels every queued and running request; returns how many."""
        cancelled_count = 0
        for request_id in list(self.engine.requests):
            cancelled = self.engine.cancel_request(request_id)
            if cancelled is not None:
                cancelled_count += 1
                self._finish(cancelled)
        return cancelled_count

    def _reset_prefix_cache(self, abort: bool) -> PrefixCacheReset:
        """SGLang's flush_cache: a reset only of an idle engine, so that no request runs on after it with
        a prefix computed before it (typically by the weights a sync just replaced)."""
        engine = self.engine
        num_live = len(engine.requests)
        if num_live and not abort:
            raise EngineBusyError(
                f"cannot reset the prefix cache with requests in flight ({num_live} queued or running): "
                "retry once they finish, or reset with abort to cancel them first"
            )
        if engine.has_step_in_flight:
            self._flush()
        aborted = self._cancel_all() if abort else 0
        return PrefixCacheReset(engine.kv_cache_manager.reset_prefix_cache(), aborted)

    def _apply_update(self, update: WeightUpdate) -> int:
        engine = self.engine
        # Tokens of a step launched ahead are the old weights' and are stamped with their version.
        if engine.has_step_in_flight:
            self._flush()
        staged = stage_weights(engine.model, update.source)
        apply_weights(staged)
        return self._new_weight_version(frozenset(item.name for item in staged), update.label)

    def _weights_checksum(self) -> WeightsChecksum:
        checksum = weights_checksum(model_weights(self.engine.model))
        return replace(checksum, weight_version=self.weight_version)

    def _new_weight_version(self, names: frozenset[str], label: str | None) -> int:
        """After new weights were written: the prefix cache (the old weights' KV) goes, the version
        goes up, and weights left incomplete by a failed transfer are whole again if `names` covers
        every tensor it announced."""
        engine = self.engine
        engine.kv_cache_manager.reset_prefix_cache()
        with self._cond:
            self.weight_version += 1
            self.weight_version_label = label
            engine.weight_version = self.weight_version
            incomplete = self._incomplete_weights
            if incomplete is not None and incomplete.tensor_names <= names:
                self._incomplete_weights = None
                logger.info("the weights are whole again")
        self._refresh_stats()
        logger.info(
            "weights updated: %d tensors, weight_version %d%s",
            len(names),
            self.weight_version,
            f" ({label})" if label else "",
        )
        return self.weight_version

    # ------------------------------------------------------------------ weight-update group, sleep

    def _join_weights_update_group(self, spec: GroupSpec) -> JoinedGroup:
        rank = spec.rank_offset + self._tensor_parallel_rank()
        group: WeightsUpdateGroup | None = None
        error: Exception | None = None
        try:
            group = WeightsUpdateGroup(spec, rank, self.engine.device)
        except Exception as exc:
            error = exc
        [everyone_joined] = self._smallest([int(group is not None)])
        if not everyone_joined:
            if group is not None:
                group.close()
            raise error or WeightTransferError("another tensor-parallel rank could not join the group")
        ranks = tuple(spec.rank_offset + tp_rank for tp_rank in range(self._tensor_parallel_size()))
        assert group is not None  # every rank joined, this one included
        with self._cond:
            self._weights_update_group = group
            self._weights_update_group_ranks = ranks
        if self._tensor_parallel_rank() == 0:  # the driver leaves; the other ranks follow its command
            group.watch_trainer(self._leave_group_of_dead_trainer)
        return JoinedGroup(ranks, group.backend)

    def _leave_group_of_dead_trainer(self, group: WeightsUpdateGroup) -> None:
        """On the group's watch thread: leaves `group` if it is still this server's (a transfer holds
        `_update_lock` and leaves by itself when it fails)."""
        with self._update_lock:
            if self._weights_update_group is not group:
                return
            logger.warning("the trainer of the weight-update group is gone: leaving the group")
            try:
                self._call(LeaveWeightsUpdateGroup)
            except Exception as exc:  # the loop stopped meanwhile: it leaves the group as it ends
                logger.info("could not leave the group of a trainer that is gone: %s", exc)

    def _leave_weights_update_group(self) -> bool:
        group = self._weights_update_group
        with self._cond:
            self._weights_update_group = None
            self._weights_update_group_ranks = ()
        if group is None:
            return False
        group.close()
        logger.info("left the weight-update group")
        return True

    def _update_from_group(self, command: UpdateWeightsFromGroup) -> int:
        """Receives the buckets; every tensor-parallel rank agrees on the outcome. A failure leaves the
        group, and, once any rank wrote a bucket, holds every step until an update covers the lot."""
        engine = self.engine
        if engine.has_step_in_flight:
            self._flush()
        group = self._weights_update_group
        progress = TransferProgress()
        error: Exception | None = None
        ready = command.ready
        on_ready = None if ready is None else (lambda: ready.set_result(None))
        try:
            if group is None:
                raise WeightTransferError("not in a weight-update group: join one first")
            receive_buckets(group, command.plan, model_tensors(engine.model), progress, on_ready)
        except Exception as exc:
            error = exc
        succeeded, fewest_applied = self._smallest([int(error is None), -progress.num_buckets_applied])
        if succeeded:
            return self._new_weight_version(command.plan.tensor_names, command.label)
        self._leave_weights_update_group()
        reason = str(error) if error is not None else "another tensor-parallel rank failed the transfer"
        if fewest_applied == 0:  # no rank wrote anything
            raise WeightTransferError(f"weights unchanged: {reason}")
        engine.kv_cache_manager.reset_prefix_cache()
        with self._cond:
            earlier = self._incomplete_weights
            names = command.plan.tensor_names | (earlier.tensor_names if earlier else frozenset())
            self._incomplete_weights = IncompleteWeights(reason, names)
        logger.error("weight transfer failed midway; requests wait for a complete update: %s", reason)
        raise WeightTransferError(
            f"the transfer failed after writing some weights ({reason}); requests wait until an update "
            "of every announced tensor succeeds"
        )

    def _sleep(self, level: SleepLevel) -> SleepOutcome:
        engine = self.engine
        if engine.has_step_in_flight:
            self._flush()
        released = requeued = 0
        resident_before = resident_memory(engine.device)
        if self._weights_update_group is not None:
            released += self._weights_update_group.release_buffer()
        if SleepTag.KV_CACHE not in self._asleep:
            requeued = engine.scheduler.num_running
            released += release_kv_cache(engine)
            self._asleep.add(SleepTag.KV_CACHE)
        if level >= SleepLevel.WEIGHTS and SleepTag.WEIGHTS not in self._asleep:
            released += offload_weights(engine)
            self._asleep.add(SleepTag.WEIGHTS)
        resident_after = resident_memory(engine.device)
        resident_released = None
        if resident_before is not None and resident_after is not None:
            resident_released = max(0, resident_before - resident_after)
        return SleepOutcome(released, requeued, resident_bytes_released=resident_released)

    def _wake_up(self, tags: frozenset[SleepTag]) -> int:
        if SleepTag.WEIGHTS in tags and SleepTag.WEIGHTS in self._asleep:
            reload_weights(self.engine)
            self._asleep.discard(SleepTag.WEIGHTS)
        if SleepTag.KV_CACHE in tags and SleepTag.KV_CACHE in self._asleep:
            restore_kv_cache(self.engine)
            self._asleep.discard(SleepTag.KV_CACHE)
        return self._sleep_level()

    def _sleep_level(self) -> SleepLevel:
        if SleepTag.WEIGHTS in self._asleep:
            return SleepLevel.WEIGHTS
        return SleepLevel.KV_CACHE if self._asleep else SleepLevel.AWAKE

    # ------------------------------------------------------------------ outputs

    def _publish_kv_events(self) -> None:
        if not self._kv_event_listeners:  # nothing is recorded then: skip the per-iteration call
            return
        events = self.engine.kv_cache_manager.take_kv_events()
        if not events:
            return
        for listener in self._kv_event_listeners:
            try:
                listener(events)
            except Exception:  # a listener's bug must not stop generation
                logger.exception("a KV event listener failed")

    def _publish(self, result: StepResult) -> None:
        self._num_generated_tokens += len(result.advanced)
        for request in result.advanced:
            if request.streaming and not request.is_finished and self._publishes_outputs:
                self.router.publish(request.to_output())
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
            parent_id = request.parent_request_id
            sequence_ids = self._sequence_ids.get(parent_id, ())
            if sequence_ids and self._live_ids.isdisjoint(sequence_ids):
                del self._sequence_ids[parent_id]
        if self._publishes_outputs:
            self.router.publish(request.to_output())

    def _fail_everything(self, error: str) -> None:
        for request in self.engine.fail_all(error):
            self._finish(request)
        with self._cond:
            leftovers = [
                sequence
                for command in self._inbox
                if isinstance(command, AddRequest)
                for sequence in (command.request, *command.request.pending_forks)
            ]
            waiting = [future for command in self._inbox for future in caller_futures(command)]
            self._inbox.clear()
        for future in waiting:
            if not future.done():
                future.set_exception(RuntimeError(f"not done: {error}"))
        for request in leftovers:
            request.status = RequestStatus.FAILED
            request.finish_reason = FinishReason.ERROR
            request.error = error
            self._finish(request)

    def _refresh_stats(self) -> None:
        # Under `_cond`, so a snapshot never carries a pause state older than one pause() published.
        with self._cond:
            self._stats = self._collect_stats()

    def _collect_stats(self) -> ManagerStats:
        return ManagerStats.of(
            self.engine,
            running=self.is_running(),
            paused=self._paused,
            num_pause_holders=self._pause_holders,
            num_waiting=self._num_queued,
            weight_version=self.weight_version,
            weight_version_label=self.weight_version_label,
            num_generated_tokens=self._num_generated_tokens,
            sleep_level=self._sleep_level(),
            weights_incomplete=self._incomplete_weights.reason if self._incomplete_weights else None,
            weights_update_group_ranks=self._weights_update_group_ranks,
        )

    # ------------------------------------------------------------------ hooks (engine.loop.lockstep)

    # Whether this loop's outputs reach callers (replaying tensor-parallel ranks have no readers).
    _publishes_outputs = True

    def _before_start(self) -> None:
        """Before the thread starts; raises when the loop cannot run again."""

    def _on_stopped(self) -> None:
        """On the loop thread, once the loop ended without error."""

    def _share_commands(self, commands: list[LoopCommand]) -> Any:
        """Before `commands` are applied (applying mutates requests); returns what `_share_decision`
        needs."""
        return None

    def _share_decision(
        self, shared: Any, commands: list[LoopCommand], action: LoopAction, hold: bool, hard: bool
    ) -> None:
        """Once the iteration's action is decided, before it is carried out."""

    def _on_step_result(self, result: StepResult) -> None:
        """After each step or flush, before its outputs are published."""

    def _wait_timeout(self, action: LoopAction) -> float | None:
        """How long an idle or parked loop sleeps before looking again (None: until notified)."""
        return IDLE_WAIT_S if action == LoopAction.IDLE else None

    def _check_can_apply_stopped(self) -> None:
        """Raises when commands cannot be applied with the loop stopped."""

    def _tensor_parallel_rank(self) -> int:
        return 0

    def _tensor_parallel_size(self) -> int:
        return 1

    def _smallest(self, values: list[int]) -> list[int]:
        """Element-wise minimum of `values` over the tensor-parallel ranks (each passes as many)."""
        return values


def split_collective(commands: list[LoopCommand]) -> tuple[list[LoopCommand], list[LoopCommand]]:
    """(the commands each rank applies before the tick is shared, those every rank applies after it,
    together: engine.loop.commands.COLLECTIVE_COMMANDS), each in posting order."""
    local: list[LoopCommand] = []
    collective: list[LoopCommand] = []
    for command in commands:
        (collective if isinstance(command, COLLECTIVE_COMMANDS) else local).append(command)
    return local, collective
