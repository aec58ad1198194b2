"""The trainer's side of the weight checksum: the digest a server reports (``AdminClient.weights_checksum``),
computed of the trainer's own tensors, on their own device, so that it can check what it pushed.

    from cbserve_client import weights_checksum

    pushed = weights_checksum(model.state_dict())
    fleet.check_weights(expected=pushed)    # raises WeightsMismatchError naming replicas and tensors

The algorithm, "xxh3-128", is defined once, in :mod:`cbserve_checksum` (this distribution's grpc-free
package, which the server computes with too): it depends on a tensor's bytes, shape and dtype alone, so
equal tensors give equal digests on any device, and every digest starts with the algorithm's name. A
server holds each tensor in its own dtype: pass ``dtype`` when the trainer's differs (a bf16 trainer
pushing to a float32 server), and the floating-point tensors are cast to it first, as the server casts
what it receives. torch is imported when the function runs, never by importing this package.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cbserve_checksum import ALGORITHM, TensorDigester, combined_digest

from cbserve_client._types import TensorChecksum, WeightsChecksum
from cbserve_client._weights import NamedTensors, named_tensor_list, normalize_dtype

if TYPE_CHECKING:
    import torch

__all__ = ["ALGORITHM", "weights_checksum"]


def weights_checksum(named_tensors: NamedTensors, *, dtype: Any = None) -> WeightsChecksum:
    """The digest of each tensor and of them all, as a server computes it of the weights it holds.

    ``named_tensors``: a mapping or (name, tensor) pairs of torch tensors, on any device (DTensors are
    gathered whole first), named as in the model's state dict: the whole-model digest covers exactly
    the names given, so pass the full state dict to compare it with a server's. ``dtype``: a torch
    dtype the floating-point tensors are cast to first (the server's), or None to digest them as
    they are. Returns a :class:`~cbserve_client.WeightsChecksum` with every tensor's digest and
    ``weight_version`` 0.
    """
    import torch

    digester = TensorDigester()
    digests: dict[str, TensorChecksum] = {}
    # Tied weights (one tensor under two names, as state_dict() gives them) are digested once.
    by_identity: dict[tuple[Any, ...], str] = {}
    with torch.no_grad():
        for name, tensor in named_tensor_list(named_tensors):
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"tensor {name!r}: a torch tensor is needed, got {type(tensor).__name__}")
            if name in digests:
                raise ValueError(f"tensor {name!r} is given twice")
            whole = _whole(tensor)
            if dtype is not None and whole.is_floating_point():
                whole = whole.to(dtype)
            key = (*_identity(tensor), whole.dtype)
            digest = by_identity.get(key)
            if digest is None:
                digest = by_identity[key] = digester.digest(whole)
            digests[name] = TensorChecksum(name, digest, normalize_dtype(whole.dtype), tuple(whole.shape))
    return WeightsChecksum(
        digest=combined_digest({name: checksum.digest for name, checksum in digests.items()}),
        algorithm=ALGORITHM,
        weight_version=0,
        num_tensors=len(digests),
        tensors={name: digests[name] for name in sorted(digests)},
    )


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    full_tensor = getattr(tensor, "full_tensor", None)  # a DTensor's shards, gathered
    return full_tensor() if callable(full_tensor) else tensor


def _identity(tensor: torch.Tensor) -> tuple[Any, ...]:
    """What two views of the same memory share: where their elements live, and how they are laid out."""
    try:
        address = tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor without storage of its own (a DTensor)
        return (id(tensor),)
    return (tensor.device, address, tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()))
