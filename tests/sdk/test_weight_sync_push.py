"""How WeightSyncGroup.push moves a state dict's bytes, without a server or a real group: a fake
AdminService accepts every announcement, and a fake process group records each broadcast and completes
it only when the trainer waits for it (as gloo's work does), so that what a transport could have read at
any moment in between is known."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from cbserve_client import AdminClient, WeightSyncGroup

from tests.helpers.sdk_fakes import ADMIN_TOKEN, FakeServer

torch = pytest.importorskip("torch")


class FakeWork:
    """One broadcast: its bytes when it was started and when it was waited for."""

    def __init__(self, group: FakeProcessGroup, index: int, tensor: Any) -> None:
        self.group = group
        self.index = index
        self.tensor = tensor
        self.data_ptr = tensor.data_ptr()
        self.bytes_at_start = tensor.clone()
        self.bytes_at_end: Any = None

    def wait(self) -> bool:
        self.group.in_flight.remove(self)
        self.bytes_at_end = self.tensor.clone()
        if self.index == self.group.failing_broadcast:
            raise RuntimeError("Connection reset by peer")
        return True


class FakeProcessGroup:
    """Rank 0's side of a group whose broadcasts complete when waited for, in order."""

    def __init__(self, failing_broadcast: int | None = None) -> None:
        self.broadcasts: list[FakeWork] = []
        self.in_flight: list[FakeWork] = []
        self.most_in_flight = 0
        self.failing_broadcast = failing_broadcast  # the index of the one whose wait raises
        self.aborted = False

    def broadcast(self, tensor: Any, root: int) -> FakeWork:
        assert root == 0 and tensor.dtype == torch.uint8 and tensor.dim() == 1
        work = FakeWork(self, len(self.broadcasts), tensor)
        self.broadcasts.append(work)
        self.in_flight.append(work)
        self.most_in_flight = max(self.most_in_flight, len(self.in_flight))
        return work

    def abort(self) -> None:
        self.aborted = True


@pytest.fixture
def admin(fake_server: FakeServer) -> Iterator[AdminClient]:
    with AdminClient(fake_server.target, token=ADMIN_TOKEN, timeout=10) as client:
        yield client


def _group(admin: AdminClient, process_group: FakeProcessGroup) -> WeightSyncGroup:
    executor = ThreadPoolExecutor(max_workers=1)
    return WeightSyncGroup([admin], executor, process_group, torch.device("cpu"), "gloo", [(1,)])


def _state() -> dict[str, Any]:
    """Tensors of several dtypes and layouts, in an order that gives lone and shared buckets at
    ``BUCKET_BYTES``: three packed (two strided tensors alone, and four small tensors together), so
    that a packing buffer is used twice."""
    generator = torch.Generator().manual_seed(0)
    return {
        "embed": torch.randn(64, 32, generator=generator),  # 8 KiB: alone, contiguous
        "norm": torch.randn(32, generator=generator),
        "transposed": torch.randn(32, 48, generator=generator).t(),  # 6 KiB: alone, strided
        "half": torch.randn(16, 8, generator=generator).to(torch.bfloat16),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
        "mask": torch.rand(24, generator=generator) > 0.5,
        "head": torch.randn(80, 32, generator=generator),  # 10 KiB: alone, contiguous
        "bias": torch.randn(7, generator=generator),
        "strided_alone": torch.randn(64, 64, generator=generator)[:, ::2],  # 8 KiB: alone, strided
        "last": torch.arange(10, dtype=torch.int64),
    }


BUCKET_BYTES = 4096


def test_every_tensor_arrives_at_its_announced_place(admin: AdminClient, fake_server: FakeServer) -> None:
    state = _state()
    process_group = FakeProcessGroup()
    with _group(admin, process_group) as group:
        (update,) = group.push(state, version="step-1", bucket_bytes=BUCKET_BYTES)
    assert update.tensors_updated == len(state) and update.version_label == "step-1"
    announced = fake_server.recorder.distributed_updates[-1].buckets
    assert len(process_group.broadcasts) == len(announced)
    for bucket, work in zip(announced, process_group.broadcasts, strict=True):
        assert work.bytes_at_end.numel() == bucket.num_bytes
        for placed in bucket.tensors:
            tensor = state[placed.name]
            end = placed.byte_offset + tensor.numel() * tensor.element_size()
            received = work.bytes_at_end[placed.byte_offset : end].view(tensor.dtype).view(tensor.shape)
            assert torch.equal(received, tensor), f"{placed.name}: sent {received}, pushed {tensor}"


def test_no_bucket_is_packed_over_while_it_travels(admin: AdminClient) -> None:
    process_group = FakeProcessGroup()
    with _group(admin, process_group) as group:
        group.push(_state(), bucket_bytes=BUCKET_BYTES)
    for index, work in enumerate(process_group.broadcasts):
        assert torch.equal(work.bytes_at_start, work.bytes_at_end), f"bucket {index + 1} changed in flight"


def test_the_next_bucket_is_packed_while_the_last_travels(admin: AdminClient) -> None:
    process_group = FakeProcessGroup()
    with _group(admin, process_group) as group:
        group.push(_state(), bucket_bytes=BUCKET_BYTES)
    assert process_group.most_in_flight == 2
    assert process_group.in_flight == [], "push returned before every broadcast completed"


def test_a_lone_contiguous_tensor_travels_from_its_own_memory(admin: AdminClient) -> None:
    state = _state()
    process_group = FakeProcessGroup()
    with _group(admin, process_group) as group:
        group.push(state, bucket_bytes=BUCKET_BYTES)
    sources = {work.data_ptr for work in process_group.broadcasts}
    assert state["embed"].data_ptr() in sources and state["head"].data_ptr() in sources
    assert state["strided_alone"].data_ptr() not in sources  # strided: packed, copied once


def test_the_packing_buffers_are_kept_from_one_push_to_the_next(admin: AdminClient) -> None:
    process_group = FakeProcessGroup()
    state = _state()
    with _group(admin, process_group) as group:
        group.push(state, bucket_bytes=BUCKET_BYTES)
        first = [work.data_ptr for work in process_group.broadcasts]
        process_group.broadcasts.clear()
        group.push(state, bucket_bytes=BUCKET_BYTES)
    assert [work.data_ptr for work in process_group.broadcasts] == first


def test_a_failed_broadcast_names_its_bucket_and_closes_the_group(
    admin: AdminClient, fake_server: FakeServer
) -> None:
    process_group = FakeProcessGroup(failing_broadcast=1)
    group = _group(admin, process_group)
    with pytest.raises(RuntimeError, match="Connection reset by peer") as failure:
        group.push(_state(), bucket_bytes=BUCKET_BYTES)
    num_buckets = len(fake_server.recorder.distributed_updates[-1].buckets)
    assert f"while broadcasting bucket 2 of {num_buckets}: a server that applied" in "\n".join(
        failure.value.__notes__
    )
    assert process_group.aborted and fake_server.recorder.groups_left == 1
    with pytest.raises(RuntimeError, match="this WeightSyncGroup is closed"):
        group.push(_state())
