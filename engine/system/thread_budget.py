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
follows `maximum - others`, rounded, between 1 and `maximum`, once two samples in a row agree. Only when
the process may run on no more CPUs than it has threads (`maximum` equals the affinity mask's size):
with a wider mask the kernel moves our threads to idle CPUs itself.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

PROC_STAT = Path("/proc/stat")
SAMPLE_INTERVAL_S = 0.5
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
    ) -> None:
        self.maximum = maximum
        self.threads = maximum
        cpus = os.sched_getaffinity(0) if cpus is None else cpus
        # A wider mask than the threads leaves the kernel room to place them on idle CPUs.
        self.adaptive = adaptive and maximum > 1 and len(cpus) <= maximum
        self._busy = busy or (lambda: busy_seconds(cpus))
        self._own_cpu_seconds = own_cpu_seconds
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
        wanted = min(self.maximum, max(1, round(self.maximum - others - 0.1)))
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
