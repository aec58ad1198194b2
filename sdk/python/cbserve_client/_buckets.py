"""How a weight push over the weight-update group packs tensors into buckets (no torch needed).

A push over a torch.distributed group moves bytes as broadcasts of flat uint8 tensors. One broadcast
per tensor would pay a collective's latency hundreds of times for a model; one broadcast of the whole
model would need a second copy of it on both sides. Buckets of a bounded size sit between the two, as
in SGLang's and verl's weight sync: the trainer packs the next bucket while the last one travels, and
the server copies the last one into its weights while the next one arrives, each side with two buffers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from cbserve_client._weights import ITEMSIZE, normalize_dtype

#: Where a tensor's bytes start in its bucket is a multiple of this, so the server can view them in
#: place as any dtype (and the widest vector loads stay aligned).
BUCKET_ALIGNMENT = 16
#: Default bound of one bucket's size, in bytes: small enough that packing and unpacking overlap the
#: transfer (each side then holds two buckets) and that a large matrix travels alone, from its own
#: memory; large enough that the 0.5 GB benchmark model (bench/weight_sync.py) takes 7 broadcasts. On
#: the 2-core benchmark machine 64 MiB pushed as fast as 128 and 512 MiB or faster, and 16 MiB or less
#: moved the cost to per-bucket work.
DEFAULT_BUCKET_BYTES = 64 << 20
#: The largest bucket the server accepts, unless the bucket holds one tensor that is larger on its own.
MAX_BUCKET_BYTES = 1 << 30

#: What the planner needs of one tensor: its name, dtype (a safetensors, numpy or torch name), full
#: shape and size in bytes.
TensorSpec = tuple[str, str, Sequence[int], int]


@dataclass(frozen=True, slots=True)
class BucketTensor:
    """One tensor's place in a bucket: its bytes (C order, little-endian) fill
    ``[byte_offset, byte_offset + num_bytes)`` of the broadcast."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    byte_offset: int
    num_bytes: int


@dataclass(frozen=True, slots=True)
class WeightBucket:
    """One broadcast of a push: a flat uint8 tensor of ``num_bytes`` holding ``tensors``."""

    num_bytes: int
    tensors: tuple[BucketTensor, ...]


def _aligned(offset: int) -> int:
    return -(-offset // BUCKET_ALIGNMENT) * BUCKET_ALIGNMENT


def plan_buckets(
    tensors: Iterable[TensorSpec], bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> list[WeightBucket]:
    """Packs ``(name, dtype, shape, num_bytes)`` tensors, in the given order, into buckets.

    Each tensor starts at a multiple of :data:`BUCKET_ALIGNMENT` bytes; a bucket takes the next
    tensor while its size (the end of its last tensor) stays within ``bucket_bytes``, and a tensor
    larger than ``bucket_bytes`` travels alone. The order is kept because the server applies buckets
    as they land, and a trainer can then stream parameters without sorting them. Raises ValueError
    for no tensors, a name given twice, a size that does not match dtype and shape, or a bound
    outside ``[1, MAX_BUCKET_BYTES]``.
    """
    if not 0 < bucket_bytes <= MAX_BUCKET_BYTES:
        raise ValueError(f"bucket_bytes must be in [1, {MAX_BUCKET_BYTES}] (1 GiB), got {bucket_bytes}")
    buckets: list[WeightBucket] = []
    current: list[BucketTensor] = []
    end = 0
    seen: set[str] = set()
    for name, dtype, shape, num_bytes in tensors:
        if name in seen:
            raise ValueError(f"tensor {name!r} is given twice: a push sends each tensor once")
        seen.add(name)
        safetensors_dtype = normalize_dtype(dtype)
        full_shape = tuple(int(dimension) for dimension in shape)
        expected = math.prod(full_shape) * ITEMSIZE[safetensors_dtype]
        if num_bytes != expected:
            raise ValueError(
                f"tensor {name!r} of dtype {safetensors_dtype} and shape {list(full_shape)} has "
                f"{expected} bytes, not {num_bytes}"
            )
        offset = _aligned(end)
        if current and offset + num_bytes > bucket_bytes:
            buckets.append(WeightBucket(end, tuple(current)))
            current, offset = [], 0
        current.append(BucketTensor(name, safetensors_dtype, full_shape, offset, num_bytes))
        end = offset + num_bytes
    if not current:
        raise ValueError("no tensors to push")
    buckets.append(WeightBucket(end, tuple(current)))
    return buckets
