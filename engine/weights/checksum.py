"""A digest of the weights a model holds, computed on the device that holds them, so that a trainer can
check that every replica holds what it pushed (slime's `check_weights`).

The algorithm, "cbserve-wsum-v1", is defined on a tensor's bytes alone, so equal tensors give equal
digests on any device, and the trainer computes the same digest of its own tensors
(`cbserve_client.weights_checksum`, torch only):

1. The tensor's elements in C order, in its own dtype, little-endian, zero-padded to a multiple of 4 bytes,
   read as 32-bit words w_0, w_1, ...
2. Each word is mixed with its position: q_i = (i * 0x9E3779B1 + 0x243F6A88) mod 2^32 (i taken mod 2^32)
   and h_i = fmix32(w_i XOR q_i), fmix32 being MurmurHash3's 32-bit finaliser. Two lanes add them up:
   L_0 = sum of int32(h_i) and L_1 = sum of int32(h_i * (q_i OR 1) mod 2^32), both mod 2^64, where int32(x)
   reads x's bits as a signed 32-bit integer. Moved bytes change the sums; integer sums do not depend on
   the order they are added in, so every device gives the same lanes.
3. The tensor's digest: lowercase hex SHA-256 of the ASCII "{dtype}:{shape}:{num_bytes}:" (dtype as
   safetensors names it, e.g. "BF16"; shape as comma-separated sizes) followed by L_0 and L_1 as 8-byte
   little-endian integers.
4. The model's digest: lowercase hex SHA-256 of the lines "{name}\\t{digest}\\n", by name in code-point
   order, over the model's state dict (every parameter and persistent buffer, tied names included, as
   `model.state_dict()` lists them): what a trainer's own `state_dict()` holds.

It detects accidental differences (a tensor not updated, truncated or cast another way), not forgery: the
lanes are sums, not a cryptographic hash of the bytes. Only steps 3 and 4 run on the host, on a few bytes
per tensor; a tensor of a tensor-parallel model is digested whole (its shards gathered first).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from engine.parallel import whole_tensor
from engine.weights.tensors import SAFETENSORS_DTYPES

ALGORITHM = "cbserve-wsum-v1"
POSITION_MULTIPLIER = 0x9E3779B1
POSITION_OFFSET = 0x243F6A88
# Bytes digested per pass: bounds the temporaries to a few times 16 MiB whatever the tensor's size.
CHUNK_BYTES = 2**24

_DTYPE_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


@dataclass(frozen=True)
class TensorChecksum:
    name: str
    digest: str
    # safetensors' name of the dtype the tensor is held in ("F32", "BF16", ...).
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class WeightsChecksum:
    algorithm: str
    # Of the whole model (step 4 of the module docstring).
    digest: str
    tensors: tuple[TensorChecksum, ...]
    # The weight version the digest is of.
    weight_version: int = 0


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def _int32(value: int) -> int:
    """`value` (in [0, 2^32)) as the int32 of the same bits."""
    return value - 2**32 if value >= 2**31 else value


def _fmix32_(values: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's finaliser, in place on an int32 tensor: products wrap around (two's complement) and
    the right shifts are made logical by masking the sign's copies off."""
    for shift, multiplier in ((16, 0x85EBCA6B), (13, 0xC2B2AE35), (16, None)):
        torch.bitwise_right_shift(values, shift, out=scratch)
        values.bitwise_xor_(scratch.bitwise_and_((1 << (32 - shift)) - 1))
        if multiplier is not None:
            values.mul_(_int32(multiplier))
    return values


def _lanes(tensor: torch.Tensor) -> tuple[int, int]:
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    partial_sums: list[torch.Tensor] = []
    for start in range(0, data.numel(), CHUNK_BYTES):
        chunk = data[start : start + CHUNK_BYTES]
        padding = -chunk.numel() % 4
        if padding or chunk.storage_offset() % 4:
            chunk = torch.cat([chunk, chunk.new_zeros(padding)])
        words = chunk.view(torch.int32)
        first = start // 4
        positions = torch.arange(words.numel(), dtype=torch.int32, device=words.device)
        positions.mul_(_int32(POSITION_MULTIPLIER)).add_(
            _int32((first * POSITION_MULTIPLIER + POSITION_OFFSET) % 2**32)
        )
        mixed = _fmix32_(torch.bitwise_xor(words, positions), torch.empty_like(positions))
        # A chunk has 2^22 words of at most 2^31 in magnitude: its sums fit int64.
        lane_0 = mixed.sum(dtype=torch.int64)
        lane_1 = mixed.mul_(positions.bitwise_or_(1)).sum(dtype=torch.int64)
        partial_sums.append(torch.stack([lane_0, lane_1]))
    if not partial_sums:
        return 0, 0
    sums = torch.stack(partial_sums).tolist()  # the one wait for the device, per tensor
    return sum(row[0] for row in sums) % 2**64, sum(row[1] for row in sums) % 2**64


def tensor_digest(tensor: torch.Tensor) -> str:
    """Steps 1 to 3 of the module docstring, on the tensor's own device."""
    lane_0, lane_1 = _lanes(tensor)
    shape = ",".join(str(size) for size in tensor.shape)
    header = f"{dtype_name(tensor.dtype)}:{shape}:{tensor.numel() * tensor.element_size()}:".encode()
    return hashlib.sha256(header + lane_0.to_bytes(8, "little") + lane_1.to_bytes(8, "little")).hexdigest()


def combined_digest(digests: Mapping[str, str]) -> str:
    """Step 4: the digest of tensors' digests, by name."""
    lines = "".join(f"{name}\t{digests[name]}\n" for name in sorted(digests))
    return hashlib.sha256(lines.encode()).hexdigest()


def weights_checksum(tensors: Mapping[str, torch.Tensor]) -> WeightsChecksum:
    """The digest of each tensor and of them all. A sharded tensor (DTensor) is gathered whole first,
    which is a collective: under tensor parallelism every rank calls this at once, with the same names.
    Tied names (one tensor under two names) are digested once."""
    by_identity: dict[int, str] = {}
    checksums = []
    with torch.no_grad():
        for name in sorted(tensors):
            tensor = tensors[name]
            digest = by_identity.get(id(tensor))
            if digest is None:
                whole = whole_tensor(tensor)
                digest = by_identity[id(tensor)] = tensor_digest(whole)
            checksums.append(TensorChecksum(name, digest, dtype_name(tensor.dtype), tuple(tensor.shape)))
    combined = combined_digest({checksum.name: checksum.digest for checksum in checksums})
    return WeightsChecksum(ALGORITHM, combined, tuple(checksums))


def model_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What the checksum covers: the model's state dict (parameters and persistent buffers, tied names
    included), the tensors themselves (DTensors under tensor parallelism)."""
    return dict(model.state_dict(keep_vars=True))
