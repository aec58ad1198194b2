"""The engine operations an operator or a trainer calls through the AdminService, typed.

`EngineHost.admin` is the servicers' one way to the engine for anything but requests: pausing, the
prefix cache, weights (checksum, in-place updates, the trainer's weight-update group, CUDA IPC) and
memory (sleep, wake). Every method but `pause` blocks until the engine has done it: servicers run them in
a worker thread, off the event loop. Errors are the engine's (ValueError for a bad argument, RuntimeError
for a state that forbids the call, WeightTransferError when a transfer fails); servicers map them to
status codes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager

import torch

from engine import (
    BucketPlan,
    ContinuousBatchingManager,
    CudaIpcHandle,
    JoinedGroup,
    PauseHandle,
    PrefixCacheReset,
    SleepOutcome,
    WeightsChecksum,
    tensor_parallel_size,
)


class EngineAdmin:
    def __init__(self, manager: ContinuousBatchingManager, model: torch.nn.Module) -> None:
        self._manager = manager
        self._model = model

    @property
    def weight_version(self) -> int:
        """Version of the weights served now (1 at start, +1 per update)."""
        return self._manager.weight_version

    @property
    def weight_version_label(self) -> str | None:
        """The label the trainer gave the weights served now (an update's, or `label_weights`'s)."""
        return self._manager.weight_version_label

    def label_weights(self, label: str) -> None:
        """Names the weights served now without changing them, their version or the prefix cache."""
        self._manager.label_weights(label)

    @property
    def tensor_parallel_size(self) -> int:
        return tensor_parallel_size(self._model)

    def is_running(self) -> bool:
        return self._manager.is_running()

    def pause(self, mode: str) -> AbstractContextManager[PauseHandle]:
        """Parks the loop while the context is held ("keep", "wait" or "abort" the requests in flight);
        entering blocks until it is parked."""
        return self._manager.pause(mode)

    def reset_prefix_cache(self, abort: bool = False) -> PrefixCacheReset:
        """Drops every cached prefix block; EngineBusyError with requests in flight unless `abort`."""
        return self._manager.reset_prefix_cache(abort=abort)

    def weights_checksum(self) -> WeightsChecksum:
        return self._manager.weights_checksum()

    def update_weights(self, source: dict[str, torch.Tensor] | str, version_label: str | None) -> int:
        """Replaces weights in place from tensors or a safetensors path; returns the new weight version."""
        return self._manager.update_weights(source, version=version_label)

    # ------------------------------------------------------------------ the trainer's weight-update group

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        backend: str,
        group_name: str,
        timeout_s: float,
    ) -> JoinedGroup:
        return self._manager.init_weights_update_group(
            master_address,
            master_port,
            rank_offset,
            world_size,
            backend=backend,
            group_name=group_name,
            timeout_s=timeout_s,
        )

    def check_weights_update(self, plan: BucketPlan) -> None:
        """ValueError naming the first tensor or bucket of `plan` the model cannot take."""
        self._manager.check_weights_update(plan)

    def update_weights_from_distributed(
        self, plan: BucketPlan, version_label: str | None, on_ready: Callable[[], None]
    ) -> int:
        """Receives the weights the trainer broadcasts; `on_ready()` runs (on a worker thread) once the
        engine waits for the first bucket. Returns the new weight version."""
        return self._manager.update_weights_from_distributed(plan, version=version_label, on_ready=on_ready)

    def abort_weights_transfer(self) -> None:
        """Safe from any thread: a transfer waiting for the trainer fails now."""
        self._manager.abort_weights_transfer()

    def destroy_weights_update_group(self) -> bool:
        return self._manager.destroy_weights_update_group()

    def update_weights_from_ipc(self, handles: Sequence[CudaIpcHandle], version_label: str | None) -> int:
        return self._manager.update_weights_from_ipc(handles, version_label)

    # ------------------------------------------------------------------ memory

    def sleep(self, level: int, mode: str) -> SleepOutcome:
        return self._manager.sleep(level, mode)

    def wake_up(self, tags: Sequence[str]) -> int:
        """Takes back what sleep released (all of it when `tags` is empty); returns the sleep level left."""
        return self._manager.wake_up(list(tags))
