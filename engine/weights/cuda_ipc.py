"""A colocated trainer's CUDA tensors, opened in this process from their IPC handles.

The trainer shares each tensor as `torch.multiprocessing` does (`reduce_tensor`: a cudaIpcMemHandle
of the allocation, the storage's place in it, torch's reference counter, an event to wait on); the
fields travel as plain data, never pickled, and `open_ipc_tensor` maps the same memory here. The
update then copies device to device: the bytes never cross the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.weights.tensors import dtype_from_name


@dataclass(frozen=True)
class CudaIpcHandle:
    """The fields `torch.multiprocessing.reductions.reduce_tensor` gives for a CUDA tensor."""

    name: str
    dtype: str  # safetensors' name ("F32", "BF16", ...)
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int  # elements
    device_index: int
    storage_handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool

    @property
    def torch_dtype(self) -> torch.dtype:
        try:
            return dtype_from_name(self.dtype)
        except ValueError as exc:
            raise ValueError(f"tensor {self.name!r}: {exc}") from None


def open_ipc_tensor(handle: CudaIpcHandle) -> torch.Tensor:
    """The trainer's tensor, mapped into this process; raises ValueError when it cannot be opened."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    if not torch.cuda.is_available():
        raise ValueError("CUDA IPC needs CUDA in the server's process")
    if handle.device_index >= torch.cuda.device_count():
        raise ValueError(
            f"tensor {handle.name!r}: device_index {handle.device_index} is not a CUDA device of the "
            f"server ({torch.cuda.device_count()} visible)"
        )
    try:
        return rebuild_cuda_tensor(
            torch.Tensor,
            torch.Size(handle.shape),
            handle.stride,
            handle.storage_offset,
            torch.storage.TypedStorage,
            handle.torch_dtype,
            handle.device_index,
            handle.storage_handle,
            handle.storage_size_bytes,
            handle.storage_offset_bytes,
            False,
            handle.ref_counter_handle,
            handle.ref_counter_offset,
            handle.event_handle,
            handle.event_sync_required,
        )
    except Exception as exc:  # a stale or foreign handle
        raise ValueError(f"tensor {handle.name!r}: cannot open its CUDA IPC handle: {exc}") from exc
