"""The steps' thread count follows other processes' load on the CPUs the engine may use: fewer threads
while a neighbour keeps a core busy, all of them again once it is gone, and all of them beside a neighbour
that runs in short bursts (engine.system.thread_budget). Fed with a fake clock, fake CPU counters and fake
waits of the steps' threads; /proc/stat's parsing with a fake file, the team's waits from the real
schedstat."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from engine.system.thread_budget import SAMPLE_INTERVAL_S, TeamWaits, ThreadBudget, busy_seconds


class FakeMachine:
    """Two CPUs, this process and a neighbour: seconds of CPU time each has used."""

    def __init__(self) -> None:
        self.now = 0.0
        self.busy = 0.0
        self.own = 0.0
        # The steps' threads' average wait to run over the last interval (None: schedstat unreadable).
        self.wait: float | None = 0.0001

    def run(self, seconds: float, own_cpus: float, other_cpus: float) -> None:
        self.now += seconds
        self.own += own_cpus * seconds
        self.busy += (own_cpus + other_cpus) * seconds

    def budget(self, maximum: int = 2, cpus: set[int] | None = None, adaptive: bool = True) -> ThreadBudget:
        return ThreadBudget(
            maximum,
            adaptive,
            cpus={0, 1} if cpus is None else cpus,
            busy=lambda: self.busy,
            own_cpu_seconds=lambda: self.own,
            clock=lambda: self.now,
            team_waits=lambda threads: self.wait,
        )


def threads_over(
    machine: FakeMachine,
    budget: ThreadBudget,
    samples: int,
    own: float,
    other: float,
    wait: float | None = 0.0001,
) -> list[int]:
    counts = []
    machine.wait = wait
    for _ in range(samples):
        machine.run(SAMPLE_INTERVAL_S, own_cpus=min(own, budget.threads), other_cpus=other)
        counts.append(budget.update())
    return counts


def test_a_busy_neighbour_drops_a_thread_and_its_leaving_brings_it_back() -> None:
    machine = FakeMachine()
    budget = machine.budget()
    assert threads_over(machine, budget, 3, own=2.0, other=0.0) == [2, 2, 2]
    # A neighbour always runnable takes half of one core from our spinning threads, which wait whole
    # scheduler slices to run: after two samples agree, one thread.
    assert threads_over(machine, budget, 3, own=1.5, other=0.5, wait=0.004) == [2, 1, 1]
    # It keeps its core, and ours no longer waits: still one.
    assert threads_over(machine, budget, 3, own=1.0, other=1.0) == [1, 1, 1]
    # Gone: two again, after two quiet samples.
    assert threads_over(machine, budget, 3, own=1.0, other=0.0) == [1, 2, 2]


def test_a_neighbour_in_short_bursts_keeps_every_thread_and_brings_them_back() -> None:
    """A streaming client on the same machine: 0.7 of a CPU in bursts that leave our threads waiting
    well under a slice."""
    machine = FakeMachine()
    budget = machine.budget()
    assert threads_over(machine, budget, 4, own=1.3, other=0.7, wait=0.0007) == [2, 2, 2, 2]
    # After a busy neighbour took a thread, the bursty load alone leaves the spare core partly idle.
    assert threads_over(machine, budget, 3, own=1.5, other=0.5, wait=0.004) == [2, 1, 1]
    assert threads_over(machine, budget, 3, own=1.0, other=0.7) == [1, 2, 2]


def test_without_the_threads_waits_the_load_alone_decides() -> None:
    machine = FakeMachine()
    budget = machine.budget()
    threads_over(machine, budget, 1, own=2.0, other=0.0)
    assert threads_over(machine, budget, 3, own=1.5, other=0.5, wait=None) == [2, 1, 1]


def test_one_noisy_sample_changes_nothing() -> None:
    machine = FakeMachine()
    budget = machine.budget()
    threads_over(machine, budget, 2, own=2.0, other=0.0)
    assert threads_over(machine, budget, 1, own=1.2, other=0.8) == [2]
    assert threads_over(machine, budget, 3, own=2.0, other=0.0) == [2, 2, 2]


def test_light_background_load_keeps_every_thread() -> None:
    machine = FakeMachine()
    budget = machine.budget()
    assert threads_over(machine, budget, 4, own=1.7, other=0.3) == [2, 2, 2, 2]


def test_samples_come_at_most_every_interval() -> None:
    machine = FakeMachine()
    budget = machine.budget()
    threads_over(machine, budget, 2, own=2.0, other=0.0)
    for _ in range(10):  # many short steps inside one interval: one sample at most
        machine.run(SAMPLE_INTERVAL_S / 20, own_cpus=1.0, other_cpus=1.0)
        assert budget.update() == 2


@pytest.mark.parametrize(
    ("maximum", "cpus", "adaptive"),
    [(2, {0, 1}, False), (1, {0}, True), (2, set(range(8)), True)],
    ids=["configured", "one-thread", "wider-mask"],
)
def test_the_count_is_fixed_when_configured_single_or_the_mask_is_wider(
    maximum: int, cpus: set[int], adaptive: bool
) -> None:
    machine = FakeMachine()
    budget = machine.budget(maximum, cpus, adaptive)
    assert threads_over(machine, budget, 4, own=maximum / 2, other=1.0) == [maximum] * 4


def test_busy_seconds_sums_the_masks_cpus_with_steal(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    stat.write_text(
        "cpu  900 0 900 9000 0 0 0 0 0 0\n"
        # user nice system idle iowait irq softirq steal guest guest_nice
        "cpu0 100 10 20 5000 7 1 2 30 0 0\n"
        "cpu1 200 0 40 4000 3 0 0 0 0 0\n"
        "cpu2 999 0 999 0 0 0 0 0 0 0\n"
        "intr 12345\n"
    )
    ticks = (100 + 10 + 20 + 1 + 2 + 30) + (200 + 40)
    assert busy_seconds({0, 1}, stat) == pytest.approx(ticks / os.sysconf("SC_CLK_TCK"))
    assert busy_seconds({0}, tmp_path / "missing") is None


def test_team_waits_reads_the_openmp_teams_schedstat(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    waits = TeamWaits()
    ids = waits._team_ids(2)
    assert len(set(ids)) == 2 and all((Path("/proc/self/task") / str(tid)).is_dir() for tid in ids)
    assert waits(2) is None  # the first call only takes the counters
    matrix = torch.randn(300, 300)
    for _ in range(20):
        matrix @ matrix
        # Past libgomp's spin: the team sleeps and each product wakes it, so every thread runs anew (a
        # team that only spins, as it did in a full run on a quiet AVX-512 Xeon, adds no runs to count).
        time.sleep(0.005)
    wait = waits(2)
    assert wait is not None and 0.0 <= wait < 1.0
    assert TeamWaits(tmp_path)(2) is None, "no schedstat: no figure"
