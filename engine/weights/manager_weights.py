"""The manager's weights and memory: in-place updates (from tensors, files, a trainer's process group or
CUDA IPC handles), sleep and wake. `ContinuousBatchingManager` inherits these; every call reaches the
generation loop, which applies it between two steps.

The names follow SGLang's and vLLM's for the same operations (README, "Weight sync for RL").
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from engine.engine_core import model_device
from engine.loop.commands import PauseMode, SleepOutcome, WeightUpdate
from engine.loop.generation_loop import GenerationLoop
from engine.parallel import tensor_parallel_size
from engine.weights.checksum import WeightsChecksum
from engine.weights.cuda_ipc import CudaIpcHandle, open_ipc_tensor
from engine.weights.sleep import check_sleep_level, check_wake_tags
from engine.weights.tensors import check_tensor, model_tensors
from engine.weights.transfer import (
    DEFAULT_GROUP_NAME,
    DEFAULT_GROUP_TIMEOUT_S,
    BucketPlan,
    GroupSpec,
    JoinedGroup,
    check_bucket_plan,
)


class WeightsAndMemory:
    """Weight updates, the trainer's weight-update group, sleep and wake (see the module docstring)."""

    # Provided by ContinuousBatchingManager.
    model: torch.nn.Module
    is_driver: bool
    _loop: GenerationLoop | None

    if TYPE_CHECKING:

        @property
        def _running_loop(self) -> GenerationLoop: ...

    def _require_driver(self, call: str) -> GenerationLoop:
        if not self.is_driver:
            raise RuntimeError(f"{call} is called on the driver rank (0); it reaches every rank")
        return self._running_loop

    @property
    def weight_version(self) -> int:
        """Version of the weights served: 1 at start, +1 per update."""
        return self._loop.weight_version if self._loop is not None else 1

    @property
    def weight_version_label(self) -> str | None:
        return self._loop.weight_version_label if self._loop is not None else None

    def weights_checksum(self) -> WeightsChecksum:
        """A digest of every tensor of the model's state dict and of them all, computed on the device
        that holds them, between two steps, with the weight version it is of (engine.weights.checksum
        defines it; a trainer computes the same of its own tensors with `cbserve_client.weights_checksum`).
        Equal weights give equal digests, on any device."""
        return self._require_driver("weights_checksum").weights_checksum()

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
        return loop.update_weights(WeightUpdate(source, version))

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
        return loop.join_weights_update_group(spec)

    def check_weights_update(self, plan: BucketPlan) -> None:
        """Raises ValueError naming the first tensor or bucket of `plan` the model cannot take."""
        check_bucket_plan(model_tensors(self.model), plan)

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
        return loop.update_weights_from_group(plan, version, on_ready)

    def abort_weights_transfer(self) -> None:
        """Ends a transfer in progress (its caller gave up before the trainer broadcast)."""
        if self._loop is not None:
            self._loop.abort_weights_transfer()

    def destroy_weights_update_group(self) -> bool:
        """Leaves the trainer's group; False when in none."""
        return self._require_driver("destroy_weights_update_group").leave_weights_update_group()

    def update_weights_from_ipc(self, handles: Iterable[CudaIpcHandle], version: str | None = None) -> int:
        """Copies new weights from a colocated trainer's CUDA tensors, device to device, and returns
        the new `weight_version`. Every handle is checked against the model before one is opened
        (ValueError naming the tensor); RuntimeError unless the model is on a CUDA device."""
        loop = self._require_driver("update_weights_from_ipc")
        handles = list(handles)
        if model_device(self.model).type != "cuda":
            raise RuntimeError("CUDA IPC weight updates need the model on a CUDA device")
        targets = model_tensors(self.model)
        for handle in handles:
            check_tensor(targets, handle.name, handle.shape, handle.torch_dtype)
        tensors = [(handle.name, open_ipc_tensor(handle)) for handle in handles]
        return loop.update_weights(WeightUpdate(tensors, version))

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
        return self._require_driver("sleep").sleep(sleep_level, PauseMode(mode))

    def wake_up(self, tags: list[str] | tuple[str, ...] | None = None) -> int:
        """Takes back what sleep freed: "weights", "kv_cache", or both (None); returns the sleep level
        left (0: serving)."""
        return self._require_driver("wake_up").wake_up(check_wake_tags(tags))
