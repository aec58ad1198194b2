"""The CPUs and memory a pod's cgroup grants, read from fake cgroup folders laid out as the kernel does
(v2's one hierarchy and v1's per-controller ones), and what the engine takes from them: its default
thread count and the CPU KV cache's memory budget."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import engine.system.container_limits as container_limits
from engine.runner import kv_cache
from engine.system.container_limits import ContainerLimits, read_container_limits, usable_cpu_count

GIB = 1 << 30


def write(folder: Path, **files: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name.replace("__", ".")).write_text(text + "\n")


def v2_tree(root: Path, own_path: str) -> Path:
    """A v2 hierarchy under `root` and a /proc/self/cgroup naming `own_path`; returns that file."""
    write(root, cgroup__controllers="cpu memory")
    proc = root.parent / "proc_self_cgroup"
    proc.write_text(f"0::{own_path}\n")
    return proc


def test_v2_pod_limits_are_read_as_kubernetes_sets_them(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    proc = v2_tree(root, "/kubepods/pod1/container")
    # limits.cpu "2500m" and limits.memory "4Gi", on the container's cgroup
    write(
        root / "kubepods/pod1/container",
        cpu__max="250000 100000",
        memory__max=str(4 * GIB),
        memory__current=str(3 * GIB),
        memory__stat=f"anon 1234\ninactive_file {GIB}\nactive_file 5",
    )
    limits = read_container_limits(root, proc)
    assert limits == ContainerLimits(cpu_quota=2.5, memory_limit_bytes=4 * GIB, memory_used_bytes=2 * GIB)
    # The reclaimable file cache does not count against the headroom: 4 GiB - (3 - 1) GiB.
    assert limits.memory_available_bytes == 2 * GIB


def test_v2_an_ancestors_tighter_limit_applies(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    proc = v2_tree(root, "/kubepods/pod1/container")
    pod = root / "kubepods/pod1"
    write(pod, cpu__max="100000 100000", memory__max=str(2 * GIB), memory__current=str(GIB))
    write(root / "kubepods/pod1/container", cpu__max="max 100000", memory__max="max", memory__current="10")
    limits = read_container_limits(root, proc)
    assert limits.cpu_quota == 1.0
    assert limits.memory_limit_bytes == 2 * GIB and limits.memory_available_bytes == GIB


def test_v2_in_a_cgroup_namespace_the_root_is_the_containers_own(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    proc = v2_tree(root, "/")
    write(root, cpu__max="200000 100000", memory__max=str(GIB), memory__current=str(GIB // 4))
    limits = read_container_limits(root, proc)
    assert limits.cpu_quota == 2.0 and limits.memory_available_bytes == 3 * GIB // 4


def test_v2_without_limits_nothing_is_bounded(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    proc = v2_tree(root, "/user.slice")
    write(root / "user.slice", cpu__max="max 100000", memory__max="max", memory__current=str(GIB))
    assert read_container_limits(root, proc) == ContainerLimits()


def test_v1_quota_and_limit_from_their_controllers(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    proc = tmp_path / "proc_self_cgroup"
    proc.write_text("4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/\n")
    write(root / "cpu/docker/abc", cpu__cfs_quota_us="150000", cpu__cfs_period_us="100000")
    write(
        root / "memory/docker/abc",
        memory__limit_in_bytes=str(3 * GIB),
        memory__usage_in_bytes=str(GIB),
        memory__stat=f"cache 7\ntotal_inactive_file {GIB // 2}",
    )
    limits = read_container_limits(root, proc)
    assert limits.cpu_quota == 1.5
    assert limits.memory_available_bytes == 3 * GIB - GIB // 2


def test_v1_unlimited_reads_as_no_limit(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    proc = tmp_path / "proc_self_cgroup"
    proc.write_text("4:memory:/\n3:cpu,cpuacct:/\n")
    write(root / "cpu", cpu__cfs_quota_us="-1", cpu__cfs_period_us="100000")
    write(root / "memory", memory__limit_in_bytes="9223372036854771712", memory__usage_in_bytes=str(GIB))
    assert read_container_limits(root, proc) == ContainerLimits()


@pytest.mark.parametrize(
    ("quota", "affinity", "expected"),
    [(None, {0, 1, 2, 3}, 4), (2.5, set(range(64)), 2), (0.5, set(range(64)), 1), (8.0, {3, 5}, 2)],
)
def test_threads_are_bounded_by_the_quota_rounded_down_and_the_affinity_mask(
    quota: float | None, affinity: set[int], expected: int
) -> None:
    assert usable_cpu_count(ContainerLimits(cpu_quota=quota), affinity) == expected


def test_the_default_thread_count_follows_the_quota(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(container_limits, "read_container_limits", lambda: ContainerLimits(cpu_quota=1.0))
    assert container_limits.default_num_threads(torch_threads=64) == 1
    monkeypatch.setattr(container_limits, "read_container_limits", lambda: ContainerLimits())
    assert container_limits.default_num_threads(torch_threads=1) == 1


def test_the_cpu_cache_is_sized_from_the_cgroups_headroom_when_it_is_smaller(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    host_available = kv_cache.free_memory_bytes(torch.device("cpu"))
    tight = ContainerLimits(memory_limit_bytes=GIB, memory_used_bytes=GIB // 4)
    monkeypatch.setattr(kv_cache, "read_container_limits", lambda: tight)
    assert kv_cache.free_memory_bytes(torch.device("cpu")) == min(host_available, 3 * GIB // 4)
    roomy = ContainerLimits(memory_limit_bytes=1 << 50, memory_used_bytes=0)
    monkeypatch.setattr(kv_cache, "read_container_limits", lambda: roomy)
    assert abs(kv_cache.free_memory_bytes(torch.device("cpu")) - host_available) < GIB


def test_offload_space_is_capped_by_the_cgroups_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_cache, "read_container_limits", lambda: ContainerLimits(memory_limit_bytes=GIB))
    bytes_per_block = 1 << 20
    # None asks for the cap itself: half of the 1 GiB limit, not half of the host's RAM.
    assert kv_cache.resolve_offload_blocks(None, 0.5, bytes_per_block) == GIB // 2 // bytes_per_block
