"""Turning tensors into UpdateWeights messages, without importing torch or numpy.

A tensor may be:
  * a torch tensor (or Parameter): detached, moved to the CPU and read as raw bytes; torch is
    never imported here, only used through the tensor's own methods;
  * an object with ``.numpy()`` (converted first), or a numpy-like array: anything exposing
    ``dtype`` and ``shape`` and the buffer protocol (or ``tobytes()``);
  * an explicit ``(dtype, shape, data)`` triple, ``data`` being bytes-like.
Bytes are sent in C order, little-endian, as safetensors stores them.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import os
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeAlias

from cbserve_checksum import SAFETENSORS_NAMES

from cbserve_client._generated.cbserve.v1 import admin_pb2

#: Largest ``data`` of one TensorChunk message.
MAX_CHUNK_BYTES = 1 << 20

#: safetensors dtype name -> bytes per element.
ITEMSIZE: dict[str, int] = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U64": 8,
    "U32": 4,
    "U16": 2,
    "U8": 1,
    "BOOL": 1,
}

# numpy / torch dtype names -> safetensors names: torch's, its short aliases and numpy's kind codes.
_ALIASES: dict[str, str] = {
    **SAFETENSORS_NAMES,
    "double": "F64",
    "float": "F32",
    "half": "F16",
    "long": "I64",
    "int": "I32",
    "short": "I16",
    # numpy's one-character kind codes with explicit little-endian byte order
    "<f8": "F64",
    "<f4": "F32",
    "<f2": "F16",
    "<i8": "I64",
    "<i4": "I32",
    "<i2": "I16",
    "|i1": "I8",
    "<u8": "U64",
    "<u4": "U32",
    "<u2": "U16",
    "|u1": "U8",
    "|b1": "BOOL",
}

#: What update_weights accepts: a server-side safetensors path, a state dict, or (name, tensor) pairs.
WeightsSource: TypeAlias = str | os.PathLike[str] | Mapping[str, Any] | Iterable[tuple[str, Any]]
#: What the in-memory weight paths accept: a state dict or (name, tensor) pairs, e.g.
#: ``model.named_parameters()``.
NamedTensors: TypeAlias = Mapping[str, Any] | Iterable[tuple[str, Any]]


def normalize_dtype(dtype: object) -> str:
    """The safetensors name of a dtype given as a safetensors name, a numpy dtype or a torch dtype."""
    name = str(dtype)
    if name.startswith("torch."):
        name = name[len("torch.") :]
    if name in ITEMSIZE:
        return name
    if name.upper() in ITEMSIZE:
        return name.upper()
    try:
        return _ALIASES[name]
    except KeyError:
        raise ValueError(
            f"unsupported dtype {dtype!r} (supported: {', '.join(ITEMSIZE)}; data must be little-endian)"
        ) from None


def named_tensor_list(source: NamedTensors) -> list[tuple[str, Any]]:
    """``source``'s (name, tensor) pairs, read once (a generator can be consumed only once, and the
    callers need them twice: to describe them, then to send them), with their names checked."""
    items = list(source.items() if isinstance(source, Mapping) else source)
    for name, _tensor in items:
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be str, got {type(name).__name__}")
    return items


@dataclass(frozen=True, slots=True)
class TensorPayload:
    """One tensor ready to send: safetensors dtype, shape, and its raw bytes."""

    dtype: str
    shape: tuple[int, ...]
    data: memoryview

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()


def _bytes_view(obj: Any) -> memoryview:
    """A flat, C-ordered byte view of a buffer-protocol object (copied only when necessary)."""
    try:
        view = memoryview(obj)
    except (TypeError, ValueError, BufferError):
        view = None
    if view is not None and view.c_contiguous:
        return view.cast("B") if view.ndim != 1 or view.format != "B" else view
    tobytes = getattr(obj, "tobytes", None)
    if callable(tobytes):  # numpy arrays that are not C-contiguous, or with dtypes memoryview rejects
        return memoryview(tobytes())
    raise TypeError(f"cannot read the bytes of {type(obj).__name__}: not a C-contiguous buffer")


def _is_torch_tensor(value: object) -> bool:
    return type(value).__module__.split(".")[0] == "torch" and hasattr(value, "data_ptr")


def _torch_payload(tensor: Any) -> TensorPayload:
    t = tensor.detach()
    if str(t.device) != "cpu":
        t = t.cpu()
    t = t.contiguous()
    nbytes = int(t.numel()) * int(t.element_size())
    # ctypes.string_at copies the bytes without numpy, for every dtype (bfloat16 and float8 too).
    data = ctypes.string_at(t.data_ptr(), nbytes) if nbytes else b""
    shape = tuple(int(d) for d in t.shape)
    return TensorPayload(dtype=normalize_dtype(t.dtype), shape=shape, data=memoryview(data))


def tensor_payload(value: Any) -> TensorPayload:
    """Reads a tensor (see the module docstring) into a :class:`TensorPayload`, checking its size."""
    if isinstance(value, tuple) and len(value) == 3:
        dtype, shape, data = value
        payload = TensorPayload(normalize_dtype(dtype), tuple(int(d) for d in shape), _bytes_view(data))
    elif _is_torch_tensor(value):
        if "torch" not in sys.modules:  # pragma: no cover - a torch tensor implies torch is loaded
            raise TypeError("torch tensor given but torch is not imported")
        payload = _torch_payload(value)
    else:
        numpy_fn = getattr(value, "numpy", None)
        if callable(numpy_fn):  # e.g. TensorFlow / JAX style tensors
            value = numpy_fn()
        if not (hasattr(value, "dtype") and hasattr(value, "shape")):
            raise TypeError(
                f"cannot send {type(value).__name__} as a tensor: expected a torch tensor, an array with "
                "dtype/shape and the buffer protocol, or a (dtype, shape, bytes) tuple"
            )
        payload = TensorPayload(
            normalize_dtype(value.dtype), tuple(int(d) for d in value.shape), _bytes_view(value)
        )
    expected = math.prod(payload.shape) * ITEMSIZE[payload.dtype]
    if payload.data.nbytes != expected:
        raise ValueError(
            f"tensor of dtype {payload.dtype} and shape {list(payload.shape)} needs {expected} bytes, "
            f"got {payload.data.nbytes}"
        )
    return payload


def tensor_chunks(
    name: str, payload: TensorPayload, chunk_size: int = MAX_CHUNK_BYTES
) -> Iterator[admin_pb2.TensorChunk]:
    """The TensorChunk messages of one tensor: consecutive slices of at most ``chunk_size`` bytes,
    each carrying the name, dtype, shape and the sha256 of the whole tensor."""
    if not 0 < chunk_size <= MAX_CHUNK_BYTES:
        raise ValueError(f"chunk_size must be in [1, {MAX_CHUNK_BYTES}], got {chunk_size}")
    digest = payload.sha256
    data = payload.data
    offsets = range(0, data.nbytes, chunk_size) if data.nbytes else range(1)
    for offset in offsets:
        yield admin_pb2.TensorChunk(
            name=name,
            dtype=payload.dtype,
            shape=payload.shape,
            byte_offset=offset,
            data=bytes(data[offset : offset + chunk_size]),
            sha256=digest,
        )


def update_weights_requests(
    source: WeightsSource,
    version_label: str | None = None,
    *,
    chunk_size: int = MAX_CHUNK_BYTES,
) -> Iterator[admin_pb2.UpdateWeightsRequest]:
    """The UpdateWeights client stream for ``source``.

    ``source`` is a path (str or os.PathLike) of a safetensors file on the *server*, a mapping of
    parameter name -> tensor, or an iterable of (name, tensor) pairs (e.g.
    ``model.named_parameters()``). Tensors are read one at a time, as the stream is consumed.
    """
    if not 0 < chunk_size <= MAX_CHUNK_BYTES:
        raise ValueError(f"chunk_size must be in [1, {MAX_CHUNK_BYTES}], got {chunk_size}")
    if version_label is not None:
        yield admin_pb2.UpdateWeightsRequest(version_label=version_label)
    if isinstance(source, str | os.PathLike):
        yield admin_pb2.UpdateWeightsRequest(safetensors_path=os.fspath(source))
        return
    items: Iterable[tuple[str, Any]] = source.items() if isinstance(source, Mapping) else source
    count = 0
    for name, value in items:
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be str, got {type(name).__name__}")
        for chunk in tensor_chunks(name, tensor_payload(value), chunk_size):
            yield admin_pb2.UpdateWeightsRequest(chunk=chunk)
        count += 1
    if count == 0:
        raise ValueError("update_weights: no tensors to send")
