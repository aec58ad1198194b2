"""Tensor parallelism: the ranks that hold one sharded model, and the CPU group that keeps them in step.

The model is split with transformers' own tensor-parallel support (`DistributedConfig(tp_size=N)` under
`torchrun`): every rank holds a shard of every layer, and each forward all-reduces over the model's
device mesh (NCCL on GPU, gloo on CPU). Every rank therefore runs every step, on the same batch.

Only the driver (rank 0) takes requests. Its loop sends one `LoopTick` per iteration over a separate gloo
group: the commands it applied (submissions, cancels, aborts, weight updates), what the loop does next
(step, wait idle, stay parked by a pause, or exit), the scheduler's admission hold, and a digest of its
state (weight version, failed steps, tokens sampled) that every rank checks against its own. The other
ranks apply the same commands to the same state, so their schedulers make the same decisions without
ever talking about them.

Invariants the lockstep relies on, kept by `EngineCore` and the manager:
- every rank builds its cache with the same number of blocks and the same token budget (the smallest any
  rank can afford), and its sampler with the same seed (the driver's);
- a rank's scheduler depends only on its inputs (commands and model outputs), never on time or memory;
- logits are identical on every rank (the all-reduce hands each rank the same bits), so sampling agrees.

A rank that dies or hangs makes the next tick fail on the others within `cpu_group_timeout`.

A stop ends the loops, not the group: while the driver is stopped, a `StoppedHeartbeat` tells the other
ranks now and then that it still is (so their wait never times out while it lives), then whether the
engine starts again or ends for good; the other ranks wait for that in `await_restart`.

A weight update from in-memory tensors travels in two parts: the tick names each tensor
(`TensorBroadcast`: name, dtype, shape), then its bytes follow the tick one tensor at a time as plain
gloo broadcasts, never pickled. The driver sends them right after the tick, every other rank receives
them right after reading it, so no other collective comes between.
"""

from __future__ import annotations

import logging
import os
import pickle
import random
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

DRIVER_RANK = 0

# What the loop does after applying an iteration's commands: run a step, wait with nothing to run, wait
# held by a pause, or end.
STEP = "step"
IDLE = "idle"
PARK = "park"
EXIT = "exit"

# What a stopped driver tells the other ranks: still stopped, starting again, or ending for good.
STILL_STOPPED = "stopped"
RESTART = "restart"
END = "end"


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def num_bytes(self) -> int:
        return torch.Size(self.shape).numel() * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class TensorBroadcast:
    """Named tensors whose bytes follow the tick that carries this (`send_tensors`, `receive_tensors`)."""

    specs: tuple[TensorSpec, ...]

    @classmethod
    def describe(cls, tensors: list[tuple[str, torch.Tensor]]) -> TensorBroadcast:
        """Raises TypeError when an entry is not a (name, tensor) pair."""
        specs = []
        for entry in tensors:
            name, tensor = entry
            if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
                raise TypeError(
                    f"expected (name, tensor) pairs, got {type(name).__name__}, {type(tensor).__name__}"
                )
            specs.append(TensorSpec(name, tensor.dtype, tuple(tensor.shape)))
        return cls(tuple(specs))


@dataclass(frozen=True)
class LoopTick:
    """One driver loop iteration, as every other rank replays it."""

    # The commands the driver applied, pickled before it applied them (applying mutates requests).
    commands: bytes
    action: str
    hold_admission: bool
    # With action EXIT: fail the requests still live (a hard stop) rather than expect none.
    hard_stop: bool
    # The driver's state before these commands; each rank checks its own against it (manager._state_digest).
    digest: tuple[int, ...]


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

    def send_tick(
        self, encoded_commands: bytes, action: str, hold: bool, hard: bool, digest: tuple[int, ...]
    ) -> None:
        """Driver: tells the other ranks what this iteration did (`encode_commands` of its commands)."""
        self.broadcast(LoopTick(encoded_commands, action, hold, hard, digest))

    def receive_tick(self) -> tuple[list[tuple[str, Any]], LoopTick]:
        """Other ranks: the driver's next iteration."""
        tick: LoopTick = self.broadcast(None)
        return pickle.loads(tick.commands), tick

    @staticmethod
    def encode_commands(commands: list[tuple[str, Any]]) -> bytes:
        """The commands as the other ranks will replay them; call before applying them."""
        return pickle.dumps(commands)

    def send_tensors(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Driver: the bytes of tensors a `TensorBroadcast` described, in its order."""
        for _name, tensor in tensors:
            if tensor.numel():
                data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
                dist.broadcast(data, src=DRIVER_RANK, group=self.cpu_group)

    def receive_tensors(self, broadcast: TensorBroadcast) -> list[tuple[str, torch.Tensor]]:
        """Other ranks: the tensors `broadcast` describes, as the driver sends them."""
        tensors = []
        for spec in broadcast.specs:
            data = torch.empty(spec.num_bytes, dtype=torch.uint8)
            if spec.num_bytes:
                dist.broadcast(data, src=DRIVER_RANK, group=self.cpu_group)
            tensors.append((spec.name, data.view(spec.dtype).reshape(spec.shape)))
        return tensors

    def await_restart(self) -> bool:
        """Other ranks, once the driver's loop stopped: True when it starts again, False when it ends."""
        while True:
            news = self.broadcast(None)
            if news != STILL_STOPPED:
                return bool(news == RESTART)

    def close(self) -> None:
        dist.destroy_process_group(self.cpu_group)


class StoppedHeartbeat:
    """The driver's side of a stop: until `end`, it tells the other ranks every `interval_s` that the
    engine is still stopped, from a thread of its own (the loop thread has ended)."""

    def __init__(self, group: TensorParallelGroup, interval_s: float) -> None:
        self._group = group
        self._interval_s = interval_s
        self._cond = threading.Condition()
        self._decision: str | None = None
        self.error: str | None = None
        self._thread = threading.Thread(target=self._run, name="cbserve-tp-stopped", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._decision is None:
                    self._cond.wait(self._interval_s)
                decision = self._decision
            try:
                self._group.broadcast(decision or STILL_STOPPED)
            except Exception as exc:  # a rank died or hung while the engine was stopped
                self.error = f"{type(exc).__name__}: {exc}"
                logger.error("a tensor-parallel rank was lost while the engine was stopped: %s", self.error)
                return
            if decision is not None:
                return

    def end(self, decision: str) -> None:
        """Tells the other ranks `decision` (RESTART or END) and returns once they have it; raises
        RuntimeError if a rank was lost meanwhile."""
        with self._cond:
            self._decision = decision
            self._cond.notify_all()
        self._thread.join()
        if self.error is not None:
            raise RuntimeError(
                f"a tensor-parallel rank was lost while the engine was stopped ({self.error}); "
                "restart the processes to serve again"
            )
