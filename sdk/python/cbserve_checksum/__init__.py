"""The weights checksum, "xxh3-128": its one definition, which the server (engine/weights/checksum.py) and a
trainer (``cbserve_client.weights_checksum``) both compute with, so that a trainer can check that every
replica holds what it pushed (slime's ``check_weights``).

It is a package of its own, beside ``cbserve_client`` in the same distribution, because the engine
computes it too and the engine never imports grpc, which importing ``cbserve_client`` does. It imports
xxhash, and torch only when a digest runs.

A digest depends on a tensor's bytes, shape and dtype alone, so equal tensors give equal digests on any
device:

- a tensor's: ``"xxh3-128:"`` and the lowercase hex of XXH3-128 (seed 0, in xxHash's canonical big-endian
  form) of the ASCII ``"{dtype}:{shape}:{num_bytes}:"`` (dtype as safetensors names it, e.g. ``BF16``;
  shape as comma-separated sizes, empty for a scalar) followed by the tensor's elements in C order,
  little-endian;
- a model's: the same of the UTF-8 lines ``"{name}\\t{digest}\\n"`` by name in code-point order.

The prefix names the algorithm in every digest, so a digest of another algorithm (the bare hex of
"cbserve-wsum-v1" before it) never compares equal by accident and shows why it differs. XXH3 detects
accidental differences (a tensor not updated, cut short or cast another way), not forgery. It was chosen by
measurement: on 0.5 GB (SmolLM2-135M in float32) on the 2-core AMD EPYC this was written on, XXH3-128 took
0.044 s and BLAKE3 0.29 s, one thread each (docs/weight-sync.md).

XXH3 runs on the host: a CPU tensor is hashed where it lies, without a copy; a CUDA tensor's bytes stream
into pinned host memory chunk by chunk and each chunk is hashed while the next one crosses the link.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

import xxhash

if TYPE_CHECKING:
    import torch

__all__ = [
    "ALGORITHM",
    "CHUNK_BYTES",
    "SAFETENSORS_NAMES",
    "TensorDigester",
    "combined_digest",
    "safetensors_dtype_name",
]

ALGORITHM = "xxh3-128"
# A CUDA tensor crosses the link in chunks of this size, two in flight: large enough that a chunk's fixed
# costs (a copy call, an event) vanish beside its transfer, small enough that pinned memory stays 32 MiB.
CHUNK_BYTES = 2**24

# torch dtype names -> safetensors names (the SDK's weight messages add numpy's and the short aliases).
SAFETENSORS_NAMES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint64": "U64",
    "uint32": "U32",
    "uint16": "U16",
    "uint8": "U8",
    "bool": "BOOL",
}


def safetensors_dtype_name(dtype: torch.dtype) -> str:
    """safetensors' name of a torch dtype ("F32", "BF16", ...); torch's own for one safetensors lacks."""
    name = str(dtype).removeprefix("torch.")
    return SAFETENSORS_NAMES.get(name, name)


def _prefixed(hasher: xxhash.xxh3_128) -> str:
    return f"{ALGORITHM}:{hasher.hexdigest()}"


def combined_digest(digests: Mapping[str, str]) -> str:
    """A model's digest, of its tensors' digests by name."""
    lines = "".join(f"{name}\t{digests[name]}\n" for name in sorted(digests))
    return _prefixed(xxhash.xxh3_128(lines.encode()))


class TensorDigester:
    """Digests tensors one after another. One checksum uses one digester, which allocates the pinned
    host buffers a CUDA tensor streams through once, at the first CUDA tensor: pinned memory is slow to
    allocate, and a model has hundreds of tensors."""

    def __init__(self) -> None:
        self._staging: list[torch.Tensor] = []

    def digest(self, tensor: torch.Tensor) -> str:
        """The tensor's digest (a whole tensor: a DTensor's shards are the caller's to gather first)."""
        import torch

        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        shape = ",".join(str(size) for size in tensor.shape)
        hasher = xxhash.xxh3_128(f"{safetensors_dtype_name(tensor.dtype)}:{shape}:{data.numel()}:".encode())
        for chunk in self._host_chunks(data):
            hasher.update(chunk)
        return _prefixed(hasher)

    def _host_chunks(self, data: torch.Tensor) -> Iterator[memoryview]:
        if data.device.type == "cpu":
            yield data.numpy().data
        elif data.device.type == "cuda":
            yield from self._cuda_chunks(data)
        else:  # any other device: through pageable host memory, a chunk at a time
            for start in range(0, data.numel(), CHUNK_BYTES):
                yield data[start : start + CHUNK_BYTES].cpu().numpy().data

    def _cuda_chunks(self, data: torch.Tensor) -> Iterator[memoryview]:
        """The bytes of a CUDA tensor, two chunks in flight: chunk k + 1 is copied while chunk k is
        hashed. Chunk k reuses the buffer of chunk k - 2, which the caller hashed before asking for more.
        The copies run on the device's current stream, after whatever work wrote the weights."""
        import torch

        if not self._staging:
            self._staging = [torch.empty(CHUNK_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        stream = torch.cuda.current_stream(data.device)
        in_flight: deque[tuple[torch.Tensor, torch.cuda.Event]] = deque()
        for index, start in enumerate(range(0, data.numel(), CHUNK_BYTES)):
            if len(in_flight) == len(self._staging):
                yield _landed(*in_flight.popleft())
            chunk = data[start : start + CHUNK_BYTES]
            buffer = self._staging[index % len(self._staging)][: chunk.numel()]
            buffer.copy_(chunk, non_blocking=True)
            in_flight.append((buffer, stream.record_event()))
        while in_flight:
            yield _landed(*in_flight.popleft())


def _landed(buffer: torch.Tensor, landed: torch.cuda.Event) -> memoryview:
    landed.synchronize()
    return buffer.numpy().data
