"""CUDA tensors as CudaIpcTensor messages, for a server that shares the trainer's GPU.

A colocated trainer and server can hand weights over device to device: torch.multiprocessing shares a
CUDA tensor with another process as a cudaIpcMemHandle of its storage plus the tensor's geometry, and
the other process maps that memory and copies out of it. This module writes what
``torch.multiprocessing.reductions.reduce_tensor`` gives for a CUDA tensor into the message fields the
server rebuilds the tensor from. torch is imported only here, when a tensor is encoded, and only
after every tensor was checked to be on a CUDA device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cbserve_client._generated.cbserve.v1 import admin_pb2
from cbserve_client._weights import NamedTensors, named_tensor_list, normalize_dtype


def cuda_ipc_request(
    named_tensors: NamedTensors, version_label: str | None
) -> tuple[admin_pb2.UpdateWeightsFromIpcRequest, list[Any]]:
    """The UpdateWeightsFromIpc request sharing ``named_tensors``, and the tensors it shares.

    The caller must keep the returned tensors referenced until the call returns: the handles name
    their storages, which the CUDA caching allocator could reuse for something else once they are
    freed. Raises ValueError naming the first tensor that is not on a CUDA device, or for none at all.
    """
    items = named_tensor_list(named_tensors)
    if not items:
        raise ValueError("update_weights_from_ipc: no tensors to send")
    for name, tensor in items:
        if not getattr(tensor, "is_cuda", False):
            where = getattr(tensor, "device", type(tensor).__name__)
            raise ValueError(
                f"tensor {name!r} is not a CUDA tensor (device {where}): update_weights_from_ipc shares "
                "CUDA memory; send host tensors with update_weights"
            )
    from torch.multiprocessing.reductions import reduce_tensor

    # reduce_tensor is unannotated: (rebuild function, its arguments).
    share: Callable[[Any], tuple[Any, tuple[Any, ...]]] = reduce_tensor
    shared = [(name, tensor.detach()) for name, tensor in items]
    messages = [_cuda_ipc_tensor(name, share(tensor)[1]) for name, tensor in shared]
    request = admin_pb2.UpdateWeightsFromIpcRequest(tensors=messages, version_label=version_label or "")
    return request, [tensor for _name, tensor in shared]


def _cuda_ipc_tensor(name: str, rebuild_args: tuple[Any, ...]) -> admin_pb2.CudaIpcTensor:
    """The message of one tensor from the arguments torch's ``rebuild_cuda_tensor`` takes."""
    (
        _tensor_class,
        shape,
        stride,
        storage_offset,
        _storage_class,
        dtype,
        device_index,
        storage_handle,
        storage_size_bytes,
        storage_offset_bytes,
        _requires_grad,
        ref_counter_handle,
        ref_counter_offset,
        event_handle,
        event_sync_required,
    ) = rebuild_args
    return admin_pb2.CudaIpcTensor(
        name=name,
        dtype=normalize_dtype(dtype),
        shape=list(shape),
        stride=list(stride),
        storage_offset=storage_offset,
        device_index=device_index,
        storage_handle=storage_handle,
        storage_size_bytes=storage_size_bytes,
        storage_offset_bytes=storage_offset_bytes,
        ref_counter_handle=ref_counter_handle,
        ref_counter_offset=ref_counter_offset,
        event_handle=event_handle or b"",
        event_sync_required=event_sync_required,
    )
