"""The trainer's side of the weight checksum: the digest a server reports (``AdminClient.weights_checksum``),
computed of the trainer's own tensors, on their own device, so that it can check what it pushed.

    from cbserve_client import weights_checksum

    pushed = weights_checksum(model.state_dict())
    fleet.check_weights(expected=pushed)    # raises WeightsMismatchError naming replicas and tensors

The algorithm, "cbserve-wsum-v1", depends on a tensor's bytes, shape and dtype alone ("Weight checksum"
in docs/weight-sync.md defines it), so equal tensors give equal digests on any device. A server holds each
tensor in its own dtype: pass ``dtype`` when the trainer's differs (a bf16 trainer pushing to a float32
server), and the floating-point tensors are cast to it first, as the server casts what it receives.
torch is imported when the function runs, never by importing this package.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

from cbserve_client._types import TensorChecksum, WeightsChecksum
from cbserve_client._weights import NamedTensors, named_tensor_list, normalize_dtype

if TYPE_CHECKING:
    import torch

__all__ = ["ALGORITHM", "weights_checksum"]

ALGORITHM = "cbserve-wsum-v1"
_POSITION_MULTIPLIER = 0x9E3779B1
_POSITION_OFFSET = 0x243F6A88
# Bytes digested per pass: bounds the temporaries to a few times 16 MiB whatever the tensor's size.
_CHUNK_BYTES = 2**24


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
                digest = by_identity[key] = _tensor_digest(whole)
            digests[name] = TensorChecksum(name, digest, normalize_dtype(whole.dtype), tuple(whole.shape))
    lines = "".join(f"{name}\t{digests[name].digest}\n" for name in sorted(digests))
    return WeightsChecksum(
        digest=hashlib.sha256(lines.encode()).hexdigest(),
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


def _int32(value: int) -> int:
    """``value`` (in [0, 2^32)) as the int32 of the same bits."""
    return value - 2**32 if value >= 2**31 else value


def _fmix32_(values: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser, in place on an int32 tensor: products wrap around, right shifts
    are made logical by masking the sign's copies off."""
    import torch

    for shift, multiplier in ((16, 0x85EBCA6B), (13, 0xC2B2AE35), (16, None)):
        torch.bitwise_right_shift(values, shift, out=scratch)
        values.bitwise_xor_(scratch.bitwise_and_((1 << (32 - shift)) - 1))
        if multiplier is not None:
            values.mul_(_int32(multiplier))
    return values


def _tensor_digest(tensor: torch.Tensor) -> str:
    """Hex SHA-256 of "{dtype}:{shape}:{num_bytes}:" and the two lanes (8 bytes each, little-endian).
    The tensor's bytes are read as little-endian 32-bit words w_i (zero-padded); with
    q_i = i * 0x9E3779B1 + 0x243F6A88 and h_i = fmix32(w_i XOR q_i) (mod 2^32, i taken mod 2^32), lane 0
    sums int32(h_i) and lane 1 int32(h_i * (q_i OR 1)), mod 2^64."""
    import torch

    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    partial_sums = []
    for start in range(0, data.numel(), _CHUNK_BYTES):
        chunk = data[start : start + _CHUNK_BYTES]
        padding = -chunk.numel() % 4
        if padding or chunk.storage_offset() % 4:
            chunk = torch.cat([chunk, chunk.new_zeros(padding)])
        words = chunk.view(torch.int32)
        first = start // 4
        positions = torch.arange(words.numel(), dtype=torch.int32, device=words.device)
        positions.mul_(_int32(_POSITION_MULTIPLIER)).add_(
            _int32((first * _POSITION_MULTIPLIER + _POSITION_OFFSET) % 2**32)
        )
        mixed = _fmix32_(torch.bitwise_xor(words, positions), torch.empty_like(positions))
        lane_0 = mixed.sum(dtype=torch.int64)
        lane_1 = mixed.mul_(positions.bitwise_or_(1)).sum(dtype=torch.int64)
        partial_sums.append(torch.stack([lane_0, lane_1]))
    lanes = [0, 0]
    if partial_sums:
        for row in torch.stack(partial_sums).tolist():
            lanes[0] += row[0]
            lanes[1] += row[1]
    shape = ",".join(str(size) for size in tensor.shape)
    header = f"{normalize_dtype(tensor.dtype)}:{shape}:{tensor.numel() * tensor.element_size()}:".encode()
    lane_bytes = b"".join((lane % 2**64).to_bytes(8, "little") for lane in lanes)
    return hashlib.sha256(header + lane_bytes).hexdigest()
