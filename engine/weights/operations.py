"""`WeightsAndMemory`: what callers do to the served weights and the engine's memory: in-place updates
(from tensors, files, a trainer's process group or CUDA IPC handles), sleep and wake. It checks what they
pass, then posts it to the generation loop, which applies it between two steps
(engine.loop.weights_and_sleep). `ContinuousBatchingManager` composes one and forwards its public methods.

The names follow SGLang's and vLLM's for the same operations (docs/weight-sync.md).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

import torch

from engine.engine_core import model_device
from engine.loop.commands import (
    ChecksumWeights,
    JoinWeightsUpdateGroup,
    LeaveWeightsUpdateGroup,
    PauseMode,
    Sleep,
    SleepOutcome,
    UpdateWeights,
    UpdateWeightsFromGroup,
    WakeUp,
    WeightUpdate,
)
from engine.loop.generation_loop import GenerationLoop
from engine.parallel import tensor_parallel_size
from engine.weights.checksum import WeightsChecksum
from engine.weights.cuda_ipc import CudaIpcHandle, open_ipc_tensor
from engine.weights.sleep import check_sleep_level, check_wake_tags
from engine.weights.tensors import UpdateTargets, check_tensor
from engine.weights.transfer import (
    DEFAULT_GROUP_NAME,
    DEFAULT_GROUP_TIMEOUT_S,
    BucketPlan,
    GroupSpec,
    JoinedGroup,
    WeightsUpdateGroup,
    check_bucket_plan,
)

logger = logging.getLogger(__name__)


class WeightsAndMemory:
    """Weight updates, the trainer's weight-update group, sleep and wake (see the module docstring).

    `running_loop()` is the manager's loop, built with the engine on first use; `current_loop()` the
    loop if it was built, else None. Updates, group changes and sleep are serialised by `_update_lock`.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        is_driver: bool,
        running_loop: Callable[[], GenerationLoop],
        current_loop: Callable[[], GenerationLoop | None],
    ) -> None:
        self.model = model
        self.is_driver = is_driver
        self._running_loop = running_loop
        self._current_loop = current_loop
        self._update_lock = threading.Lock()

    def _require_driver(self, call: str) -> GenerationLoop:
        if not self.is_driver:
            raise RuntimeError(f"{call} is called on the driver rank (0); it reaches every rank")
        return self._running_loop()

    @property
    def weight_version(self) -> int:
        """Version of the weights served: 1 at start, +1 per update."""
        loop = self._current_loop()
        return loop.weights.version if loop is not None else 1

    @property
    def weight_version_label(self) -> str | None:
        """The label the last update gave its weights (its `version` argument); None at start."""
        loop = self._current_loop()
        return loop.weights.version_label if loop is not None else None

    def label_weights(self, label: str) -> None:
        """Names the weights served now, as an update's `version` argument would (vLLM's
        update_weight_version, for a trainer that labels its weights after pushing them): the weights, the
        version number and the prefix cache stay as they are. Serialised with updates, so a label never
        lands on the weights of an update still being written."""
        loop = self._require_driver("label_weights")
        with self._update_lock:
            loop.weights.version_label = label

    def weights_checksum(self) -> WeightsChecksum:
        """A digest of every tensor of the model's state dict and of them all, computed on the device
        that holds them, between two steps, with the weight version it is of (engine.weights.checksum
        defines it; a trainer computes the same of its own tensors with `cbserve_client.weights_checksum`).
        Equal weights give equal digests, on any device."""
        return self._require_driver("weights_checksum").call(ChecksumWeights)

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
        loop = self._require_driver("update_weights")
        source: Any
        if isinstance(state_dict_or_path, (str, os.PathLike)):
            source = os.fspath(state_dict_or_path)
        elif isinstance(state_dict_or_path, Mapping):
            source = list(state_dict_or_path.items())
        else:
            source = list(state_dict_or_path)
        return self._update(loop, WeightUpdate(source, version))

    def _update(self, loop: GenerationLoop, update: WeightUpdate) -> int:
        with self._update_lock, loop.pause(PauseMode.KEEP):
            return loop.call(lambda result: UpdateWeights(update, result))

    # ------------------------------------------------------------------ the trainer's group

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
        """Joins the process group a trainer created at `master_address:master_port` (it is rank 0):
        each tensor-parallel rank joins as `rank_offset + tp_rank`. Returns those ranks and the backend
        once every member joined (the loop does not step meanwhile). Raises ValueError for a bad field,
        RuntimeError when already in a group, WeightTransferError (WeightTransferTimeout after
        `timeout_s`) when the group does not form."""
        loop = self._require_driver("init_weights_update_group")
        spec = GroupSpec(master_address, master_port, rank_offset, world_size, backend, group_name, timeout_s)
        spec.check(tensor_parallel_size(self.model))
        with self._update_lock:
            stale = loop.weights.update_group
            if stale is not None and not stale.trainer_alive():
                # The trainer died between pushes: nothing noticed, since nothing was being received.
                logger.warning("the trainer of the weight-update group this server is in is gone: leaving it")
                loop.call(LeaveWeightsUpdateGroup)
            if loop.weights.update_group_ranks:
                raise RuntimeError(
                    f"already in a weight-update group (ranks {list(loop.weights.update_group_ranks)}); "
                    "destroy it first"
                )
            joined: JoinedGroup = loop.call(lambda result: JoinWeightsUpdateGroup(spec, result))
            group = loop.weights.update_group
        if group is not None:  # only the driver watches; the other ranks follow its command to leave
            group.watch_trainer(lambda gone: self._leave_group_of_dead_trainer(loop, gone))
        return joined

    def _leave_group_of_dead_trainer(self, loop: GenerationLoop, group: WeightsUpdateGroup) -> None:
        """On the group's watch thread: leaves `group` if it is still this server's (a transfer holds
        `_update_lock` and leaves by itself when it fails)."""
        with self._update_lock:
            if loop.weights.update_group is not group:
                return
            logger.warning("the trainer of the weight-update group is gone: leaving the group")
            try:
                loop.call(LeaveWeightsUpdateGroup)
            except Exception as exc:  # the loop stopped meanwhile: it leaves the group as it ends
                logger.info("could not leave the group of a trainer that is gone: %s", exc)

    def check_weights_update(self, plan: BucketPlan) -> None:
        """Raises ValueError naming the first tensor or bucket of `plan` the model cannot take."""
        check_bucket_plan(UpdateTargets.of(self.model).tensors, plan)

    def update_weights_from_distributed(
        self, plan: BucketPlan, version: str | None = None, on_ready: Callable[[], None] | None = None
    ) -> int:
        """Receives new weights broadcast by the trainer over the group, bucket by bucket as `plan`
        announces them, and returns the new `weight_version`. The whole plan is checked first
        (ValueError, nothing received). `on_ready()` runs once the loop waits for the first bucket: the
        trainer broadcasts then. Runs under a KEEP pause, like `update_weights`.

        If the transfer fails (the trainer died or stalled past the group's timeout) the group is left
        and WeightTransferError raised. With no bucket written, the weights are unchanged; otherwise
        every request waits (none is served from a mix of two versions; `stats().weights_incomplete`
        says why) until an update that writes every tensor of the failed one succeeds."""
        loop = self._require_driver("update_weights_from_distributed")
        self.check_weights_update(plan)
        ready: Future[None] = Future()
        if on_ready is not None:
            ready.add_done_callback(lambda _: on_ready())
        with self._update_lock, loop.pause(PauseMode.KEEP):
            if not loop.weights.update_group_ranks:
                raise RuntimeError("not in a weight-update group: join one first")
            return loop.call(lambda result: UpdateWeightsFromGroup(plan, version, ready, result))

    def abort_weights_transfer(self) -> None:
        """Ends a transfer in progress from another thread (its caller gave up before the trainer
        broadcast): the receive fails, and the update with it."""
        loop = self._current_loop()
        group = loop.weights.update_group if loop is not None else None
        if group is not None:
            group.abort()

    def destroy_weights_update_group(self) -> bool:
        """Leaves the trainer's group; False when in none."""
        loop = self._require_driver("destroy_weights_update_group")
        with self._update_lock:
            left: bool = loop.call(LeaveWeightsUpdateGroup)
        return left

    def update_weights_from_ipc(self, handles: Iterable[CudaIpcHandle], version: str | None = None) -> int:
        """Copies new weights from a colocated trainer's CUDA tensors, device to device, and returns
        the new `weight_version`. Every handle is checked against the model before one is opened
        (ValueError naming the tensor); RuntimeError unless the model is on a CUDA device."""
        loop = self._require_driver("update_weights_from_ipc")
        handles = list(handles)
        if model_device(self.model).type != "cuda":
            raise RuntimeError("CUDA IPC weight updates need the model on a CUDA device")
        targets = UpdateTargets.of(self.model).tensors
        for handle in handles:
            check_tensor(targets, handle.name, handle.shape, handle.torch_dtype)
        tensors = [(handle.name, open_ipc_tensor(handle)) for handle in handles]
        return self._update(loop, WeightUpdate(tensors, version))

    # ------------------------------------------------------------------ sleep

    def sleep(self, level: int = 1, mode: str = "keep") -> SleepOutcome:
        """Frees memory for a colocated trainer: level 1 the KV cache (prefix cache dropped), level 2
        the weights too (moved to host memory). `mode` treats in-flight requests as `pause` does, except
        that "keep" puts them back in the queue to be recomputed after `wake_up`. Requests wait while
        asleep; weight updates still apply."""
        sleep_level = check_sleep_level(level)
        modes = tuple(PauseMode)
        if mode not in modes:
            raise ValueError(f"mode must be one of {tuple(str(each) for each in modes)}, got {mode!r}")
        loop = self._require_driver("sleep")
        with self._update_lock, loop.pause(PauseMode(mode)) as handle:
            outcome: SleepOutcome = loop.call(lambda result: Sleep(sleep_level, result))
        return replace(outcome, cancelled_requests=handle.cancelled)

    def wake_up(self, tags: list[str] | tuple[str, ...] | None = None) -> int:
        """Takes back what sleep freed: "weights", "kv_cache", or both (None); returns the sleep level
        left (0: serving)."""
        loop = self._require_driver("wake_up")
        wake_tags = check_wake_tags(tags)
        with self._update_lock:
            level: int = loop.call(lambda result: WakeUp(wake_tags, result))
        return level
