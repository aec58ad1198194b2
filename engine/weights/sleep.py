"""Sleep and wake: memory given back to a colocated trainer, and taken again (vLLM's sleep mode).

Level 1 frees the KV cache: every running request is put back in the queue to be recomputed, the prefix
cache is dropped, and each cache tensor's storage is shrunk to nothing. Level 2 also moves the weights
to host memory. The tensors themselves stay (only their storage goes), so everything that holds them,
the runner's per-layer lists included, sees the memory again after `wake_up`; CUDA graphs, which hold
raw addresses, are dropped and captured again.

On the CPU the weights already live in host memory: level 2 only frees the copies of them packed for
oneDNN (engine.runner.packed_linear), which the layers make again on their first step after waking.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import sys
from enum import IntEnum, StrEnum

import psutil
import torch
from torch.distributed.tensor import DTensor

from engine.engine_core import EngineCore
from engine.kv.block_pool import NULL_BLOCK_ID
from engine.weights.tensors import model_tensors

logger = logging.getLogger(__name__)

HOST = torch.device("cpu")


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


def _cache_tensors(engine: EngineCore) -> list[torch.Tensor]:
    return [tensor for cache in engine.kv_caches for tensor in (*cache.key_caches, *cache.value_caches)]


def release_kv_cache(engine: EngineCore) -> int:
    """Puts every running request back in the queue, drops the prefix cache and frees the cache
    tensors' storage; returns the bytes freed. The loop has flushed any step in flight."""
    engine.scheduler.preempt_all_for_recompute()
    engine.kv_cache_manager.reset_prefix_cache()
    released = 0
    for tensor in _cache_tensors(engine):
        storage = tensor.untyped_storage()
        released += storage.nbytes()
        storage.resize_(0)
    engine.runner.forward_paths.drop_cuda_graphs()
    _return_freed_memory(engine.device)
    logger.info("KV cache freed: %.1f MiB", released / 2**20)
    return released


def restore_kv_cache(engine: EngineCore) -> None:
    """Gives the cache tensors their storage back (uninitialised, as at start) and zeroes the null
    block, which padding reads."""
    for cache in engine.kv_caches:
        rows = slice(NULL_BLOCK_ID * cache.page_size, (NULL_BLOCK_ID + 1) * cache.page_size)
        for tensor in (*cache.key_caches, *cache.value_caches):
            tensor.untyped_storage().resize_(tensor.numel() * tensor.element_size())
            tensor[rows].zero_()


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


def offload_weights(engine: EngineCore) -> int:
    """Level 2: the weights to host memory, or on the CPU their packed copies freed; returns the bytes
    freed."""
    if engine.device.type == "cpu":
        freed = engine.packed_linears.drop_copies() if engine.packed_linears is not None else 0
        _return_freed_memory(engine.device)
        logger.info("packed copies of the weights freed: %.1f MiB", freed / 2**20)
        return freed
    moved = move_weights(engine.model, HOST)
    engine.runner.forward_paths.drop_cuda_graphs()
    _return_freed_memory(engine.device)
    logger.info("weights moved to host memory: %.1f MiB", moved / 2**20)
    return moved


def reload_weights(engine: EngineCore) -> None:
    if engine.device.type != "cpu":
        move_weights(engine.model, engine.device)


def _return_freed_memory(device: torch.device) -> None:
    """Hands freed memory back to the system: CUDA's caching allocator keeps it otherwise, and glibc
    keeps large freed blocks below its (adaptive) mmap threshold in the heap."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
    elif sys.platform == "linux":
        with contextlib.suppress(OSError):  # another C library: memory returns as it decides
            ctypes.CDLL("libc.so.6").malloc_trim(0)
