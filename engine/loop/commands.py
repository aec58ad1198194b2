"""What callers post to the generation loop, and what the loop decides to do each iteration.

Callers never touch the engine: they post a command, and the loop thread applies it between two steps.
Under tensor parallelism the same commands are replayed on every rank (engine.loop.lockstep), so a command
carries plain data only, plus the caller's `Future` where it waits for an answer.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, fields, replace
from enum import Enum, StrEnum
from typing import Any

from engine.request import Request
from engine.weights.checksum import WeightsChecksum
from engine.weights.sleep import SleepLevel, SleepTag
from engine.weights.transfer import BucketPlan, GroupSpec, JoinedGroup


class LoopAction(Enum):
    """What the loop does after applying an iteration's commands."""

    STEP = "step"  # run one engine step
    IDLE = "idle"  # nothing to run: wait for a command
    PARK = "park"  # held by a pause: wait for the last holder to leave
    EXIT = "exit"  # stopped: end the loop thread


class PauseMode(StrEnum):
    """How `pause()` treats in-flight requests: keep them, let them finish first, or cancel them."""

    KEEP = "keep"
    WAIT = "wait"
    ABORT = "abort"


@dataclass
class PauseHandle:
    """What `pause()` yields: its mode and, for "abort", how many requests it cancelled."""

    mode: PauseMode = PauseMode.KEEP
    cancelled: int = 0
    # Set by the loop: for "wait", once no in-flight request is left; for "abort", once they are cancelled.
    done: bool = False


@dataclass(frozen=True)
class WeightUpdate:
    """New weights as the loop applies them: a safetensors path, or a list of (name, tensor) pairs (on
    the other tensor-parallel ranks, an `engine.loop.lockstep.TensorBroadcast` whose bytes follow the
    tick)."""

    source: Any
    label: str | None


@dataclass(frozen=True)
class AddRequest:
    request: Request


@dataclass(frozen=True)
class CancelRequest:
    request_id: str


@dataclass(frozen=True)
class AbortAll:
    """Cancel every in-flight and queued request (a pause in mode "abort")."""

    handle: PauseHandle


@dataclass(frozen=True)
class UpdateWeights:
    update: WeightUpdate
    # The caller waiting for the new weight version; None where nobody waits (a replaying rank).
    result: Future[int] | None


@dataclass(frozen=True)
class PrefixCacheReset:
    """What a prefix-cache reset did."""

    # Reusable prefix blocks forgotten.
    num_blocks: int
    # Requests cancelled first (a reset with abort).
    num_aborted: int = 0


@dataclass(frozen=True)
class ResetPrefixCache:
    """Forget every reusable prefix block, once no request is in flight: with `abort`, after cancelling
    them; without, EngineBusyError while there are some."""

    abort: bool
    # The caller waiting for the outcome; None where nobody waits.
    result: Future[PrefixCacheReset] | None


@dataclass(frozen=True)
class ChecksumWeights:
    """Digest the weights (engine.weights.checksum; every tensor-parallel rank at once: collective, since a
    sharded tensor is gathered whole)."""

    result: Future[WeightsChecksum] | None


@dataclass(frozen=True)
class JoinWeightsUpdateGroup:
    """Join a trainer's weight-update group (every tensor-parallel rank at once: collective)."""

    spec: GroupSpec
    result: Future[JoinedGroup] | None


@dataclass(frozen=True)
class LeaveWeightsUpdateGroup:
    # The caller waiting to learn whether there was a group to leave.
    result: Future[bool] | None


@dataclass(frozen=True)
class UpdateWeightsFromGroup:
    """Receive `plan`'s buckets from the trainer (every tensor-parallel rank at once: collective)."""

    plan: BucketPlan
    label: str | None
    # Set once the loop waits for the first bucket (the trainer may broadcast then).
    ready: Future[None] | None
    result: Future[int] | None


@dataclass(frozen=True)
class SleepOutcome:
    # The size of what was released (cache tensors, and weights at level 2), allocated or not.
    released_bytes: int
    # Requests put back in the queue to be recomputed after the wake-up (mode "keep").
    requeued_requests: int
    # Requests the sleep's pause cancelled (mode "abort").
    cancelled_requests: int = 0
    # How much the memory in use fell, as the system counts it (engine.weights.sleep.resident_memory):
    # less than `released_bytes` where the cache was never written in full. None where it cannot be measured.
    resident_bytes_released: int | None = None


@dataclass(frozen=True)
class Sleep:
    level: SleepLevel
    result: Future[SleepOutcome] | None


@dataclass(frozen=True)
class WakeUp:
    tags: frozenset[SleepTag]
    # The caller waiting for the sleep level left.
    result: Future[int] | None


LoopCommand = (
    AddRequest
    | CancelRequest
    | AbortAll
    | UpdateWeights
    | ResetPrefixCache
    | ChecksumWeights
    | JoinWeightsUpdateGroup
    | LeaveWeightsUpdateGroup
    | UpdateWeightsFromGroup
    | Sleep
    | WakeUp
)

# Commands every tensor-parallel rank carries out at the same time, since they run collectives (with the
# trainer, or among the ranks to gather sharded weights): each rank applies them only once the iteration's
# tick is shared (engine.loop.lockstep), never before.
COLLECTIVE_COMMANDS = (JoinWeightsUpdateGroup, UpdateWeightsFromGroup, ChecksumWeights)

_CALLER_FIELDS = ("result", "ready")


def without_callers(command: LoopCommand) -> LoopCommand:
    """`command` without the futures its caller waits on (as another rank replays it)."""
    names = {field.name for field in fields(command)} & set(_CALLER_FIELDS)
    cleared: dict[str, Any] = dict.fromkeys(names)
    return replace(command, **cleared) if names else command


def caller_futures(command: LoopCommand) -> list[Future[Any]]:
    """The futures a caller waits on in `command` (to fail them when the loop dies)."""
    futures = (getattr(command, name, None) for name in _CALLER_FIELDS)
    return [future for future in futures if isinstance(future, Future)]
