"""The generation loop under tensor parallelism: every rank runs the same steps on the same batch.

Only the driver (rank 0) takes requests. Its loop sends one `LoopTick` per iteration over the group's CPU
(gloo) channel: the commands it applied (submissions, cancels, aborts, weight updates), what the loop does
next (a `LoopAction`), the scheduler's admission hold, and a digest of its state (weight version, failed
steps, tokens sampled) that every rank checks against its own. The other ranks apply the same commands to
the same state, so their schedulers make the same decisions without ever talking about them.

Invariants the lockstep relies on, kept by `EngineCore` (engine.runner.cache_plan) and the loop:
- every rank builds its cache with the same number of blocks and the same token budget (the smallest any
  rank can afford), and its sampler with the same seed (the driver's);
- a rank's scheduler depends only on its inputs (commands and model outputs), never on time or memory;
- logits are identical on every rank (the all-reduce hands each rank the same bits), so sampling agrees;
- a rank flushes a step launched ahead (async batching) exactly where the driver does: when the
  iteration's action is not STEP.

A rank that dies or hangs makes the next tick fail on the others within `cpu_group_timeout`.

A stop ends the loops, not the group: while the driver is stopped, a `StoppedHeartbeat` tells the other
ranks now and then that it still is (so their wait never times out while it lives), then whether the
engine starts again or ends for good.

A weight update from in-memory tensors travels in two parts: the tick names each tensor
(`TensorBroadcast`: name, dtype, shape), then its bytes follow the tick one tensor at a time as plain
gloo broadcasts, never pickled. The driver sends them right after the tick, every other rank receives
them right after reading it, so no other collective comes between.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import threading
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

import torch
import torch.distributed as dist

from engine.engine_core import EngineCore, StepResult
from engine.loop.commands import LoopAction, LoopCommand, UpdateWeights, WeightUpdate, without_callers
from engine.loop.generation_loop import GenerationLoop, split_collective
from engine.loop.listeners import LoopListeners
from engine.loop.output_router import OutputRouter
from engine.parallel import DRIVER_RANK, TensorParallelGroup

logger = logging.getLogger(__name__)

# How often an idle or parked driver still ticks (well inside any cpu_group_timeout).
IDLE_TICK_S = 1.0
TOKEN_SUM_MODULUS = 1 << 61


class StoppedDriverNews(StrEnum):
    """What a stopped driver tells the other ranks: still stopped, starting again, or ending for good."""

    STILL_STOPPED = "stopped"
    RESTART = "restart"
    END = "end"


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def num_bytes(self) -> int:
        return torch.Size(self.shape).numel() * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class TensorBroadcast:
    """Named tensors whose bytes follow the tick that carries this (`send_tensors`, `receive_tensors`)."""

    specs: tuple[TensorSpec, ...]

    @classmethod
    def describe(cls, tensors: list[tuple[str, torch.Tensor]]) -> TensorBroadcast:
        """Raises TypeError when an entry is not a (name, tensor) pair."""
        specs = []
        for entry in tensors:
            name, tensor = entry
            if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
                raise TypeError(
                    f"expected (name, tensor) pairs, got {type(name).__name__}, {type(tensor).__name__}"
                )
            specs.append(TensorSpec(name, tensor.dtype, tuple(tensor.shape)))
        return cls(tuple(specs))


@dataclass(frozen=True)
class LoopTick:
    """One driver loop iteration, as every other rank replays it."""

    # The commands the driver applied, made `replayable` and pickled before it applied them.
    commands: bytes
    action: LoopAction
    hold_admission: bool
    # With action EXIT: fail the requests still live (a hard stop) rather than expect none.
    hard_stop: bool
    # The driver's state before these commands; each rank checks its own against it.
    digest: tuple[int, ...]


def replayable(command: LoopCommand) -> LoopCommand:
    """A command as the other ranks replay it: without the caller's futures, and with in-memory tensors
    described rather than pickled (their bytes follow the tick)."""
    if not isinstance(command, UpdateWeights):
        return without_callers(command)
    update = command.update
    if not isinstance(update.source, str):
        # Entries that are not (name, tensor) pairs go pickled, and every rank rejects them alike.
        with contextlib.suppress(TypeError, ValueError):
            update = WeightUpdate(TensorBroadcast.describe(update.source), update.label)
    return UpdateWeights(update, None)


def encode_commands(replayed: list[LoopCommand]) -> bytes:
    """`replayable` commands as a tick carries them."""
    return pickle.dumps(replayed)


def send_tensors(group: TensorParallelGroup, tensors: list[tuple[str, torch.Tensor]]) -> None:
    """Driver: the bytes of tensors a `TensorBroadcast` described, in its order."""
    for _name, tensor in tensors:
        if tensor.numel():
            data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
            dist.broadcast(data, src=DRIVER_RANK, group=group.cpu_group)


def receive_tensors(group: TensorParallelGroup, broadcast: TensorBroadcast) -> list[tuple[str, torch.Tensor]]:
    """Other ranks: the tensors `broadcast` describes, as the driver sends them."""
    tensors = []
    for spec in broadcast.specs:
        data = torch.empty(spec.num_bytes, dtype=torch.uint8)
        if spec.num_bytes:
            dist.broadcast(data, src=DRIVER_RANK, group=group.cpu_group)
        tensors.append((spec.name, data.view(spec.dtype).reshape(spec.shape)))
    return tensors


class _LockstepLoop(GenerationLoop):
    """What the driver and the other ranks share: the group, and the digest of the tokens sampled."""

    def __init__(
        self,
        engine: EngineCore,
        router: OutputRouter,
        listeners: LoopListeners,
        max_queue_size: int,
        group: TensorParallelGroup,
    ) -> None:
        super().__init__(engine, router, listeners, max_queue_size, agreement=group)
        self.group = group
        self._tokens_emitted = 0
        self._token_sum = 0

    def close(self) -> None:
        super().close()
        if not self.is_running():
            self.group.close()

    def _on_step_result(self, result: StepResult) -> None:
        for request in result.advanced:
            self._tokens_emitted += 1
            self._token_sum = (self._token_sum + request.all_token_ids[-1]) % TOKEN_SUM_MODULUS

    def _digest(self) -> tuple[int, int, int, int]:
        """What every rank must agree on after each iteration; a mismatch means the lockstep broke."""
        return (self.weights.version, self.engine.num_failed_steps, self._tokens_emitted, self._token_sum)

    def _check_can_apply_stopped(self) -> None:
        raise RuntimeError(
            "under tensor parallelism, weight updates, sleep and the weight-update group need the running "
            "loop (every rank applies them in step): start the engine first"
        )


class LockstepDriverLoop(_LockstepLoop):
    """Rank 0: runs the loop as in a single process and tells the other ranks what each iteration did."""

    # While the loop is stopped: tells the other ranks that the driver still lives.
    _stopped_heartbeat: StoppedHeartbeat | None = None

    def _tick_interval_s(self) -> float:
        """How often an idle, parked or stopped driver tells the other ranks it lives."""
        return min(IDLE_TICK_S, (self.group.timeout_s or IDLE_TICK_S) / 4)

    def _before_start(self) -> None:
        if self.loop_error is not None:
            raise RuntimeError(f"{self.loop_error}; restart the processes to serve again")
        try:
            self._end_stopped_heartbeat(StoppedDriverNews.RESTART)
        except RuntimeError as exc:
            self.loop_error = str(exc)
            raise

    def _on_stopped(self) -> None:
        self._stopped_heartbeat = StoppedHeartbeat(self.group, self._tick_interval_s())

    def close(self) -> None:
        try:
            self._end_stopped_heartbeat(StoppedDriverNews.END)
        except RuntimeError as exc:
            logger.warning("%s", exc)
        super().close()

    def _end_stopped_heartbeat(self, news: StoppedDriverNews) -> None:
        """Tells the other ranks `news` if the driver is stopped; raises RuntimeError if a rank was lost
        meanwhile."""
        heartbeat, self._stopped_heartbeat = self._stopped_heartbeat, None
        if heartbeat is not None:
            heartbeat.end(news)

    def _share_commands(self, commands: list[LoopCommand]) -> Any:
        # Made replayable now: applying the commands mutates their requests.
        replayed = [replayable(command) for command in commands]
        return self._digest(), replayed, encode_commands(replayed)

    def _share_decision(
        self, shared: Any, commands: list[LoopCommand], action: LoopAction, hold: bool, hard: bool
    ) -> None:
        digest, replayed, encoded = shared
        self.group.broadcast(LoopTick(encoded, action, hold, hard, digest))
        for command, replayed_command in zip(commands, replayed, strict=True):
            if (
                isinstance(command, UpdateWeights)
                and isinstance(replayed_command, UpdateWeights)
                and isinstance(replayed_command.update.source, TensorBroadcast)
            ):
                send_tensors(self.group, command.update.source)

    def _wait_timeout(self, action: LoopAction) -> float | None:
        # An idle or parked driver still ticks now and then, so that the other ranks never time out.
        return self._tick_interval_s()


class LockstepFollowerLoop(_LockstepLoop):
    """Every other rank: replays the driver's ticks. A stop on the driver ends the replay; this loop then
    waits for the next one (`start()` on the driver) or the end (`destroy()` on the driver)."""

    _publishes_outputs = False

    def _run_until_stopped(self) -> None:
        self._replay_until_stopped()
        while self._await_restart():
            self._replay_until_stopped()

    def _replay_until_stopped(self) -> None:
        super()._run_until_stopped()
        self._hard_stop_requested = False  # the driver's start() clears its own

    def _await_restart(self) -> bool:
        """True when the stopped driver starts again, False when it ends."""
        while True:
            news = self.group.broadcast(None)
            if news != StoppedDriverNews.STILL_STOPPED:
                return bool(news == StoppedDriverNews.RESTART)

    def _iterate(self) -> bool:
        tick: LoopTick = self.group.broadcast(None)
        commands = [self._with_broadcast_tensors(command) for command in pickle.loads(tick.commands)]
        digest = self._digest()
        if tick.digest != digest:
            raise RuntimeError(
                f"rank {self.group.rank} diverged from the driver: (weight_version, failed steps, "
                f"tokens, token sum) is {digest} here and {tick.digest} on the driver"
            )
        local, collective = split_collective(commands)
        for command in local:
            self._apply(command)
        if tick.action != LoopAction.STEP:
            self._flush_step_in_flight()
        self.engine.hold_admission = tick.hold_admission
        self._paused = tick.action == LoopAction.PARK
        for command in collective:  # with the driver, which applies them right after the tick
            self._apply(command)
        if tick.action == LoopAction.EXIT:
            if tick.hard_stop:
                self._hard_stop_requested = True
            return False
        if tick.action == LoopAction.STEP:
            self._step()
        elif commands:
            self._refresh_stats()
        return True

    def _with_broadcast_tensors(self, command: LoopCommand) -> LoopCommand:
        """A replayed command with the tensors that followed its tick in place of their description."""
        if isinstance(command, UpdateWeights) and isinstance(command.update.source, TensorBroadcast):
            tensors = receive_tensors(self.group, command.update.source)
            return replace(command, update=WeightUpdate(tensors, command.update.label))
        return command


class StoppedHeartbeat:
    """The driver's side of a stop: until `end`, it tells the other ranks every `interval_s` that the
    engine is still stopped, from a thread of its own (the loop thread has ended)."""

    def __init__(self, group: TensorParallelGroup, interval_s: float) -> None:
        self._group = group
        self._interval_s = interval_s
        self._cond = threading.Condition()
        self._news: StoppedDriverNews | None = None
        self.error: str | None = None
        self._thread = threading.Thread(target=self._run, name="cbserve-tp-stopped", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._news is None:
                    self._cond.wait(self._interval_s)
                news = self._news
            try:
                self._group.broadcast(news or StoppedDriverNews.STILL_STOPPED)
            except Exception as exc:  # a rank died or hung while the engine was stopped
                self.error = f"{type(exc).__name__}: {exc}"
                logger.error("a tensor-parallel rank was lost while the engine was stopped: %s", self.error)
                return
            if news is not None:
                return

    def end(self, news: StoppedDriverNews) -> None:
        """Tells the other ranks `news` (RESTART or END) and returns once they have it; raises
        RuntimeError if a rank was lost meanwhile."""
        with self._cond:
            self._news = news
            self._cond.notify_all()
        self._thread.join()
        if self.error is not None:
            raise RuntimeError(
                f"a tensor-parallel rank was lost while the engine was stopped ({self.error}); "
                "restart the processes to serve again"
            )


def generation_loop_for(
    engine: EngineCore,
    router: OutputRouter,
    listeners: LoopListeners,
    max_queue_size: int,
    group: TensorParallelGroup | None,
) -> GenerationLoop:
    """The loop this process runs: the plain one in a single process; under tensor parallelism the
    driver's on rank 0 and a follower's on every other rank."""
    if group is None:
        return GenerationLoop(engine, router, listeners, max_queue_size)
    if group.is_driver:
        return LockstepDriverLoop(engine, router, listeners, max_queue_size, group)
    return LockstepFollowerLoop(engine, router, listeners, max_queue_size, group)
