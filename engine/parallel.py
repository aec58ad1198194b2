"""Tensor parallelism: the ranks that hold one sharded model, and the CPU group that keeps them in step.

The model is split with transformers' own tensor-parallel support (`DistributedConfig(tp_size=N)` under
`torchrun`): every rank holds a shard of every layer, and each forward all-reduces over the model's
device mesh (NCCL on GPU, gloo on CPU). Every rank therefore runs every step, on the same batch.

The loop that keeps the ranks in step is engine.loop.lockstep; this module is the group itself and loading.
"""

from __future__ import annotations

import logging
import os
import random
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

logger = logging.getLogger(__name__)

DRIVER_RANK = 0


def global_rank() -> int:
    """This process's rank in the default process group (0 when there is none)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def tensor_parallel_size(model: torch.nn.Module) -> int:
    """The model's tensor-parallel degree: 1 unless it was loaded sharded across ranks."""
    return int(getattr(model, "tp_size", None) or 1)


def check_tensor_parallel_size(model_config: Any, tp_size: int) -> None:
    """Raises ValueError unless `tp_size` divides the model's KV heads (each rank caches KV heads / N)."""
    text_config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    num_heads = int(text_config.num_attention_heads)
    num_kv_heads = int(getattr(text_config, "num_key_value_heads", None) or num_heads)
    if tp_size < 1 or num_kv_heads % tp_size:
        raise ValueError(
            f"tensor-parallel size {tp_size} must divide the model's num_key_value_heads ({num_kv_heads})"
        )


def whole_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` whole: a sharded one (DTensor) gathered from every rank, a collective that every rank
    calls at once. Float8 shards travel as their bytes: gloo gathers no float8."""
    if not isinstance(tensor, DTensor):
        return tensor
    if tensor.element_size() != 1 or not tensor.dtype.is_floating_point:
        return tensor.full_tensor()
    as_bytes = DTensor.from_local(
        tensor.to_local().view(torch.uint8), tensor.device_mesh, tensor.placements, run_check=False
    )
    return as_bytes.full_tensor().view(tensor.dtype)


def torchrun_world_size() -> int:
    """The number of ranks `torchrun` started this process among (1 when not launched by it)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def torchrun_environment(rank: int, world_size: int, master_port: int) -> dict[str, str]:
    """The variables `torchrun` gives each rank on one host, for launchers that start ranks themselves."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(master_port),
    }


def torchrun_rank() -> int:
    """This process's rank in its `torchrun` job (0 when not launched by it)."""
    return int(os.environ.get("RANK", "0"))


def load_sharded_model(path: str, dtype: torch.dtype, attn_implementation: str) -> torch.nn.Module:
    """Loads the model at `path` split over every rank of this `torchrun` job.

    Checks the KV-head divisibility first, so a bad `--nproc-per-node` fails before any weight is read.
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    tp_size = torchrun_world_size()
    check_tensor_parallel_size(AutoConfig.from_pretrained(path), tp_size)
    model = AutoModelForCausalLM.from_pretrained(
        path,
        dtype=dtype,
        attn_implementation=attn_implementation,
        distributed_config=DistributedConfig(tp_size=tp_size),
    )
    return model.eval()


class TensorParallelGroup:
    """This rank's place among the ranks of one sharded model, and their CPU (gloo) control group."""

    def __init__(self, tp_size: int, cpu_group_timeout: float | None) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                f"the model is sharded over {tp_size} ranks but torch.distributed is not initialized; "
                "launch with torchrun and load with DistributedConfig(tp_size=...)"
            )
        if dist.get_world_size() != tp_size:
            raise ValueError(
                f"the model's tensor-parallel size ({tp_size}) must equal the number of ranks "
                f"({dist.get_world_size()}): cbserve runs one tensor-parallel group per process group"
            )
        self.tp_size = tp_size
        self.rank = dist.get_rank()
        timeout = None if cpu_group_timeout is None else timedelta(seconds=cpu_group_timeout)
        self.timeout_s = cpu_group_timeout
        if timeout is not None and hasattr(dist, "set_timeout"):
            # Loading is over (it ran under transformers' 2-hour bound): a rank that hangs inside a forward
            # now fails the others' all-reduces within the same time as a missed tick.
            dist.set_timeout(timeout)
        group = dist.new_group(backend="gloo", timeout=timeout)
        assert isinstance(group, dist.ProcessGroup)  # every rank is a member
        self.cpu_group = group

    @classmethod
    def for_model(cls, model: torch.nn.Module, cpu_group_timeout: float | None) -> TensorParallelGroup | None:
        """The group of a sharded model; None for a model on one rank."""
        tp_size = tensor_parallel_size(model)
        return cls(tp_size, cpu_group_timeout) if tp_size > 1 else None

    @property
    def is_driver(self) -> bool:
        return self.rank == DRIVER_RANK

    def broadcast(self, value: Any) -> Any:
        """The driver's `value` on every rank (the others pass anything). Blocks until all ranks join."""
        box = [value]
        dist.broadcast_object_list(box, src=DRIVER_RANK, group=self.cpu_group)
        return box[0]

    def smallest(self, values: list[int]) -> list[int]:
        """Element-wise minimum of `values` over the ranks (each rank passes the same number of them)."""
        tensor = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return [int(value) for value in tensor.tolist()]

    def shared_seed(self, seed: int | None) -> int:
        """The driver's seed (drawn at random when None), so every rank samples the same tokens."""
        return int(self.broadcast(seed if seed is not None else random.getrandbits(63)))

    def close(self) -> None:
        dist.destroy_process_group(self.cpu_group)
