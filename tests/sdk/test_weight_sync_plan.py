"""The trainer's side of weight sync, without a server: the bucket plan, its announcement, the CUDA IPC
encoding's refusal of host tensors, and that none of it imports torch before it is used."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
from cbserve_client import AdminClient, BucketTensor, WeightBucket, plan_buckets
from cbserve_client._buckets import BUCKET_ALIGNMENT, MAX_BUCKET_BYTES
from cbserve_client._convert import distributed_update_request


def _names(buckets: list[WeightBucket]) -> list[str]:
    return [tensor.name for bucket in buckets for tensor in bucket.tensors]


def test_offsets_are_aligned_and_a_bucket_ends_with_its_last_tensor() -> None:
    buckets = plan_buckets([("a", "U8", (3,), 3), ("b", "F32", (5,), 20), ("c", "BF16", (1,), 2)])
    assert buckets == [
        WeightBucket(
            num_bytes=50,
            tensors=(
                BucketTensor("a", "U8", (3,), 0, 3),
                BucketTensor("b", "F32", (5,), 16, 20),
                BucketTensor("c", "BF16", (1,), 48, 2),
            ),
        )
    ]
    assert all(tensor.byte_offset % BUCKET_ALIGNMENT == 0 for tensor in buckets[0].tensors)


def test_buckets_stay_within_the_bound() -> None:
    specs = [(f"w{i}", "F32", (7,), 28) for i in range(20)]
    buckets = plan_buckets(specs, bucket_bytes=100)
    assert all(bucket.num_bytes <= 100 for bucket in buckets)
    # 28-byte tensors at 32-byte strides: three fit in 92 bytes, a fourth would end at 124.
    assert [len(bucket.tensors) for bucket in buckets] == [3, 3, 3, 3, 3, 3, 2]
    assert [bucket.num_bytes for bucket in buckets] == [92] * 6 + [60]
    assert all(bucket.tensors[0].byte_offset == 0 for bucket in buckets)


def test_a_tensor_fitting_exactly_stays_in_the_bucket() -> None:
    buckets = plan_buckets([("a", "U8", (16,), 16), ("b", "U8", (16,), 16)], bucket_bytes=32)
    assert [bucket.num_bytes for bucket in buckets] == [32]


def test_a_tensor_larger_than_the_bound_travels_alone() -> None:
    specs = [("small", "F32", (4,), 16), ("huge", "F32", (100,), 400), ("after", "F32", (4,), 16)]
    buckets = plan_buckets(specs, bucket_bytes=64)
    assert [_names([bucket]) for bucket in buckets] == [["small"], ["huge"], ["after"]]
    assert [bucket.num_bytes for bucket in buckets] == [16, 400, 16]
    assert buckets[1].tensors[0].byte_offset == 0


def test_the_given_order_is_kept() -> None:
    names = ["z", "a", "m", "b", "y", "c"]
    specs = [(name, "F16", (3, 5), 30) for name in names]
    assert _names(plan_buckets(specs, bucket_bytes=70)) == names
    assert _names(plan_buckets(specs)) == names


def test_dtype_names_are_normalized_and_shapes_kept_whole() -> None:
    (bucket,) = plan_buckets([("w", "torch.bfloat16", [2, 3], 12), ("s", "float32", (), 4)])
    assert [(tensor.dtype, tensor.shape) for tensor in bucket.tensors] == [("BF16", (2, 3)), ("F32", ())]


@pytest.mark.parametrize(
    ("specs", "bucket_bytes", "message"),
    [
        ([], 1024, "no tensors to push"),
        ([("w", "F32", (2,), 8), ("w", "F32", (2,), 8)], 1024, "'w' is given twice"),
        ([("w", "F32", (2, 2), 8)], 1024, "has 16 bytes, not 8"),
        ([("w", "F32", (2,), 8)], 0, "bucket_bytes must be in"),
        ([("w", "F32", (2,), 8)], MAX_BUCKET_BYTES + 1, "bucket_bytes must be in"),
        ([("w", "complex64", (2,), 16)], 1024, "unsupported dtype"),
    ],
)
def test_bad_plans_are_refused(
    specs: list[tuple[str, str, tuple[int, ...], int]], bucket_bytes: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        plan_buckets(specs, bucket_bytes)


def test_the_announcement_carries_the_plan() -> None:
    buckets = plan_buckets([("a", "F32", (2, 3), 24), ("b", "BF16", (5,), 10)], bucket_bytes=30)
    request = distributed_update_request(buckets, "step-3", validate_only=True)
    assert request.version_label == "step-3" and request.validate_only
    assert [bucket.num_bytes for bucket in request.buckets] == [24, 10]
    first = request.buckets[0].tensors[0]
    assert (first.name, first.dtype, list(first.shape), first.byte_offset) == ("a", "F32", [2, 3], 0)
    assert request.buckets[1].tensors[0].dtype == "BF16"


def test_ipc_refuses_host_tensors_before_any_call() -> None:
    torch = pytest.importorskip("torch")
    # Nothing listens there: the tensor is refused before the client tries to connect.
    refused = pytest.raises(ValueError, match=r"'layer\.bias' is not a CUDA tensor")
    with AdminClient("127.0.0.1:1", None) as admin, refused:
        admin.update_weights_from_ipc({"layer.bias": torch.zeros(3)})


def test_importing_the_sdk_does_not_import_torch() -> None:
    code = (
        "import sys, cbserve_client, cbserve_client.weight_sync, cbserve_client._cuda_ipc; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    import cbserve_client

    site = str(pathlib.Path(cbserve_client.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [site, os.environ.get("PYTHONPATH")]))}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
