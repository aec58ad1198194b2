"""Weights received from a trainer over a process group of its own (SGLang's weights-update group).

The trainer is rank 0 of a group it creates beside everything else; every tensor-parallel rank of the
server joins it as `rank_offset + tp_rank`, and a fleet of replicas joins one group, so one broadcast
from the trainer reaches every rank of every replica. The group is built from torch's public classes
(`TCPStore` -> `PrefixStore` -> `ProcessGroupGloo` / `ProcessGroupNCCL`), never as the default group,
which tensor parallelism may already own.

An update travels as buckets: flat uint8 broadcasts of at most about `MAX_BUCKET_BYTES`, each holding
whole tensors at 16-byte-aligned offsets, as the trainer announced them. `check_bucket_plan` checks the
whole announcement against the model before a byte moves; `receive_buckets` then copies each bucket into
the weights as it lands (each rank keeping its own shard of each tensor) while the next bucket arrives in
a second buffer, so memory holds two buckets, never a second copy of the model.

A gloo receive does not notice a peer that died while its bytes were arriving (the socket's close is not
seen until the group's timeout, minutes later), and neither `abort()` nor `shutdown()` interrupts it. So
this rank never blocks on the receive alone: it waits in slices, and between slices it ends the wait
when the caller gave up (`abort()`, the trainer's gRPC call ended) or when nothing listens any more at
the trainer's rendezvous store (the trainer process is gone). A group left with a receive still
pending is retired to a thread of its own: the receive ends at the group's timeout, and only then may
the group be destroyed (its destructor waits for its worker threads).
"""

from __future__ import annotations

import contextlib
import logging
import math
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from engine.errors import WeightTransferError, WeightTransferTimeout
from engine.weights.tensors import (
    StagedTensor,
    UpdateTargets,
    apply_weights,
    cast_for_target,
    check_tensor,
    dtype_from_name,
)

logger = logging.getLogger(__name__)

TRAINER_RANK = 0
DEFAULT_GROUP_NAME = "weights"
DEFAULT_GROUP_TIMEOUT_S = 120.0
# Bounds of one bucket: large enough for throughput, small enough to hold beside the model; a tensor
# larger than this travels alone in a bucket of its own size.
MAX_BUCKET_BYTES = 1 << 30
BUCKET_ALIGNMENT = 16
BACKENDS = ("auto", "gloo", "nccl")
# How often a rank waiting for a bucket checks that the trainer is still there: about the longest a
# dead trainer goes unnoticed, at the cost of one TCP connection to its rendezvous store each time.
LIVENESS_INTERVAL_S = 0.25
# How often a rank in a group but not receiving checks on the trainer (`watch_trainer`).
WATCH_INTERVAL_S = 1.0


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
    """`exc` from torch.distributed, or this module's own, as the engine reports it: saying `what` failed.
    Store and gloo timeouts come as plain RuntimeErrors whose text says so; they become
    `WeightTransferTimeout`."""
    if isinstance(exc, WeightTransferError):  # the same kind, with what failed in front
        return type(exc)(f"{what}: {exc}")
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
        # Where buckets land, two buffers used in turn (one receives while the other is copied into the
        # weights), kept from one push to the next: a fresh buffer would be paged in (or allocated on
        # the device) again on every push, which costs as much as the transfer on a CPU.
        self._buffers: list[torch.Tensor] = []
        # Set by `abort()`: the receive in progress, and every later one, fail at once.
        self._aborted = threading.Event()
        # Receives posted but not known to have ended; a group closed with any of them is retired.
        self._pending: list[Any] = []
        self._closed = threading.Event()
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

    def start_receive(self, buffer: torch.Tensor) -> Any:
        """Posts a receive of rank 0's next broadcast into `buffer`; returns the work to `wait` for."""
        if self._group is None:
            raise RuntimeError("the weight-update group was closed")
        work = self._group.broadcast(buffer, TRAINER_RANK)
        self._pending.append(work)
        return work

    def wait(self, work: Any) -> None:
        """Returns once `work` (from `start_receive`) filled its buffer; raises WeightTransferTimeout when
        it did not within the group's timeout, WeightTransferError as soon as the caller aborted or the
        trainer is gone, and the backend's error when the receive failed."""
        if self.backend == "nccl":  # NCCL's own abort interrupts a pending operation
            if not work.wait(self.timeout):
                raise WeightTransferTimeout(f"no broadcast from the trainer within {self.spec.timeout_s:g} s")
        else:
            self._watch(work)
        self._pending.remove(work)

    def _watch(self, work: Any) -> None:
        finished = threading.Event()
        work.get_future().add_done_callback(lambda _: finished.set())
        deadline = time.monotonic() + self.spec.timeout_s
        while not finished.wait(LIVENESS_INTERVAL_S):
            if self._aborted.is_set():
                raise WeightTransferError("the transfer was abandoned: the trainer's call ended")
            self._check_trainer_alive()
            if time.monotonic() >= deadline:
                raise WeightTransferTimeout(f"no broadcast from the trainer within {self.spec.timeout_s:g} s")
        work.wait()  # raises the receive's own error, if it ended with one

    def _check_trainer_alive(self) -> None:
        """Raises WeightTransferError when nothing listens any more at the trainer's rendezvous store
        (the process hosting it, the trainer with the group's usual rendezvous, died: its host refuses
        the connection at once). A stopped trainer's host still accepts connections, so a stopped
        trainer counts as alive and the group's timeout applies to it, as to a slow one."""
        address = (self.spec.master_address, self.spec.master_port)
        try:
            with socket.create_connection(address, timeout=LIVENESS_INTERVAL_S):
                pass
        except (ConnectionRefusedError, ConnectionResetError) as exc:
            raise WeightTransferError(
                f"the trainer is gone: nothing listens at its rendezvous store "
                f"{self.spec.master_address}:{self.spec.master_port} any more ({exc.strerror})"
            ) from None
        except OSError:  # no answer in time, or no route: not known to be gone
            return

    def trainer_alive(self) -> bool:
        """Whether the trainer's rendezvous store still answers (within the group's timeout)."""
        try:
            self._check_trainer_alive()
        except WeightTransferError:
            return False
        return True

    def watch_trainer(self, on_gone: Callable[[WeightsUpdateGroup], None]) -> None:
        """Checks on the trainer every `WATCH_INTERVAL_S` from a daemon thread while the group is open
        and nothing is being received (a receive checks for itself); calls `on_gone(self)` once, from
        that thread, when the trainer no longer answers. A trainer that dies after its last push, or
        between two, is then noticed too, and the server does not stay in the group of a dead one."""

        def watch() -> None:
            while not self._closed.wait(WATCH_INTERVAL_S):
                if not self._pending and not self.trainer_alive() and not self._closed.is_set():
                    on_gone(self)
                    return

        threading.Thread(target=watch, name="cbserve-trainer-watch", daemon=True).start()

    def receive(self, buffer: torch.Tensor) -> None:
        """Fills `buffer` with rank 0's broadcast (`start_receive`, then `wait`)."""
        self.wait(self.start_receive(buffer))

    def bucket_buffers(self, num_bytes: int) -> list[torch.Tensor]:
        """Two buffers of at least `num_bytes` on the group's device, the same ones push after push."""
        if not self._buffers or self._buffers[0].numel() < num_bytes:
            self._buffers = []  # freed before their larger successors are allocated
            self._buffers = [
                torch.empty(num_bytes, dtype=torch.uint8, device=self.buffer_device) for _ in range(2)
            ]
        return self._buffers

    def release_buffer(self) -> int:
        """Frees the bucket buffers (sleep gives their memory back too); returns their bytes."""
        buffers, self._buffers = self._buffers, []
        return sum(buffer.numel() for buffer in buffers)

    def abort(self) -> None:
        """Ends a receive in progress from another thread (the caller gave up on the transfer)."""
        self._aborted.set()
        group = self._group
        if group is not None and self.backend == "nccl":
            group.abort()

    def close(self) -> None:
        self._closed.set()
        buffers, self._buffers = self._buffers, []
        group, self._group = self._group, None
        pending, self._pending = self._pending, []
        if group is None:
            return
        if pending:
            _retire(group, pending, buffers)
            return
        if hasattr(group, "shutdown"):
            try:
                group.shutdown()
            except Exception as exc:  # a group whose peer died may fail to shut down cleanly
                logger.debug("weight-update group shutdown: %s", exc)


def _retire(group: Any, pending: list[Any], buffers: list[torch.Tensor]) -> None:
    """Keeps a group whose receives may still be writing into `buffers` until they end (at the group's
    timeout at the latest), then drops it, on a daemon thread: destroying the group waits for them."""

    held: list[Any] = [group, buffers]  # the thread's references: the last ones, once the caller's end

    def wait_then_release() -> None:
        for work in pending:
            try:
                work.wait()
            except Exception as exc:  # the expected end: the trainer is gone
                logger.debug("retired weight-update group: %s", exc)
        pending.clear()
        held.clear()  # the group's destructor runs here, its receives ended

    logger.info("a receive is still pending on the weight-update group left; it is released at its timeout")
    threading.Thread(target=wait_then_release, name="cbserve-retired-weight-group", daemon=True).start()


@dataclass
class TransferProgress:
    """How far `receive_buckets` got: buckets applied to the weights."""

    num_buckets_applied: int = 0


def receive_buckets(
    group: WeightsUpdateGroup,
    plan: BucketPlan,
    targets: UpdateTargets,
    progress: TransferProgress,
    on_ready: Callable[[], None] | None = None,
) -> int:
    """Receives `plan`'s buckets and copies each into the weights as it lands; returns the number of
    tensors updated. Raises when a broadcast fails or times out; `progress` then says how many
    buckets were already applied (the weights are a mix of two versions when it is not 0).

    Two buffers take turns: bucket k+1 is already arriving (on the group's own thread) while bucket k
    is copied into the weights, so a push of several buckets costs about its transfer, not the
    transfer plus the copies."""
    buffers = group.bucket_buffers(max(bucket.num_bytes for bucket in plan.buckets))

    def post(index: int) -> Any:
        return group.start_receive(buffers[index % 2][: plan.buckets[index].num_bytes])

    incoming = post(0)
    if on_ready is not None:
        on_ready()
    num_tensors = 0
    for index, bucket in enumerate(plan.buckets):
        try:
            group.wait(incoming)
            if index + 1 < len(plan.buckets):
                incoming = post(index + 1)
        except Exception as exc:
            raise transfer_error(
                f"bucket {index + 1} of {len(plan.buckets)} not received", exc, group.spec.timeout_s
            ) from exc
        with _one_thread_on_the_cpu(group.buffer_device):
            copy_bucket(buffers[index % 2][: bucket.num_bytes], bucket, targets)
        progress.num_buckets_applied += 1
        num_tensors += len(bucket.tensors)
    return num_tensors


@contextlib.contextmanager
def _one_thread_on_the_cpu(device: torch.device) -> Iterator[None]:
    """Copies out of a host bucket on this thread alone: gloo receives the next bucket on a thread of
    its own meanwhile, and an OpenMP team of as many threads as cores then spins at every copy's barrier
    for the thread gloo displaced (measured on 2 cores: 73 % of the server's CPU time per push in
    libgomp, pushes 2-4x slower under load; on one thread 9.0x gRPC's speed against 4.0-4.4x)."""
    if device.type != "cpu":
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def copy_bucket(received: torch.Tensor, bucket: WeightBucket, targets: UpdateTargets) -> None:
    """Copies a received bucket's tensors into the weights (this rank's shard of each). Quantized
    layers' weights are quantized first, the one step that can fail (a value that does not quantize):
    a bucket then fails before any of it is written."""

    def value_of(tensor: BucketTensor) -> torch.Tensor:
        data = received[tensor.byte_offset : tensor.byte_offset + tensor.num_bytes]
        return data.view(dtype_from_name(tensor.dtype)).reshape(tensor.shape)

    with torch.no_grad():
        quantized = [
            copy
            for tensor in bucket.tensors
            if tensor.name in targets.quantized
            for copy in targets.staged(tensor.name, value_of(tensor))
        ]
        apply_weights(quantized)
        for tensor in bucket.tensors:
            if tensor.name in targets.quantized:
                continue
            target = targets.tensors[tensor.name]
            if isinstance(target, DTensor):  # this rank's shard, cut from the full tensor
                apply_weights([StagedTensor(tensor.name, target, cast_for_target(value_of(tensor), target))])
            else:  # straight from the bucket, converted on the way: no intermediate copy
                target.copy_(value_of(tensor))  # not `.data`: the version counter must move (`apply_weights`)
