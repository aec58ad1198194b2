"""`GenerationLoop`: the thread that owns the engine, applies posted commands between steps, and decides
each iteration whether to step, idle, park for a pause, or exit.

    callers ──post──> inbox ──> loop thread: apply commands ──> decide ──> engine.step() ──> OutputRouter

The loop keeps to its thread, its inbox and each iteration's decision; what commands change lives in
objects composed into it: the `AdmissionLedger` (engine.loop.admission: the requests taken and not
finished), `WeightsAndSleep` (engine.loop.weights_and_sleep: weight version, trainer's group, sleep) and
`LoopListeners` (engine.loop.listeners: exit handlers, KV events).

Threads: every field below `_cond`, and the ledger, is shared with callers and read or written only with
`_cond` held; the engine itself is touched by the loop thread alone while the thread runs (so it needs no
locks), and by callers only while it does not.

Tensor parallelism (engine.loop.lockstep) subclasses this loop: the `_share_*` and `_on_*` hooks are where
the other ranks are kept in step; in a single process they do nothing. Collective outcomes (everyone
joined, everyone received) go through the injected `RankAgreement` (engine.loop.agreement).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, TypeVar

from engine.engine_core import EngineCore, StepResult, call_on_steps_thread, run_steps_thread
from engine.errors import EngineBusyError
from engine.loop.admission import AdmissionLedger, Rejection, admit
from engine.loop.agreement import SINGLE_PROCESS, RankAgreement
from engine.loop.commands import (
    COLLECTIVE_COMMANDS,
    AbortAll,
    AddRequest,
    CancelRequest,
    LoopAction,
    LoopCommand,
    PauseHandle,
    PauseMode,
    PrefixCacheReset,
    ResetPrefixCache,
    caller_futures,
)
from engine.loop.listeners import LoopListeners
from engine.loop.output_router import OutputRouter
from engine.loop.weights_and_sleep import WeightsAndSleep
from engine.request import FinishReason, GenerationOutput, Request, RequestStatus
from engine.stats import ManagerStats

logger = logging.getLogger(__name__)
T = TypeVar("T")

# How long an idle loop, or a caller waiting on it, sleeps between looks at the shared state.
IDLE_WAIT_S = 0.05


class GenerationLoop:
    """The engine's loop thread, its inbox, and each iteration's decision: step, idle, park or exit.

    What the commands change lives in objects of their own, composed here: `admissions` (the requests
    taken and not finished), `weights` (weights and sleep) and `listeners` (who hears from the thread)."""

    def __init__(
        self,
        engine: EngineCore,
        router: OutputRouter,
        listeners: LoopListeners,
        max_queue_size: int,
        agreement: RankAgreement = SINGLE_PROCESS,
    ) -> None:
        self.engine = engine
        self.router = router
        self.listeners = listeners
        if listeners.wants_kv_events:
            engine.record_kv_events()
        self._thread: threading.Thread | None = None
        # Why the loop ended on its own (a tensor-parallel rank died, hung or diverged); None otherwise.
        self.loop_error: str | None = None
        # Tokens sampled since the engine was built (a rate for routers: tokens per second).
        self._num_generated_tokens = 0
        # Steps completed, and the monotonic time of the last progress (ManagerStats.progress_at).
        self._num_steps = 0
        self._progress_at = time.monotonic()
        self._last_action: LoopAction | None = None
        self.weights = WeightsAndSleep(engine, agreement, self._flush_step_in_flight)
        self._cond = threading.Condition()
        self._inbox: deque[LoopCommand] = deque()
        self.admissions = AdmissionLedger(max_queue_size)  # under `_cond`
        self._stop_requested = False
        self._hard_stop_requested = False
        self._pause_holders = 0
        # WAIT pauses whose in-flight requests have not all ended yet (the loop keeps stepping for them).
        self._pending_waits: list[PauseHandle] = []
        self._paused = False
        self._stats = self._collect_stats()

    # ------------------------------------------------------------------ callers' side

    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        self._before_start()
        with self._cond:
            self.admissions.accepting = True
            self._stop_requested = False
            self._hard_stop_requested = False
        self._thread = run_steps_thread(self._run, self.engine.num_threads, "cbserve-engine")

    def request_stop(self, hard: bool) -> None:
        """Refuses new requests; the loop exits once nothing is left, or at once, failing the rest, if
        `hard`."""
        with self._cond:
            self.admissions.accepting = False
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
        self.weights.leave_update_group()

    def reset_prefix_cache(self, abort: bool) -> PrefixCacheReset:
        """Drops every reusable prefix block between two steps (see ContinuousBatchingManager)."""
        return self.call(lambda result: ResetPrefixCache(abort, result))

    def submit(self, request: Request) -> Rejection | None:
        """Queues a request built by `engine.loop.admission.build_request`, with its `pending_forks`, unless
        `admit` refuses it: then nothing is queued and the rejection comes back."""
        with self._cond:
            rejection = admit(request, self.engine, self.admissions)
            if rejection is not None:
                return rejection
            self.admissions.record(request)
            for sequence in (request, *request.pending_forks):
                self.router.open(sequence.request_id)
            self._post(AddRequest(request))
        return None

    def cancel(self, request_id: str, index: int | None = None) -> None:
        """Cancels a request, every sequence of it (n > 1), or with `index` only that sequence."""
        with self._cond:
            ids = self.admissions.ids_of(request_id)
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
                if self._pause_holders == 0 and not self.weights.holds_steps:
                    # The loop resumes as soon as it wakes; saying so now means a caller that reads the
                    # stats right after leaving its pause never sees the loop still paused.
                    self._paused = False
                self._publish_pause_state()
                self._cond.notify_all()

    def _publish_pause_state(self) -> None:
        """With `_cond` held: the snapshot carries the pause state as of now, not of the loop's last
        refresh (the loop thread may not have run since the pause was taken or left)."""
        self._stats = replace(self._stats, paused=self._paused, num_pause_holders=self._pause_holders)

    def call(self, command_for: Callable[[Future[T]], LoopCommand]) -> T:
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
                self.listeners.publish_kv_events(self.engine)

            # On a thread that ends, as a step would run: commands copy weights and caches, and a copy
            # large enough to go parallel would leave the caller's thread an OpenMP team, which slows
            # every later step (`engine.manager._build_engine` says how).
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
        self.listeners.loop_ended()

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
                self._flush_step_in_flight()
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
            self.listeners.publish_kv_events(self.engine)
            return False
        if action == LoopAction.STEP:
            self._step()
            self.listeners.publish_kv_events(self.engine)
        else:
            self.listeners.publish_kv_events(self.engine)
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
        if self.weights.holds_steps:
            return LoopAction.PARK
        return LoopAction.STEP

    def _should_park(self) -> bool:
        """With `_cond` held and a pause held: park unless only WAIT pauses hold, with requests in flight."""
        holding = self._pause_holders - len(self._pending_waits)
        return holding > 0 or not self.engine.has_in_flight_requests()

    def _enter(self, action: LoopAction) -> None:
        """With `_cond` held: WAIT pauses are satisfied once parked with nothing in flight; pause() waiters
        learn that the loop is parked."""
        parked = action == LoopAction.PARK
        # Requests held by sleep or incomplete weights cannot finish: a WAIT pause does not wait for them.
        if parked and (not self.engine.has_in_flight_requests() or self.weights.holds_steps):
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

    def _flush_step_in_flight(self) -> None:
        """Waits for the step launched ahead (async batching), if there is one, and publishes its tokens."""
        if self.engine.has_step_in_flight:
            self._run_step(self.engine.flush)

    def _run_step(self, run: Callable[[], StepResult]) -> None:
        try:
            result = run()
        except Exception as exc:  # a scheduler bug must not leave requests hanging forever
            logger.exception("generation loop error; failing every live request")
            result = StepResult(finished=self.engine.fail_all(f"engine error: {type(exc).__name__}: {exc}"))
        self._on_step_result(result)
        self._num_steps += 1
        self._progress_at = time.monotonic()
        self._publish(result)
        self._refresh_stats()

    # ------------------------------------------------------------------ commands

    def _apply(self, command: LoopCommand) -> None:
        engine = self.engine
        if isinstance(command, AddRequest):
            if not engine.has_unfinished_requests():
                self._progress_at = time.monotonic()  # silence counts from the first request on
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
        else:  # the weights' and memory's commands
            self._settle(command.result, lambda: self.weights.carry_out(command))

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
        self._flush_step_in_flight()
        aborted = self._cancel_all() if abort else 0
        return PrefixCacheReset(engine.reset_prefix_cache(), aborted)

    # ------------------------------------------------------------------ outputs

    def _publish(self, result: StepResult) -> None:
        """Publishes a step's outputs together (see engine.loop.output_router): the streaming requests that
        advanced, then the ones that ended."""
        self._num_generated_tokens += len(result.advanced)
        outputs = [
            request.to_output()
            for request in result.advanced
            if request.streaming and not request.is_finished and self._publishes_outputs
        ]
        for request in result.finished:
            output = self._ended(request)
            if output is not None:
                outputs.append(output)
        self.router.publish(outputs)
        if result.num_newly_scheduled:
            with self._cond:
                self.admissions.scheduled(result.num_newly_scheduled)

    def _finish(self, request: Request) -> None:
        output = self._ended(request)
        if output is not None:
            self.router.publish([output])

    def _ended(self, request: Request) -> GenerationOutput | None:
        """Frees an ended request's admission; its final output, for the caller to publish."""
        with self._cond:
            self.admissions.finished(request)
        return request.to_output() if self._publishes_outputs else None

    def _fail_everything(self, error: str) -> None:
        for request in self.engine.fail_all(error):
            self._finish(request)
        with self._cond:
            leftovers, waiting = _requests_and_futures(self._inbox)
            self._inbox.clear()
        for future in waiting:
            if not future.done():
                future.set_exception(RuntimeError(f"not done: {error}"))
        for request in leftovers:
            request.finish(RequestStatus.FAILED, FinishReason.ERROR, error)
            self._finish(request)

    def _refresh_stats(self) -> None:
        # Under `_cond`, so a snapshot never carries a pause state older than one pause() published.
        with self._cond:
            self._stats = self._collect_stats()

    def _collect_stats(self) -> ManagerStats:
        weights = self.weights
        return ManagerStats.of(
            self.engine,
            running=self.is_running(),
            paused=self._paused,
            num_pause_holders=self._pause_holders,
            num_waiting=self.admissions.num_queued,
            weight_version=weights.version,
            weight_version_label=weights.version_label,
            num_generated_tokens=self._num_generated_tokens,
            sleep_level=weights.sleep_level(),
            weights_incomplete=weights.incomplete.reason if weights.incomplete else None,
            weights_update_group_ranks=weights.update_group_ranks,
            num_steps=self._num_steps,
            progress_at=self._progress_at,
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


def _requests_and_futures(commands: Sequence[LoopCommand]) -> tuple[list[Request], list[Future[Any]]]:
    """The requests `commands` would add, every sequence of each, and the futures their callers wait on."""
    requests = [
        sequence
        for command in commands
        if isinstance(command, AddRequest)
        for sequence in (command.request, *command.request.pending_forks)
    ]
    return requests, [future for command in commands for future in caller_futures(command)]


def split_collective(commands: list[LoopCommand]) -> tuple[list[LoopCommand], list[LoopCommand]]:
    """(the commands each rank applies before the tick is shared, those every rank applies after it,
    together: engine.loop.commands.COLLECTIVE_COMMANDS), each in posting order."""
    local: list[LoopCommand] = []
    collective: list[LoopCommand] = []
    for command in commands:
        (collective if isinstance(command, COLLECTIVE_COMMANDS) else local).append(command)
    return local, collective
