"""A digest of the weights a model holds, so that a trainer can check that every replica holds what it
pushed (slime's `check_weights`). The algorithm, "xxh3-128", is defined once, in `cbserve_checksum` (the
SDK distribution's grpc-free package, which trainers compute the same digest with); this module applies it
to the model: which tensors, under which names, gathered whole.

A tensor of a tensor-parallel model is digested whole (its shards gathered first), so a sharded server's
digest is an unsharded one's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from cbserve_checksum import ALGORITHM, TensorDigester, combined_digest, safetensors_dtype_name

from engine.parallel import whole_tensor


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
    # Of the whole model: the digest of every tensor's digest, by name.
    digest: str
    tensors: tuple[TensorChecksum, ...]
    # The weight version the digest is of.
    weight_version: int = 0


def weights_checksum(tensors: Mapping[str, torch.Tensor]) -> WeightsChecksum:
    """The digest of each tensor and of them all. A sharded tensor (DTensor) is gathered whole first,
    which is a collective: under tensor parallelism every rank calls this at once, with the same names.
    Tied names (one tensor under two names) are digested once."""
    digester = TensorDigester()
    by_identity: dict[int, str] = {}
    checksums = []
    with torch.no_grad():
        for name in sorted(tensors):
            tensor = tensors[name]
            digest = by_identity.get(id(tensor))
            if digest is None:
                digest = by_identity[id(tensor)] = digester.digest(whole_tensor(tensor))
            checksums.append(
                TensorChecksum(name, digest, safetensors_dtype_name(tensor.dtype), tuple(tensor.shape))
            )
    combined = combined_digest({checksum.name: checksum.digest for checksum in checksums})
    return WeightsChecksum(ALGORITHM, combined, tuple(checksums))


def model_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What the checksum covers: the model's state dict (parameters and persistent buffers, tied names
    included), the tensors themselves (DTensors under tensor parallelism)."""
    return dict(model.state_dict(keep_vars=True))
