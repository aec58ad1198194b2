"""Sleep and wake: memory given back to a colocated trainer, and taken again (vLLM's sleep mode).

Level 1 frees the KV cache: every running request is put back in the queue to be recomputed, the prefix
cache is dropped, and each cache tensor's storage is shrunk to nothing. Level 2 also moves the weights
to host memory. The tensors themselves stay (only their storage goes), so everything that holds them,
the runner's per-layer lists included, sees the memory again after `wake_up`; CUDA graphs, which hold
raw addresses, are dropped and captured again.

On the CPU the weights already live in host memory: level 2 only frees their packed copies
(engine.runner.packed_linear), which the layers make again on their first step after waking.

The engine does each level (`EngineCore.release_kv_cache`, `offload_weights` and their inverses); this
module holds the levels and tags, shrinking and regrowing tensors' storage, moving weights between
devices, and handing freed memory back to the system.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import sys
from collections.abc import Sequence
from enum import IntEnum, StrEnum

import psutil
import torch
from torch.distributed.tensor import DTensor

from engine.weights.tensors import model_tensors

logger = logging.getLogger(__name__)


class SleepLevel(IntEnum):
    AWAKE = 0
    KV_CACHE = 1  # the KV cache is freed
    WEIGHTS = 2  # and the weights are in host memory


class SleepTag(StrEnum):
    """What `wake_up` restores (vLLM's tags)."""

    WEIGHTS = "weights"
    KV_CACHE = "kv_cache"


def check_sleep_level(level: int) -> SleepLevel:
    if level not in (SleepLevel.KV_CACHE, SleepLevel.WEIGHTS):
        raise ValueError(
            f"level must be 1 (free the KV cache) or 2 (also move the weights to host), got {level}"
        )
    return SleepLevel(level)


def check_wake_tags(tags: list[str] | tuple[str, ...] | None) -> frozenset[SleepTag]:
    """The parts `tags` name (both when None or empty); ValueError naming an unknown one."""
    if not tags:
        return frozenset(SleepTag)
    known = {str(tag) for tag in SleepTag}
    for tag in tags:
        if tag not in known:
            raise ValueError(f"tags: unknown tag {tag!r}; expected some of {sorted(known)}")
    return frozenset(SleepTag(tag) for tag in tags)


def resident_memory(device: torch.device) -> int | None:
    """Memory in use as the system counts it: on a CUDA device, what torch's allocator reserves there;
    elsewhere the process's resident set size, where memory allocated but never written does not count
    (an idle server's KV cache, mostly). None where it cannot be read."""
    if device.type == "cuda":
        return int(torch.cuda.memory_reserved(device))
    try:
        return int(psutil.Process().memory_info().rss)
    except psutil.Error:
        return None


def move_weights(model: torch.nn.Module, device: torch.device) -> int:
    """Moves every parameter and buffer (this rank's shard of a sharded one) to `device`, in place,
    keeping the tensors (tied weights stay tied); returns the bytes moved."""
    moved = 0
    seen: set[int] = set()
    with torch.no_grad():
        for tensor in model_tensors(model).values():
            # Under no_grad, a DTensor's to_local() is the very tensor it holds.
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            if id(local) in seen or local.device == device:
                continue
            seen.add(id(local))
            moved += local.numel() * local.element_size()
            local.data = local.data.to(device)
    return moved


def release_storage(tensors: Sequence[torch.Tensor]) -> int:
    """Shrinks each tensor's storage to nothing (sleep, level 1); returns the bytes freed. The tensors
    stay, so whatever holds them sees memory again after `restore_storage`."""
    released = 0
    for tensor in tensors:
        storage = tensor.untyped_storage()
        released += storage.nbytes()
        storage.resize_(0)
    return released


def restore_storage(tensors: Sequence[torch.Tensor]) -> None:
    """Gives each tensor its storage back, its contents undefined."""
    for tensor in tensors:
        tensor.untyped_storage().resize_(tensor.numel() * tensor.element_size())


def return_freed_memory(device: torch.device) -> None:
    """Hands freed memory back to the system: CUDA's caching allocator keeps it otherwise, and glibc
    keeps large freed blocks below its (adaptive) mmap threshold in the heap."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
    elif sys.platform == "linux":
        with contextlib.suppress(OSError):  # another C library: memory returns as it decides
            ctypes.CDLL("libc.so.6").malloc_trim(0)
