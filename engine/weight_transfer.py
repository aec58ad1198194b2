"""Weights received from a trainer over a process group of its own (SGLang's weights-update group).

The trainer is rank 0 of a group it creates beside everything else; every tensor-parallel rank of the
server joins it as `rank_offset + tp_rank`, and a fleet of replicas joins one group, so one broadcast
from the trainer reaches every rank of every replica. The group is built from torch's public classes
(`TCPStore` -> `PrefixStore` -> `ProcessGroupGloo` / `ProcessGroupNCCL`), never as the default group,
which tensor parallelism may already own.

An update travels as buckets: flat uint8 broadcasts of at most about `MAX_BUCKET_BYTES`, each holding
whole tensors at 16-byte-aligned offsets, as the trainer announced them. `check_bucket_plan` checks the
whole announcement against the model before a byte moves; `receive_buckets` then copies each bucket into
the weights as it lands (each rank keeping its own shard of each tensor), so memory holds one bucket,
never a second copy of the model.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from engine.errors import WeightTransferError, WeightTransferTimeout
from engine.weights import StagedTensor, apply_weights, cast_for_target, check_tensor, dtype_from_name

logger = logging.getLogger(__name__)

TRAINER_RANK = 0
DEFAULT_GROUP_NAME = "weights"
DEFAULT_GROUP_TIMEOUT_S = 120.0
# Bounds of one bucket: large enough for throughput, small enough to hold beside the model; a tensor
# larger than this travels alone in a bucket of its own size.
MAX_BUCKET_BYTES = 1 << 30
BUCKET_ALIGNMENT = 16
BACKENDS = ("auto", "gloo", "nccl")


@dataclass(frozen=True)
class BucketTensor:
    name: str
    dtype: str  # safetensors' name ("F32", "BF16", ...)
    shape: tuple[int, ...]
    byte_offset: int

    @property
    def num_bytes(self) -> int:
        return math.prod(self.shape) * dtype_from_name(self.dtype).itemsize


@dataclass(frozen=True)
class WeightBucket:
    num_bytes: int
    tensors: tuple[BucketTensor, ...]


@dataclass(frozen=True)
class BucketPlan:
    """An announced update: the buckets in the order rank 0 broadcasts them."""

    buckets: tuple[WeightBucket, ...]

    @property
    def num_bytes(self) -> int:
        return sum(bucket.num_bytes for bucket in self.buckets)

    @property
    def tensor_names(self) -> frozenset[str]:
        return frozenset(tensor.name for bucket in self.buckets for tensor in bucket.tensors)


@dataclass(frozen=True)
class GroupSpec:
    """Where and how to join a trainer's group (the fields of SGLang's `init_weights_update_group`)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    backend: str = "auto"
    group_name: str = DEFAULT_GROUP_NAME
    timeout_s: float = DEFAULT_GROUP_TIMEOUT_S

    def check(self, tp_size: int) -> None:
        """Raises ValueError naming the first field out of its bounds."""
        if not self.master_address:
            raise ValueError("master_address must not be empty")
        if not 1 <= self.master_port <= 65535:
            raise ValueError(f"master_port must be in [1, 65535], got {self.master_port}")
        if self.world_size < 1 + tp_size:
            raise ValueError(
                f"world_size must be at least 1 + the server's {tp_size} tensor-parallel rank(s), "
                f"got {self.world_size}"
            )
        if not 1 <= self.rank_offset <= self.world_size - tp_size:
            raise ValueError(
                f"rank_offset must be in [1, world_size - {tp_size}] = [1, {self.world_size - tp_size}] "
                f"(rank 0 is the trainer), got {self.rank_offset}"
            )
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {list(BACKENDS)}, got {self.backend!r}")
        if not self.timeout_s > 0 or not math.isfinite(self.timeout_s):
            raise ValueError(f"timeout_s must be a finite number > 0, got {self.timeout_s}")


def resolve_backend(backend: str, device: torch.device) -> str:
    """ "auto" is NCCL for a model on CUDA, gloo otherwise; NCCL needs the model on CUDA."""
    if backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise ValueError(f"backend 'nccl' needs the model on a CUDA device; it is on {device}")
    return backend


def check_bucket_plan(targets: Mapping[str, torch.Tensor], plan: BucketPlan) -> None:
    """Checks a whole announcement before a byte moves; raises ValueError naming the tensor or bucket.

    Every tensor must name a parameter or buffer, with its (full) shape and a dtype convertible to
    its own, appear once, and lie within its bucket at an aligned offset without overlapping another;
    each bucket must stay within `MAX_BUCKET_BYTES` unless it holds one larger tensor alone.
    """
    if not plan.buckets:
        raise ValueError("buckets: the update announces no bucket")
    seen: set[str] = set()
    for index, bucket in enumerate(plan.buckets):
        where = f"buckets[{index}]"
        if not bucket.tensors:
            raise ValueError(f"{where}: a bucket holds no tensor")
        if bucket.num_bytes > MAX_BUCKET_BYTES and len(bucket.tensors) > 1:
            raise ValueError(
                f"{where}: num_bytes {bucket.num_bytes} is above the bound of {MAX_BUCKET_BYTES} bytes "
                "(only a bucket of a single larger tensor may exceed it)"
            )
        end = 0
        for tensor in sorted(bucket.tensors, key=lambda each: each.byte_offset):
            if tensor.name in seen:
                raise ValueError(f"tensor {tensor.name!r}: announced twice")
            seen.add(tensor.name)
            try:
                dtype = dtype_from_name(tensor.dtype)
            except ValueError as exc:
                raise ValueError(f"tensor {tensor.name!r}: {exc}") from None
            if any(dim < 0 for dim in tensor.shape):
                raise ValueError(f"tensor {tensor.name!r}: negative dimension in shape {list(tensor.shape)}")
            check_tensor(targets, tensor.name, tensor.shape, dtype)
            if tensor.byte_offset % BUCKET_ALIGNMENT:
                raise ValueError(
                    f"tensor {tensor.name!r}: byte_offset {tensor.byte_offset} is not a multiple of "
                    f"{BUCKET_ALIGNMENT}"
                )
            if tensor.byte_offset < end:
                raise ValueError(f"tensor {tensor.name!r}: overlaps the tensor before it in {where}")
            end = tensor.byte_offset + tensor.num_bytes
            if end > bucket.num_bytes:
                raise ValueError(
                    f"tensor {tensor.name!r}: ends at byte {end}, past {where}'s num_bytes {bucket.num_bytes}"
                )


@dataclass(frozen=True)
class JoinedGroup:
    """What joining gave: the ranks this engine's tensor-parallel ranks took, and the backend."""

    ranks: tuple[int, ...]
    backend: str


@dataclass(frozen=True)
class IncompleteWeights:
    """Weights left a mix of two versions by a transfer that failed after writing some buckets."""

    reason: str
    # Every tensor the interrupted transfer(s) announced: an update that writes all of them makes the
    # weights whole again.
    tensor_names: frozenset[str]


def transfer_error(what: str, exc: Exception, timeout_s: float) -> WeightTransferError:
    """`exc` from torch.distributed as the engine reports it. Store and gloo timeouts come as plain
    RuntimeErrors whose text says so; they become `WeightTransferTimeout`."""
    if isinstance(exc, WeightTransferError):
        return exc
    text = f"{what}: {type(exc).__name__}: {exc}"
    if isinstance(exc, TimeoutError) or "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
        return WeightTransferTimeout(f"{what}: nothing from the trainer within {timeout_s:g} s ({exc})")
    return WeightTransferError(text)


class WeightsUpdateGroup:
    """This rank's membership of a trainer's weight-update group."""

    def __init__(self, spec: GroupSpec, rank: int, device: torch.device) -> None:
        """Joins: returns once every member joined and took part in the warm-up broadcast; raises
        WeightTransferError (WeightTransferTimeout) when that does not happen within `spec.timeout_s`."""
        self._group: Any = None  # ProcessGroupGloo or ProcessGroupNCCL (no common public base)
        # Where buckets land, kept from one push to the next: a fresh buffer would be paged in (or
        # allocated on the device) again on every push, which costs as much as the transfer on a CPU.
        self._buffer: torch.Tensor | None = None
        try:
            self._join(spec, rank, device)
        except Exception as exc:
            raise transfer_error(
                f"could not join the weight-update group at {spec.master_address}:{spec.master_port} as "
                f"rank {rank} of {spec.world_size}",
                exc,
                spec.timeout_s,
            ) from exc

    def _join(self, spec: GroupSpec, rank: int, device: torch.device) -> None:
        self.spec = spec
        self.rank = rank
        self.backend = resolve_backend(spec.backend, device)
        # Buckets land where the backend moves bytes: device memory with NCCL, host memory with gloo.
        self.buffer_device = device if self.backend == "nccl" else torch.device("cpu")
        self.timeout = timedelta(seconds=spec.timeout_s)
        store = dist.TCPStore(
            spec.master_address,
            spec.master_port,
            spec.world_size,
            is_master=False,
            timeout=self.timeout,
        )
        prefixed = dist.PrefixStore(spec.group_name, store)
        if self.backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self.timeout
            torch.cuda.set_device(device)
            self._group = dist.ProcessGroupNCCL(prefixed, rank, spec.world_size, options)
        else:
            self._group = dist.ProcessGroupGloo(prefixed, rank, spec.world_size, self.timeout)
        try:
            self.receive(torch.zeros(1, dtype=torch.uint8, device=self.buffer_device))
        except Exception:
            self.close()
            raise
        logger.info(
            "joined the weight-update group at %s:%d as rank %d of %d (%s)",
            spec.master_address,
            spec.master_port,
            rank,
            spec.world_size,
            self.backend,
        )

    def receive(self, buffer: torch.Tensor) -> None:
        """Fills `buffer` with rank 0's broadcast; raises when it does not come within the timeout."""
        if self._group is None:
            raise RuntimeError("the weight-update group was closed")
        work = self._group.broadcast(buffer, TRAINER_RANK)
        if not work.wait(self.timeout):
            raise WeightTransferTimeout(f"no broadcast from the trainer within {self.spec.timeout_s:g} s")

    def bucket_buffer(self, num_bytes: int) -> torch.Tensor:
        """A buffer of at least `num_bytes` on the group's device, the same one push after push."""
        if self._buffer is None or self._buffer.numel() < num_bytes:
            self._buffer = None  # freed before its larger successor is allocated
            self._buffer = torch.empty(num_bytes, dtype=torch.uint8, device=self.buffer_device)
        return self._buffer

    def release_buffer(self) -> int:
        """Frees the bucket buffer (sleep gives its memory back too); returns its bytes."""
        buffer, self._buffer = self._buffer, None
        return 0 if buffer is None else buffer.numel()

    def abort(self) -> None:
        """Ends a receive in progress from another thread (the caller gave up on the transfer)."""
        group = self._group
        if group is not None and hasattr(group, "abort"):
            group.abort()

    def close(self) -> None:
        self.release_buffer()
        group, self._group = self._group, None
        if group is not None and hasattr(group, "shutdown"):
            try:
                group.shutdown()
            except Exception as exc:  # a group whose peer died may fail to shut down cleanly
                logger.debug("weight-update group shutdown: %s", exc)


@dataclass
class TransferProgress:
    """How far `receive_buckets` got: buckets applied to the weights."""

    num_buckets_applied: int = 0


def receive_buckets(
    group: WeightsUpdateGroup,
    plan: BucketPlan,
    targets: Mapping[str, torch.Tensor],
    progress: TransferProgress,
    on_ready: Callable[[], None] | None = None,
) -> int:
    """Receives `plan`'s buckets and copies each into the weights as it lands; returns the number of
    tensors updated. Raises when a broadcast fails or times out; `progress` then says how many
    buckets were already applied (the weights are a mix of two versions when it is not 0)."""
    # One buffer for every bucket: the transfer holds one bucket of memory, never a copy of the model.
    buffer = group.bucket_buffer(max(bucket.num_bytes for bucket in plan.buckets))
    if on_ready is not None:
        on_ready()
    num_tensors = 0
    for index, bucket in enumerate(plan.buckets):
        received = buffer[: bucket.num_bytes]
        try:
            group.receive(received)
        except Exception as exc:
            raise transfer_error(
                f"bucket {index + 1} of {len(plan.buckets)} not received", exc, group.spec.timeout_s
            ) from exc
        with torch.no_grad():
            for tensor in bucket.tensors:
                data = received[tensor.byte_offset : tensor.byte_offset + tensor.num_bytes]
                value = data.view(dtype_from_name(tensor.dtype)).reshape(tensor.shape)
                target = targets[tensor.name]
                if isinstance(target, DTensor):  # this rank's shard, cut from the full tensor
                    apply_weights([StagedTensor(tensor.name, target, cast_for_target(value, target))])
                else:  # straight from the bucket, converted on the way: no intermediate copy
                    target.copy_(value)  # not `.data`: the version counter must move (`apply_weights`)
        progress.num_buckets_applied += 1
        num_tensors += len(bucket.tensors)
    return num_tensors
