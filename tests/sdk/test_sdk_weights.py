"""UpdateWeights payloads: tensor reading (no torch import in the SDK), chunking, sha256."""

from __future__ import annotations

import array
import hashlib
import os
import pathlib
import subprocess
import sys

import pytest
from cbserve_client._weights import (
    MAX_CHUNK_BYTES,
    normalize_dtype,
    tensor_chunks,
    tensor_payload,
    update_weights_requests,
)


def test_dtype_names() -> None:
    assert normalize_dtype("F32") == "F32"
    assert normalize_dtype("bf16") == "BF16"
    assert normalize_dtype("float16") == "F16"
    assert normalize_dtype("torch.bfloat16") == "BF16"
    assert normalize_dtype("<f4") == "F32"
    with pytest.raises(ValueError, match="unsupported dtype"):
        normalize_dtype(">f4")
    with pytest.raises(ValueError):
        normalize_dtype("complex64")


def test_raw_triple_is_chunked_with_whole_tensor_sha256() -> None:
    data = bytes(range(256)) * 10  # 2560 bytes = 640 float32
    payload = tensor_payload(("F32", (32, 20), data))
    chunks = list(tensor_chunks("w", payload, chunk_size=1000))
    assert [c.byte_offset for c in chunks] == [0, 1000, 2000]
    assert [len(c.data) for c in chunks] == [1000, 1000, 560]
    assert b"".join(c.data for c in chunks) == data
    digest = hashlib.sha256(data).hexdigest()
    assert {c.sha256 for c in chunks} == {digest}
    assert all(c.name == "w" and c.dtype == "F32" and list(c.shape) == [32, 20] for c in chunks)


def test_default_chunks_are_at_most_one_mib() -> None:
    data = b"\x01" * (MAX_CHUNK_BYTES * 2 + 3)
    chunks = list(tensor_chunks("big", tensor_payload(("U8", (len(data),), data))))
    assert [len(c.data) for c in chunks] == [MAX_CHUNK_BYTES, MAX_CHUNK_BYTES, 3]
    with pytest.raises(ValueError):
        list(tensor_chunks("big", tensor_payload(("U8", (3,), b"abc")), chunk_size=MAX_CHUNK_BYTES + 1))


def test_empty_tensor_still_sends_one_chunk() -> None:
    chunks = list(tensor_chunks("empty", tensor_payload(("F16", (0, 4), b""))))
    assert len(chunks) == 1 and chunks[0].data == b"" and list(chunks[0].shape) == [0, 4]
    assert chunks[0].sha256 == hashlib.sha256(b"").hexdigest()


def test_size_mismatch_is_refused() -> None:
    with pytest.raises(ValueError, match="needs 16 bytes"):
        tensor_payload(("F32", (2, 2), b"\x00" * 12))


def test_buffer_protocol_object_with_dtype_and_shape() -> None:
    class Buf(array.array):
        """Anything with dtype/shape and the buffer protocol (no numpy, no torch)."""

        dtype = "float32"
        shape = (2, 2)

    payload = tensor_payload(Buf("f", [1.0, 2.0, 3.0, 4.0]))
    assert payload.dtype == "F32" and payload.shape == (2, 2)
    assert bytes(payload.data) == array.array("f", [1.0, 2.0, 3.0, 4.0]).tobytes()


def test_numpy_arrays() -> None:
    import numpy as np

    a = np.arange(12, dtype=np.float16).reshape(3, 4)
    payload = tensor_payload(a)
    assert (payload.dtype, payload.shape, bytes(payload.data)) == ("F16", (3, 4), a.tobytes())
    t = a.T  # not C-contiguous: sent in C order
    payload = tensor_payload(t)
    assert payload.shape == (4, 3) and bytes(payload.data) == np.ascontiguousarray(t).tobytes()
    assert tensor_payload(np.array([True, False])).dtype == "BOOL"


def test_objects_with_numpy_method() -> None:
    import numpy as np

    class Tensorish:
        def numpy(self) -> object:
            return np.ones((2, 3), dtype=np.int64)

    payload = tensor_payload(Tensorish())
    assert payload.dtype == "I64" and payload.shape == (2, 3) and payload.data.nbytes == 48


def test_torch_tensors_including_bfloat16() -> None:
    import torch

    w = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    payload = tensor_payload(w)
    assert (payload.dtype, payload.shape) == ("F32", (2, 3))
    assert bytes(payload.data) == w.numpy().tobytes()
    b = torch.nn.Parameter(torch.randn(4, 5).to(torch.bfloat16))  # requires grad, no numpy view
    payload = tensor_payload(b)
    assert payload.dtype == "BF16" and payload.shape == (4, 5)
    assert bytes(payload.data) == b.detach().view(torch.int16).numpy().tobytes()
    sliced = torch.arange(20, dtype=torch.int32).reshape(4, 5)[:, 1:3]  # non-contiguous view
    assert bytes(tensor_payload(sliced).data) == sliced.contiguous().numpy().tobytes()


def test_update_stream_layout() -> None:
    messages = list(
        update_weights_requests(
            {"a": ("F32", (2,), b"\x00" * 8), "b": ("U8", (5,), b"hello")}, "step-7", chunk_size=4
        )
    )
    kinds = [m.WhichOneof("payload") for m in messages]
    assert kinds == ["version_label", "chunk", "chunk", "chunk", "chunk"]
    assert messages[0].version_label == "step-7"
    assert [(m.chunk.name, m.chunk.byte_offset) for m in messages[1:]] == [
        ("a", 0),
        ("a", 4),
        ("b", 0),
        ("b", 4),
    ]


def test_update_from_path_and_pairs() -> None:
    (only,) = update_weights_requests("/models/step-7.safetensors")
    assert only.safetensors_path == "/models/step-7.safetensors"
    pairs = [("x", ("I8", (1,), b"\x01"))]
    assert [m.chunk.name for m in update_weights_requests(iter(pairs))] == ["x"]
    with pytest.raises(ValueError, match="no tensors"):
        list(update_weights_requests({}))


def test_sdk_never_imports_torch_or_numpy() -> None:
    code = (
        "import sys, cbserve_client, cbserve_client.admin, cbserve_client.aio, cbserve_client._weights; "
        "bad = [m for m in ('torch', 'numpy') if m in sys.modules]; "
        "assert not bad, bad"
    )
    import cbserve_client

    site = str(pathlib.Path(cbserve_client.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [site, os.environ.get("PYTHONPATH")]))}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
