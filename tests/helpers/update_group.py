"""A trainer's side of a weight-update group, for tests of the engine's side: rank 0 of a gloo group built
from torch's public classes exactly as a training job builds it, the buckets it announces and broadcasts,
and the engine joining and receiving from a thread of the test process."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta

import torch
import torch.distributed as dist

from bench.ports import free_port
from engine import ContinuousBatchingManager
from engine.weights.transfer import BUCKET_ALIGNMENT, BucketPlan, BucketTensor, JoinedGroup, WeightBucket

SAFETENSORS_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def bucket_plan(groups: list[list[tuple[str, torch.Tensor]]]) -> BucketPlan:
    """One bucket per list of (name, tensor), each tensor at the next aligned offset."""
    buckets = []
    for tensors in groups:
        entries, offset = [], 0
        for name, tensor in tensors:
            entries.append(BucketTensor(name, SAFETENSORS_NAMES[tensor.dtype], tuple(tensor.shape), offset))
            offset += -(-tensor.numel() * tensor.element_size() // BUCKET_ALIGNMENT) * BUCKET_ALIGNMENT
        buckets.append(WeightBucket(offset, tuple(entries)))
    return BucketPlan(tuple(buckets))


def pack_bucket(plan: BucketPlan, index: int, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    bucket = plan.buckets[index]
    buffer = torch.zeros(bucket.num_bytes, dtype=torch.uint8)
    for entry in bucket.tensors:
        data = tensors[entry.name].detach().contiguous().reshape(-1).view(torch.uint8)
        buffer[entry.byte_offset : entry.byte_offset + data.numel()] = data
    return buffer


class Trainer:
    """Rank 0 of a weight-update group: hosts the rendezvous and broadcasts."""

    def __init__(self, world_size: int = 2, timeout_s: float = 20.0) -> None:
        self.port = free_port()
        self.world_size = world_size
        self.timeout = timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(
            "127.0.0.1", self.port, world_size, is_master=True, timeout=self.timeout, wait_for_workers=False
        )
        self.group: dist.ProcessGroupGloo | None = None

    def form(self) -> None:
        """Blocks until every member joined, then takes part in the warm-up broadcast."""
        self.group = dist.ProcessGroupGloo(
            dist.PrefixStore("weights", self.store), 0, self.world_size, self.timeout
        )
        self.broadcast(torch.zeros(1, dtype=torch.uint8))

    def broadcast(self, buffer: torch.Tensor) -> None:
        assert self.group is not None
        self.group.broadcast(buffer, 0).wait()

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.shutdown()
            self.group = None


def join_group(manager: ContinuousBatchingManager, trainer: Trainer) -> JoinedGroup:
    """The engine joins as rank 1 while the trainer forms the group, with the trainer's timeout."""
    with ThreadPoolExecutor(1) as pool:
        joined = pool.submit(
            manager.init_weights_update_group,
            "127.0.0.1",
            trainer.port,
            1,
            trainer.world_size,
            "gloo",
            "weights",
            trainer.timeout.total_seconds(),
        )
        trainer.form()
        return joined.result(timeout=30)


def push(
    manager: ContinuousBatchingManager, trainer: Trainer, plan: BucketPlan, tensors, buckets=None
) -> Future:
    """Announces `plan`, and once the engine is ready broadcasts its buckets (or only `buckets`)."""
    ready = threading.Event()
    pool = ThreadPoolExecutor(1)
    result = pool.submit(manager.update_weights_from_distributed, plan, "pushed", ready.set)
    pool.shutdown(wait=False)
    assert ready.wait(30), "the engine never said it was ready"
    for index in range(len(plan.buckets)) if buckets is None else buckets:
        trainer.broadcast(pack_bucket(plan, index, tensors))
    return result
