"""Faults under load: client disconnects, expired deadlines, cancel storms and duplicate cancels, a
client process and a pause holder killed with SIGKILL, and an exception in one engine step (SIGTERM
under load ends the load suite's server, in test_load.py).

Whatever happens to some requests, every other request completes with its greedy output, every
abandoned request ends cancelled, no KV block is left behind and the server keeps serving.

The clients are the synchronous SDK in threads: the in-process server owns this process's one
grpc.aio event loop.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import pytest
from cbserve_client import (
    AdminClient,
    CbserveError,
    Client,
    DeadlineExceededError,
    NotFoundError,
)

from tests.helpers.engine_runs import engine_core
from tests.helpers.models import tiny_model
from tests.helpers.reliability import (
    EXTRA_TOKENS,
    INTERNAL,
    REQUEST_TIMEOUT_S,
    Outcome,
    PoolEntry,
    final_outcome,
    mismatch,
    read_to_end,
    report,
)
from tests.helpers.servers import (
    ADMIN_TOKEN,
    SERVING,
    RunningServer,
    engine_config_for_tests,
    health_status,
    spawn_pause_holder,
    wait_all_blocks_free,
    wait_until,
)

pytestmark = pytest.mark.reliability

FAULT_LOAD_S = 25.0
NUM_WORKERS = 24
# What a worker does next, with its weight: most requests run to the end, the others are abandoned.
ACTIONS = {"complete": 8, "disconnect": 3, "channel_drop": 1, "deadline": 3, "cancel_storm": 2}
CANCEL_STORM_SIZE = 6
STREAMS_OF_KILLED_CLIENT = 8
# When, into the run, the one-off faults strike.
KILL_CLIENT_AT_S = 3.0
KILL_PAUSE_HOLDER_AT_S = 8.0
PAUSE_HELD_S = 1.5
FAIL_STEP_AT_S = 15.0
# Requests read back at once after the run (one channel refuses thousands of concurrent streams).
READ_BACK_THREADS = 16


class StepFault:
    """Makes exactly one engine step raise, once armed, and remembers the requests that step carried.

    It wraps the model runner's `launch` (called on the engine's loop thread only).
    """

    def __init__(self, runner: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        self.armed = threading.Event()
        self.fired = threading.Event()
        self.request_ids: set[str] = set()
        launch = runner.launch

        def launch_or_fail(scheduler_output: Any, previous: Any = None) -> Any:
            if self.armed.is_set() and not self.fired.is_set():
                self.request_ids = {item.request.request_id for item in scheduler_output.scheduled}
                self.fired.set()
                raise RuntimeError("injected fault in one engine step")
            return launch(scheduler_output, previous)

        monkeypatch.setattr(runner, "launch", launch_or_fail)


@dataclass
class FaultRun:
    # Requests that ran to the end (checked against the greedy output, unless their step failed).
    completed: dict[str, tuple[PoolEntry, Outcome]] = field(default_factory=dict)
    # Requests the client gave up on (cancelled, disconnected, timed out, killed): id -> its entry.
    abandoned: dict[str, PoolEntry] = field(default_factory=dict)
    # Abandoned before the server said it had queued them (a deadline that expired first): such a
    # request may never have reached the server.
    unconfirmed: set[str] = field(default_factory=set)
    faults: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def abandon(self, request_id: str, entry: PoolEntry) -> None:
        with self.lock:
            self.abandoned[request_id] = entry

    def count(self, fault: str, times: int = 1) -> None:
        with self.lock:
            self.faults[fault] += times


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def served(request: pytest.FixtureRequest, prompt_pool: list[PoolEntry]) -> Iterator[RunningServer]:
    """The server under faults, with steps resolved at once or launched one ahead (async batching)."""
    # Depends on the pool: its references are computed before the server takes the model.
    config = engine_config_for_tests(num_blocks=96, use_async_batching=request.param)
    running = RunningServer(tiny_model("llama"), config=config)
    try:
        running.load()
        yield running
    finally:
        running.close()


def test_faults_under_load_fail_only_their_own_requests_and_leak_nothing(
    served: RunningServer, prompt_pool: list[PoolEntry], monkeypatch: pytest.MonkeyPatch
) -> None:
    host = served.server.slot.host
    assert host is not None
    step_fault = StepFault(engine_core(host.manager).runner, monkeypatch)
    started = time.monotonic()
    with Client(served.target, timeout=30) as client:
        run = _faults_under_load(served, client, prompt_pool, step_fault)
        final = _read_back(client, [*run.abandoned, *run.completed])

    assert not run.problems, f"{len(run.problems)} problems, e.g. {run.problems[:5]}"
    assert step_fault.fired.is_set(), "the injected step fault never fired"
    failed = {request_id for request_id, outcome in final.items() if outcome.status == "failed"}
    assert failed == step_fault.request_ids, (
        f"failed requests {sorted(failed)}, requests of the failed step {sorted(step_fault.request_ids)}"
    )
    for request_id in failed:
        outcome = final[request_id]
        assert outcome.error_code == INTERNAL and "injected fault" in (outcome.error or ""), outcome
    for request_id, (entry, outcome) in run.completed.items():
        if request_id not in failed:
            assert mismatch(entry, outcome) is None, mismatch(entry, outcome)
    never_queued = 0
    for request_id, entry in run.abandoned.items():
        outcome = final[request_id]
        if outcome.status == "not found" and request_id in run.unconfirmed:
            never_queued += 1
        elif request_id not in failed:
            assert (outcome.status, outcome.finish_reason) == ("cancelled", "cancelled"), outcome
        received = outcome.token_ids[: len(entry.expected)]
        assert received == entry.expected[: len(received)], f"{request_id}: {received} vs {entry.expected}"

    with AdminClient(served.admin_target, token=ADMIN_TOKEN, timeout=30) as admin:
        wait_all_blocks_free(admin)
        status = admin.status()
    assert (status.queued_requests, status.paused, status.pause_holders) == (0, False, 0)
    assert status.counters["failed_steps"] == 1
    assert health_status(served.target) == SERVING
    canary = prompt_pool[20]
    with Client(served.target, timeout=30) as client:
        stream = client.stream(canary.prompt, max_new_tokens=canary.max_new_tokens, ignore_eos=True)
        outcome = read_to_end(stream)
    assert mismatch(canary, outcome) is None, mismatch(canary, outcome)
    async_batching = engine_core(host.manager).async_batching
    if async_batching:
        assert engine_core(host.manager).runner.num_placeholder_inputs > 0, "no step was launched ahead"
    report(
        "faults (async batching)" if async_batching else "faults",
        load_s=FAULT_LOAD_S,
        wall_s=round(time.monotonic() - started, 1),
        workers=NUM_WORKERS,
        requests=len(run.completed) + len(run.abandoned),
        completed_with_greedy_output=len(set(run.completed) - failed),
        abandoned_and_cancelled=len(set(run.abandoned) - failed) - never_queued,
        abandoned_before_reaching_the_server=never_queued,
        failed_with_the_injected_step=len(failed),
        faults_injected=dict(sorted(run.faults.items())),
        kv_blocks_used_after=status.kv_blocks_used,
    )


def _faults_under_load(
    served: RunningServer, client: Client, pool: list[PoolEntry], step_fault: StepFault
) -> FaultRun:
    run = FaultRun()
    started = time.monotonic()
    deadline = started + FAULT_LOAD_S
    with ThreadPoolExecutor(NUM_WORKERS, thread_name_prefix="fault-worker") as workers:
        futures = [
            workers.submit(_worker, index, served.target, client, pool, deadline, run)
            for index in range(NUM_WORKERS)
        ]
        _sleep_until(started + KILL_CLIENT_AT_S)
        ids = _kill_a_client_process(served.target, pool[25])
        for request_id in ids:
            run.abandon(request_id, pool[25])
        run.count("client_process_sigkill")
        run.count("streams_of_killed_client", len(ids))
        _sleep_until(started + KILL_PAUSE_HOLDER_AT_S)
        _kill_a_pause_holder(served.admin_target)
        run.count("pause_holder_sigkill")
        _sleep_until(started + FAIL_STEP_AT_S)
        step_fault.armed.set()
        assert step_fault.fired.wait(REQUEST_TIMEOUT_S), "the step fault was armed but no step ran"
        run.count("engine_step_exception")
        for future in futures:
            future.result()
    return run


def _sleep_until(moment: float) -> None:
    time.sleep(max(0.0, moment - time.monotonic()))


def _worker(
    index: int, target: str, client: Client, pool: list[PoolEntry], deadline: float, run: FaultRun
) -> None:
    rng = random.Random(1_000 + index)
    actions, weights = list(ACTIONS), list(ACTIONS.values())
    while time.monotonic() < deadline:
        action = rng.choices(actions, weights)[0]
        entry = rng.choice(pool)
        try:
            if action == "complete":
                stream = client.stream(
                    entry.prompt,
                    max_new_tokens=entry.max_new_tokens,
                    ignore_eos=True,
                    timeout=REQUEST_TIMEOUT_S,
                )
                outcome = read_to_end(stream)
                with run.lock:
                    run.completed[outcome.request_id] = (entry, outcome)
            elif action == "disconnect":
                _disconnect(client, entry, rng.randrange(4), run)
            elif action == "channel_drop":
                with Client(target) as own_client:
                    _disconnect(own_client, entry, rng.randrange(4), run, close_channel=True)
            elif action == "deadline":
                _deadline(client, entry, rng.uniform(0.05, 0.6), run)
            else:
                _cancel_storm(client, entry, run)
        except CbserveError as exc:
            with run.lock:
                run.problems.append(f"worker {index}, {action}: {type(exc).__name__}: {exc}")
        if action != "complete":
            run.count(action)


def _long(entry: PoolEntry) -> dict[str, Any]:
    """Sampling arguments of a request that runs far longer than the client waits for it."""
    return {"max_new_tokens": entry.max_new_tokens + EXTRA_TOKENS, "ignore_eos": True}


def _disconnect(
    client: Client, entry: PoolEntry, chunks_read: int, run: FaultRun, close_channel: bool = False
) -> None:
    """Reads a few chunks, then goes away: cancels the call, or closes the whole channel."""
    stream = client.stream(entry.prompt, timeout=REQUEST_TIMEOUT_S, **_long(entry))
    run.abandon(stream.request_id, entry)
    for _ in range(chunks_read + 1):  # the first chunk says the request is queued
        if next(stream).finished:  # its step failed: nothing left to walk away from
            break
    if close_channel:
        client.close()
    else:
        stream.close()


def _deadline(client: Client, entry: PoolEntry, timeout_s: float, run: FaultRun) -> None:
    stream = client.stream(entry.prompt, timeout=timeout_s, **_long(entry))
    run.abandon(stream.request_id, entry)
    queued = False
    try:
        for chunk in stream:
            queued = True
            if chunk.finished:
                if chunk.status == "failed":  # its step failed before the deadline
                    return
                break
    except DeadlineExceededError:
        if not queued:
            with run.lock:
                run.unconfirmed.add(stream.request_id)
        return
    with run.lock:
        run.problems.append(f"{stream.request_id}: its {timeout_s:.2f} s deadline never expired")


def _cancel_storm(client: Client, entry: PoolEntry, run: FaultRun) -> None:
    """Queues a few long requests, then cancels each of them twice at once, plus ids never seen."""
    ids = [client.submit(entry.prompt, **_long(entry)) for _ in range(CANCEL_STORM_SIZE)]
    for request_id in ids:
        run.abandon(request_id, entry)
    unknown = [f"never-seen-{request_id}" for request_id in ids[:2]]
    with ThreadPoolExecutor(len(ids), thread_name_prefix="cancel-storm") as storm:
        answers = list(storm.map(client.cancel, [*ids, *ids, *unknown]))
    problems = []
    if any(answers[-len(unknown) :]):
        problems.append(f"cancelling unknown ids answered {answers[-len(unknown) :]}, want False")
    for request_id in ids:
        final_outcome(client, request_id)
        if client.cancel(request_id):
            problems.append(f"{request_id}: cancelled again after it ended, and the server said it was live")
    with run.lock:
        run.problems.extend(problems)


def _kill_a_client_process(target: str, entry: PoolEntry) -> list[str]:
    """A client process opens streams, then dies with SIGKILL: its connection just drops."""
    script = (
        "import time\n"
        "from cbserve_client import Client\n"
        f"client = Client({target!r})\n"
        "streams = []\n"
        f"for _ in range({STREAMS_OF_KILLED_CLIENT}):\n"
        f"    streams.append(client.stream({entry.prompt!r}, **{_long(entry)!r}))\n"
        "    next(streams[-1])\n"  # queued on the server
        "    print(streams[-1].request_id, flush=True)\n"
        "time.sleep(600)\n"
    )
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        ids = [process.stdout.readline().strip() for _ in range(STREAMS_OF_KILLED_CLIENT)]
        time.sleep(0.5)  # let its requests decode a little
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=REQUEST_TIMEOUT_S)
    assert all(ids), f"the client process did not start its streams: {ids}"
    return ids


def _kill_a_pause_holder(admin_target: str) -> None:
    holder = spawn_pause_holder(admin_target)
    try:
        with AdminClient(admin_target, token=ADMIN_TOKEN, timeout=30) as admin:
            assert admin.status().paused
            time.sleep(PAUSE_HELD_S)
            holder.send_signal(signal.SIGKILL)
            holder.wait(timeout=REQUEST_TIMEOUT_S)
            wait_until(lambda: not admin.status().paused, what="the pause released after its holder died")
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(timeout=REQUEST_TIMEOUT_S)


def _read_back(client: Client, request_ids: list[str]) -> dict[str, Outcome]:
    """How each request ended, from StreamResults; "not found" for one the server never had."""

    def read(request_id: str) -> Outcome:
        try:
            return final_outcome(client, request_id)
        except NotFoundError:
            return Outcome(request_id, status="not found")

    with ThreadPoolExecutor(READ_BACK_THREADS, thread_name_prefix="read-back") as readers:
        return dict(zip(request_ids, readers.map(read, request_ids), strict=True))
