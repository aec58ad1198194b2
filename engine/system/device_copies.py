"""Host <-> device copies that never make the host wait for the device.

On CUDA a copy from pageable host memory, or `.tolist()` on a device tensor, synchronises the stream:
the host stops until every queued kernel, including a step still running, has finished. Async batching
prepares step N+1 while step N runs, so its copies go through pinned memory with `non_blocking=True`
and are queued behind step N instead. PyTorch's pinned-memory allocator keeps a pinned buffer alive
until the copy that reads it has run, so a freed buffer is never overwritten early (this is the double
buffering of the inputs). On the CPU these are plain tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def to_device(values: Sequence[Any], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` as a tensor on `device`, queued behind the device's running work (never waited for)."""
    if device.type == "cpu":
        return torch.tensor(values, dtype=dtype)
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


class HostCopies:
    """Device tensors copied to the host as soon as the work queued so far produces them.

    The copies are queued now, so work queued later (the next step) does not delay them; `wait()` blocks
    until they have landed and returns the host tensors in the order given.
    """

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self._event: torch.cuda.Event | None = None
        if not tensors or tensors[0].device.type != "cuda":
            self._host = [tensor.cpu() for tensor in tensors]
            return
        self._host = [
            torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True).copy_(tensor, non_blocking=True)
            for tensor in tensors
        ]
        self._event = torch.cuda.Event()
        self._event.record()

    def ready(self) -> bool:
        """Whether the copies have landed (never blocks)."""
        return self._event is None or self._event.query()

    def wait(self) -> list[torch.Tensor]:
        if self._event is not None:
            self._event.synchronize()
        return self._host
