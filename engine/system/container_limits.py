"""What this process may use of the host's CPUs and memory: its affinity mask and its cgroup's limits.

A container sees the whole host (`os.cpu_count()`, `psutil.virtual_memory()`), but Kubernetes limits a
pod with cgroup controls: `resources.limits.cpu` becomes a CPU quota (cgroup v2 `cpu.max`, v1
`cpu.cfs_quota_us` / `cpu.cfs_period_us`), `resources.limits.memory` a memory limit (`memory.max`, v1
`memory.limit_in_bytes`). An engine that runs 64 threads under a quota of 2 CPUs is throttled most of
every scheduling period; one that sizes its KV cache from the host's free memory is OOM-killed by its
pod's limit under load. Threads therefore default to the CPUs the process may really use, and the CPU
KV cache is sized from the smaller of the host's free memory and the cgroup's headroom.

The cgroup of this process is found from `/proc/self/cgroup`; every ancestor's limit applies as well, so
the smallest along the path to the root counts. A process in its own cgroup namespace (a container) sees
its cgroup as the root of the hierarchy.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")
# cgroup v1 spells "no memory limit" as the largest page-aligned 64-bit value; anything this large is none.
UNLIMITED_BYTES = 1 << 62


@dataclass(frozen=True)
class ContainerLimits:
    """The cgroup's limits on this process; None where there is none."""

    # CPUs' worth of time per period (quota / period): 1.5 is one and a half CPUs.
    cpu_quota: float | None = None
    memory_limit_bytes: int | None = None
    # The working set, as Kubernetes counts it against the limit: usage less the inactive file cache,
    # which the kernel reclaims before it kills anything.
    memory_used_bytes: int | None = None

    @property
    def memory_available_bytes(self) -> int | None:
        """Bytes the process may still allocate before the cgroup's limit; None without a limit."""
        if self.memory_limit_bytes is None:
            return None
        return max(0, self.memory_limit_bytes - (self.memory_used_bytes or 0))


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _own_cgroup_paths(proc_self_cgroup: Path) -> dict[str, str]:
    """Controller -> this process's cgroup path, from /proc/self/cgroup ("" for the v2 hierarchy)."""
    paths: dict[str, str] = {}
    for line in (_read(proc_self_cgroup) or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        for controller in parts[1].split(",") if parts[1] else [""]:
            paths[controller] = parts[2]
    return paths


def _cgroup_dirs(mount: Path, own_path: str | None) -> list[Path]:
    """This process's cgroup folder under `mount` and its ancestors up to `mount`, leaf first. A path
    that does not exist under `mount` (a cgroup namespace shows the container's cgroup as the root)
    leaves `mount` alone."""
    leaf = mount / own_path.lstrip("/") if own_path else mount
    if not leaf.is_dir():
        return [mount]
    folders = [leaf]
    while folders[-1] != mount and mount in folders[-1].parents:
        folders.append(folders[-1].parent)
    return folders


def _smallest(values: list[float | None]) -> float | None:
    known = [value for value in values if value is not None]
    return min(known) if known else None


def _v2_cpu_quota(folder: Path) -> float | None:
    text = _read(folder / "cpu.max")
    if not text:
        return None
    quota, _, period = text.partition(" ")
    if quota == "max" or not period:
        return None
    return int(quota) / int(period)


def _v1_cpu_quota(folder: Path) -> float | None:
    quota, period = _read(folder / "cpu.cfs_quota_us"), _read(folder / "cpu.cfs_period_us")
    if quota is None or period is None or int(quota) <= 0 or int(period) <= 0:
        return None
    return int(quota) / int(period)


def _bytes(text: str | None) -> int | None:
    if text is None or text == "max":
        return None
    value = int(text)
    return None if value >= UNLIMITED_BYTES else value


def _inactive_file(folder: Path, key: str) -> int:
    for line in (_read(folder / "memory.stat") or "").splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return int(value)
    return 0


def read_container_limits(
    root: Path = CGROUP_ROOT, proc_self_cgroup: Path = PROC_SELF_CGROUP
) -> ContainerLimits:
    """The limits of this process's cgroup (v2, or v1's cpu and memory controllers) under `root`."""
    own = _own_cgroup_paths(proc_self_cgroup)
    if (root / "cgroup.controllers").exists():  # v2: one hierarchy
        folders = _cgroup_dirs(root, own.get(""))
        cpu_quota = _smallest([_v2_cpu_quota(folder) for folder in folders])
        limits = [(_bytes(_read(folder / "memory.max")), folder) for folder in folders]
        usage_of = ("memory.current", "inactive_file")
    else:  # v1: a hierarchy per controller
        cpu_quota = _smallest(
            [_v1_cpu_quota(folder) for folder in _cgroup_dirs(root / "cpu", own.get("cpu"))]
        )
        folders = _cgroup_dirs(root / "memory", own.get("memory"))
        limits = [(_bytes(_read(folder / "memory.limit_in_bytes")), folder) for folder in folders]
        usage_of = ("memory.usage_in_bytes", "total_inactive_file")
    bounded = [(limit, folder) for limit, folder in limits if limit is not None]
    if not bounded:
        return ContainerLimits(cpu_quota=cpu_quota)
    # The tightest limit is the one to fit under, with the usage counted in the same cgroup.
    limit, folder = min(bounded, key=lambda each: each[0] - _working_set(each[1], usage_of))
    return ContainerLimits(cpu_quota, limit, _working_set(folder, usage_of))


def _working_set(folder: Path, usage_of: tuple[str, str]) -> int:
    usage = _bytes(_read(folder / usage_of[0])) or 0
    return max(0, usage - _inactive_file(folder, usage_of[1]))


def usable_cpu_count(limits: ContainerLimits | None = None, affinity: set[int] | None = None) -> int:
    """CPUs this process can keep busy: its affinity mask, bounded by the cgroup's quota (rounded down:
    a thread more than the quota holds is throttled every period), at least 1."""
    limits = read_container_limits() if limits is None else limits
    count = len(os.sched_getaffinity(0) if affinity is None else affinity)
    if limits.cpu_quota is not None:
        count = min(count, max(1, math.floor(limits.cpu_quota)))
    return max(1, count)


def default_num_threads(torch_threads: int) -> int:
    """Intra-op threads when none are configured: torch's own default (`torch_threads`, the cores it
    sees), bounded by `usable_cpu_count`. Logs when the bound lowers it."""
    limits = read_container_limits()
    usable = usable_cpu_count(limits)
    if usable < torch_threads:
        logger.info(
            "%d intra-op threads, not torch's %d: the affinity mask holds %d CPUs and the cgroup's quota "
            "is %s (set num_threads to choose)",
            usable,
            torch_threads,
            len(os.sched_getaffinity(0)),
            "none" if limits.cpu_quota is None else f"{limits.cpu_quota:g} CPUs",
        )
    return min(torch_threads, usable)
