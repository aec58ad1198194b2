"""`WeightsAndSleep`: the weights the engine serves and the memory it gave back, as the generation loop
changes them between two steps: the weight version and its label, the trainer's weight-update group,
weights a failed transfer left a mix of two versions, and sleep.

The loop hands it the commands that touch weights or memory (`carry_out`); while it says so
(`holds_steps`: asleep, or weights incomplete) the loop runs no step. Outcomes every tensor-parallel rank
must share (everyone joined the group, the transfer succeeded everywhere) go through the injected
`RankAgreement` (engine.loop.agreement), so this object never needs to know how many ranks there are.

Threads: its methods run on the thread that applies the loop's commands (the loop thread, or the
caller's while the loop is stopped), never two at once. Other threads only read its fields, each one
attribute read (`update_group` to abort a transfer, `version` for the manager's property).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from engine.engine_core import EngineCore
from engine.errors import WeightTransferError
from engine.loop.agreement import RankAgreement
from engine.loop.commands import (
    ChecksumWeights,
    JoinWeightsUpdateGroup,
    LeaveWeightsUpdateGroup,
    Sleep,
    SleepOutcome,
    UpdateWeights,
    UpdateWeightsFromGroup,
    WakeUp,
    WeightUpdate,
)
from engine.request import FIRST_WEIGHT_VERSION
from engine.weights.checksum import WeightsChecksum, model_weights, weights_checksum
from engine.weights.sleep import SleepLevel, SleepTag, resident_memory
from engine.weights.tensors import UpdateTargets, apply_weights, stage_weights
from engine.weights.transfer import (
    GroupSpec,
    IncompleteWeights,
    JoinedGroup,
    TransferProgress,
    WeightsUpdateGroup,
    receive_buckets,
)

logger = logging.getLogger(__name__)

WeightsCommand = (
    ChecksumWeights
    | UpdateWeights
    | JoinWeightsUpdateGroup
    | LeaveWeightsUpdateGroup
    | UpdateWeightsFromGroup
    | Sleep
    | WakeUp
)


class WeightsAndSleep:
    def __init__(
        self, engine: EngineCore, agreement: RankAgreement, flush_step_in_flight: Callable[[], None]
    ) -> None:
        self.engine = engine
        self._agreement = agreement
        # Delivers a step launched ahead (async batching) before weights or caches change under it: its
        # tokens are the old weights' and are stamped with their version.
        self._flush_step_in_flight = flush_step_in_flight
        # 1 at start, +1 per update; the label the last update gave it.
        self.version = FIRST_WEIGHT_VERSION
        self.version_label: str | None = None
        # The trainer's weight-update group this rank joined, and the ranks this engine holds in it.
        self.update_group: WeightsUpdateGroup | None = None
        self.update_group_ranks: tuple[int, ...] = ()
        # What sleep gave back (engine.weights.sleep); empty when awake.
        self.asleep: set[SleepTag] = set()
        # Set when a transfer failed after writing some weights, until an update covers every tensor.
        self.incomplete: IncompleteWeights | None = None

    @property
    def holds_steps(self) -> bool:
        """Whether requests must wait: asleep, or the weights a mix of two versions."""
        return bool(self.asleep) or self.incomplete is not None

    def sleep_level(self) -> SleepLevel:
        if SleepTag.WEIGHTS in self.asleep:
            return SleepLevel.WEIGHTS
        return SleepLevel.KV_CACHE if self.asleep else SleepLevel.AWAKE

    def carry_out(self, command: WeightsCommand) -> Any:
        """Applies `command` and returns what its caller waits for."""
        if isinstance(command, ChecksumWeights):
            checksum: WeightsChecksum = weights_checksum(model_weights(self.engine.model))
            return replace(checksum, weight_version=self.version)
        if isinstance(command, UpdateWeights):
            return self._apply_update(command.update)
        if isinstance(command, JoinWeightsUpdateGroup):
            return self._join_update_group(command.spec)
        if isinstance(command, LeaveWeightsUpdateGroup):
            return self.leave_update_group()
        if isinstance(command, UpdateWeightsFromGroup):
            return self._update_from_group(command)
        if isinstance(command, Sleep):
            return self._sleep(command.level)
        return self._wake_up(command.tags)

    def leave_update_group(self) -> bool:
        """Leaves the trainer's weight-update group; False when in none."""
        group = self.update_group
        self.update_group = None
        self.update_group_ranks = ()
        if group is None:
            return False
        group.close()
        logger.info("left the weight-update group")
        return True

    def _apply_update(self, update: WeightUpdate) -> int:
        self._flush_step_in_flight()
        staged = stage_weights(self.engine.model, update.source)
        apply_weights(staged)
        return self._new_version(frozenset(item.name for item in staged), update.label)

    def _new_version(self, names: frozenset[str], label: str | None) -> int:
        """After new weights were written: the version goes up, the prefix cache (the old weights' KV)
        goes and requests that asked to recompute their KV will (EngineCore.begin_weight_version), and
        weights left incomplete by a failed transfer are whole again if `names` covers every
        tensor it announced."""
        self.version += 1
        self.version_label = label
        self.engine.begin_weight_version(self.version)
        if self.incomplete is not None and self.incomplete.tensor_names <= names:
            self.incomplete = None
            logger.info("the weights are whole again")
        logger.info(
            "weights updated: %d tensors, weight_version %d%s",
            len(names),
            self.version,
            f" ({label})" if label else "",
        )
        return self.version

    def _join_update_group(self, spec: GroupSpec) -> JoinedGroup:
        """Joins on every tensor-parallel rank, or on none: a rank that could not join makes all leave."""
        agreement = self._agreement
        group: WeightsUpdateGroup | None = None
        error: Exception | None = None
        try:
            group = WeightsUpdateGroup(spec, spec.rank_offset + agreement.rank, self.engine.device)
        except Exception as exc:
            error = exc
        [everyone_joined] = agreement.smallest([int(group is not None)])
        if not everyone_joined:
            if group is not None:
                group.close()
            raise error or WeightTransferError("another tensor-parallel rank could not join the group")
        assert group is not None  # every rank joined, this one included
        self.update_group = group
        self.update_group_ranks = tuple(spec.rank_offset + rank for rank in range(agreement.tp_size))
        return JoinedGroup(self.update_group_ranks, group.backend)

    def _update_from_group(self, command: UpdateWeightsFromGroup) -> int:
        """Receives the buckets; every tensor-parallel rank agrees on the outcome. A failure leaves the
        group, and, once any rank wrote a bucket, holds every step until an update covers the lot."""
        self._flush_step_in_flight()
        group = self.update_group
        progress = TransferProgress()
        error: Exception | None = None
        ready = command.ready
        on_ready = None if ready is None else (lambda: ready.set_result(None))
        try:
            if group is None:
                raise WeightTransferError("not in a weight-update group: join one first")
            receive_buckets(group, command.plan, UpdateTargets.of(self.engine.model), progress, on_ready)
        except Exception as exc:
            error = exc
        succeeded, fewest_applied = self._agreement.smallest(
            [int(error is None), -progress.num_buckets_applied]
        )
        if succeeded:
            return self._new_version(command.plan.tensor_names, command.label)
        self.leave_update_group()
        reason = str(error) if error is not None else "another tensor-parallel rank failed the transfer"
        if fewest_applied == 0:  # no rank wrote anything
            raise WeightTransferError(f"weights unchanged: {reason}")
        self.engine.reset_prefix_cache()
        earlier = self.incomplete
        names = command.plan.tensor_names | (earlier.tensor_names if earlier else frozenset())
        self.incomplete = IncompleteWeights(reason, names)
        logger.error("weight transfer failed midway; requests wait for a complete update: %s", reason)
        raise WeightTransferError(
            f"the transfer failed after writing some weights ({reason}); requests wait until an update "
            "of every announced tensor succeeds"
        )

    def _sleep(self, level: SleepLevel) -> SleepOutcome:
        engine = self.engine
        self._flush_step_in_flight()
        released = requeued = 0
        resident_before = resident_memory(engine.device)
        if self.update_group is not None:
            released += self.update_group.release_buffer()
        if SleepTag.KV_CACHE not in self.asleep:
            release = engine.release_kv_cache()
            released += release.bytes_released
            requeued = release.num_requeued
            self.asleep.add(SleepTag.KV_CACHE)
        if level >= SleepLevel.WEIGHTS and SleepTag.WEIGHTS not in self.asleep:
            released += engine.offload_weights()
            self.asleep.add(SleepTag.WEIGHTS)
        resident_after = resident_memory(engine.device)
        resident_released = None
        if resident_before is not None and resident_after is not None:
            resident_released = max(0, resident_before - resident_after)
        return SleepOutcome(released, requeued, resident_bytes_released=resident_released)

    def _wake_up(self, tags: frozenset[SleepTag]) -> int:
        if SleepTag.WEIGHTS in tags and SleepTag.WEIGHTS in self.asleep:
            self.engine.reload_weights()
            self.asleep.discard(SleepTag.WEIGHTS)
        if SleepTag.KV_CACHE in tags and SleepTag.KV_CACHE in self.asleep:
            self.engine.restore_kv_cache()
            self.asleep.discard(SleepTag.KV_CACHE)
        return self.sleep_level()
