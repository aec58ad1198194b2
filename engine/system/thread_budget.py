"""How many intra-op threads the engine's steps run on: the CPUs the process may use, less those other
processes keep busy.

A step is hundreds of parallel regions (every norm, rotary and residual op), each ending at a barrier
where all of its threads must arrive. When another process runs on one of the cores, the thread that
shares that core arrives a scheduler time slice late, at every barrier: measured on 2 cores with other
work running, one SmolLM2 request took 142 ms a token on one thread, 615 ms on two that sleep between
regions, and more than 2 s on two that spin (the server's setting, `service/openmp.py`, which is what
makes it fast alone). One thread fewer than the busy cores loses nothing to barriers.

So between steps, at most every `SAMPLE_INTERVAL_S`, the budget reads how busy the CPUs of the affinity
mask were (`/proc/stat`, steal time included: a hypervisor's other guests are neighbours too) and takes
this process's own CPU time off it; what is left is other processes' load, in CPUs. The thread count
follows `maximum` less the CPUs the others take, between 1 and `maximum`, once two samples in a row
agree. Only when the process may run on no more CPUs than it has threads (`maximum` equals the affinity
mask's size): with a wider mask the kernel moves our threads to idle CPUs itself.

How much load takes a CPU depends on how it comes. A process that is always runnable holds the core for
whole scheduler slices, and our spinning thread beside it gets half of it: such a neighbour shows as
half a CPU or more, and costs every barrier a slice. A process that runs in short bursts (the client of
a streaming server on the same machine, handling each token as it comes) gives the core back within a
fraction of a millisecond. Measured on the 2-core EPYC, SmolLM2's products at 16 rows: 33.8 ms quiet on
two threads; beside a pinned busy loop 107.6 ms on two, 61.3 on one; beside a process busy 0.7 ms of
every 1.0, 61.2 and 60.2; and over gRPC with the benchmark's client on the same machine (0.7 CPU), 32
chats ran at 264.5 tokens/s on two threads against 225.0 with the budget dropping to one. So the budget
also reads how long the steps' threads waited to run each time they did (`/proc/self/task/*/schedstat`,
the OpenMP team's threads): at `LONG_WAIT_S` or more the others hold cores for whole slices, and a CPU
counts as taken from 0.4 of one busy, the share a squeezed busy process shows; with shorter waits, only
from 0.85. Without schedstat, the first rule.
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

from engine.system.native_library import KernelUnavailable, load_library

logger = logging.getLogger(__name__)

PROC_STAT = Path("/proc/stat")
SAMPLE_INTERVAL_S = 0.5
# The steps' threads' average wait to run, from which the others hold cores for whole scheduler slices
# (measured: 3.8 ms beside a busy loop, 0.7 ms beside a process in 0.7 ms bursts, 0.1 ms quiet).
LONG_WAIT_S = 0.0015
OPENMP_TEAM_SOURCE = Path(__file__).with_name("openmp_team.c")
# /proc/stat's columns after the cpu name: user nice system idle iowait irq softirq steal ...
_BUSY_COLUMNS = (0, 1, 2, 5, 6, 7)


def busy_seconds(cpus: set[int], stat_path: Path = PROC_STAT) -> float | None:
    """Seconds the CPUs in `cpus` spent busy since boot (None where /proc/stat cannot be read)."""
    try:
        lines = stat_path.read_text().splitlines()
    except OSError:
        return None
    ticks = 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        columns = rest.split()
        ticks += sum(int(columns[index]) for index in _BUSY_COLUMNS if index < len(columns))
    return ticks / os.sysconf("SC_CLK_TCK")


def _taken_cpus(others: float, long_waits: bool) -> int:
    """CPUs that other processes' load of `others` CPUs takes from the steps (see the module docstring)."""
    return round(others + 0.1) if long_waits else math.floor(others + 0.15)


class TeamWaits:
    """The average time the steps' threads (the calling thread's OpenMP team) waited on a run queue each
    time they ran, between one call and the next; called on the steps' thread."""

    def __init__(self, task_folder: Path = Path("/proc/self/task")) -> None:
        self._task_folder = task_folder
        self._threads = 0  # the team size `_ids` were read for
        self._ids: list[int] = []
        self._last: tuple[int, int] | None = None  # (wait ns, times run) at the last call
        self._unavailable = False  # the helper cannot be built here: not retried every sample

    def _team_ids(self, threads: int) -> list[int]:
        library = load_library(
            OPENMP_TEAM_SOURCE,
            ("-O2", "-fopenmp", "-shared", "-fPIC"),
            {"openmp_team_thread_ids": [ctypes.c_int, ctypes.c_void_p]},
        )
        ids = (ctypes.c_int64 * threads)(*([-1] * threads))
        library.openmp_team_thread_ids(threads, ids)
        return [thread_id for thread_id in ids if thread_id >= 0]

    def _totals(self) -> tuple[int, int] | None:
        waited = runs = 0
        for thread_id in self._ids:
            try:
                _, wait_ns, times_run = (
                    int(field)
                    for field in (self._task_folder / str(thread_id) / "schedstat").read_text().split()[:3]
                )
            except (OSError, ValueError):
                return None
            waited += wait_ns
            runs += times_run
        return waited, runs

    def __call__(self, threads: int) -> float | None:
        """Seconds per run since the last call with the same thread count; None for the first, or where
        the team or schedstat cannot be read."""
        if self._unavailable:
            return None
        if threads != self._threads:
            try:
                self._ids = self._team_ids(threads)
            except KernelUnavailable:
                self._unavailable = True
                return None
            self._threads, self._last = threads, None
        totals = self._totals()
        last, self._last = self._last, totals
        if totals is None or last is None or totals[1] <= last[1]:
            return None
        return (totals[0] - last[0]) / 1e9 / (totals[1] - last[1])


class ThreadBudget:
    """The steps' thread count, adapted to other processes' load (see the module docstring)."""

    def __init__(
        self,
        maximum: int,
        adaptive: bool,
        cpus: set[int] | None = None,
        busy: Callable[[], float | None] | None = None,
        own_cpu_seconds: Callable[[], float] = time.process_time,
        clock: Callable[[], float] = time.monotonic,
        team_waits: Callable[[int], float | None] | None = None,
    ) -> None:
        self.maximum = maximum
        self.threads = maximum
        cpus = os.sched_getaffinity(0) if cpus is None else cpus
        # A wider mask than the threads leaves the kernel room to place them on idle CPUs.
        self.adaptive = adaptive and maximum > 1 and len(cpus) <= maximum
        self._busy = busy or (lambda: busy_seconds(cpus))
        self._own_cpu_seconds = own_cpu_seconds
        self._team_waits = team_waits or TeamWaits()
        self._clock = clock
        self._last: tuple[float, float, float] | None = None  # (time, busy, own) of the last sample
        self._proposed: int | None = None

    def update(self) -> int:
        """Between two steps, on the steps' thread: the thread count to run the next step on."""
        if not self.adaptive:
            return self.threads
        now = self._clock()
        if self._last is not None and now - self._last[0] < SAMPLE_INTERVAL_S:
            return self.threads
        busy, own = self._busy(), self._own_cpu_seconds()
        if busy is None:  # no /proc/stat: the count stays where it is
            self.adaptive = False
            return self.threads
        last, self._last = self._last, (now, busy, own)
        if last is None:
            return self.threads
        others = max(0.0, ((busy - last[1]) - (own - last[2])) / (now - last[0]))
        wait = self._team_waits(self.threads)
        taken = _taken_cpus(others, long_waits=wait is None or wait >= LONG_WAIT_S)
        wanted = min(self.maximum, max(1, self.maximum - taken))
        agreed, self._proposed = wanted == self._proposed, wanted
        if agreed and wanted != self.threads:
            logger.info(
                "other processes keep %.1f of %d CPUs busy: steps run on %d thread(s), not %d",
                others,
                self.maximum,
                wanted,
                self.threads,
            )
            self.threads = wanted
        return self.threads
