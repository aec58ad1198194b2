"""Load: 128 concurrent streams of mixed lengths for a minute, through the Python SDK, against a
`cbserve serve` subprocess (so its memory is the server's alone); then SIGTERM under load ends it."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from cbserve_client import AdminClient, AsyncClient, CbserveError, Client, UnavailableError

from tests.helpers.reliability import (
    MIB,
    REQUEST_TIMEOUT_S,
    Outcome,
    PoolEntry,
    RssSampler,
    mismatch,
    read_to_end,
    read_to_end_async,
    report,
)
from tests.helpers.servers import ADMIN_TOKEN, NOT_SERVING, ServerProcess, probe_health, wait_until

pytestmark = pytest.mark.reliability

NUM_STREAMS = 128
# Streams are spread over several channels, as many clients would open them.
NUM_CHANNELS = 8
LOAD_S = 60.0
# Every 4th worker queues with AddRequest and reads with StreamResults; the others use Generate.
RESULTS_EVERY = 4
# The cache holds fewer tokens than 128 requests want at once, so requests queue and get preempted;
# the grace period leaves SIGTERM's drain all the time it needs.
SERVER_FLAGS = ("--num-blocks", "96", "--page-size", "16", "--max-batch-tokens", "256")
SERVER_FLAGS += ("--grace-period", "60")
# Resident memory may settle during the run, not climb: the second half's peak stays within this of
# the first half's.
RSS_GROWTH_FRACTION = 0.15
RSS_GROWTH_SLACK = 64 * MIB
# On SIGTERM, the pool's 32 requests are in flight, and a few that run this much longer.
SIGTERM_LONG_STREAMS = 8
SIGTERM_EXTRA_TOKENS = 120


@dataclass
class LoadRun:
    completed: int = 0
    generated_tokens: int = 0
    mismatches: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    # The most requests the server held at once (running + queued), from GetStatus samples.
    peak_in_server: int = 0
    started: float = 0.0
    # When the last request completed (workers stop sending new ones after LOAD_S).
    ended: float = 0.0


@pytest.fixture(scope="module")
def server(saved_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Started, not yet awaited: the prompt pool's references are computed while the model loads."""
    log_path = tmp_path_factory.mktemp("load-server") / "server.log"
    running = ServerProcess(saved_model_dir, log_path, *SERVER_FLAGS)
    try:
        yield running
    finally:
        running.close()


def test_128_streams_for_a_minute_all_complete_with_greedy_outputs_and_nothing_leaks(
    server: ServerProcess, prompt_pool: list[PoolEntry]
) -> None:
    server.wait_serving()
    with RssSampler(server.pid) as rss:
        run = asyncio.run(_load(server, prompt_pool))
    assert not run.errors, f"{len(run.errors)} requests failed, e.g. {run.errors[:3]}\n{server.log_tail()}"
    assert not run.mismatches, (
        f"{len(run.mismatches)} of {run.completed} outputs differ from the request run alone, "
        f"e.g. {run.mismatches[:3]}"
    )
    assert run.ended - run.started >= LOAD_S
    assert run.peak_in_server >= NUM_STREAMS * 0.9, (
        f"at most {run.peak_in_server} requests were in the server at once, want about {NUM_STREAMS}"
    )

    with AdminClient(server.admin_target, token=ADMIN_TOKEN, timeout=30) as admin:
        wait_until(
            lambda: (status := admin.status()).kv_blocks_used == 0 and status.active_requests == 0,
            what="every KV block free after the load",
        )
        status = admin.status()
    assert (status.queued_requests, status.counters["failed_steps"]) == (0, 0)
    assert status.finished_requests == run.completed, (
        f"the server ended {status.finished_requests} requests, the clients completed {run.completed}"
    )

    first_half, second_half = rss.peaks(run.started, run.ended)
    bound = first_half * (1 + RSS_GROWTH_FRACTION) + RSS_GROWTH_SLACK
    assert second_half <= bound, (
        f"server RSS peak grew from {first_half / MIB:.0f} MiB (first half) to "
        f"{second_half / MIB:.0f} MiB (second half), over the bound of {bound / MIB:.0f} MiB"
    )
    report(
        "load",
        streams=NUM_STREAMS,
        load_s=round(run.ended - run.started, 1),
        requests_completed=run.completed,
        requests_lost=len(run.errors),
        outputs_differing_from_alone=len(run.mismatches),
        tokens_generated=run.generated_tokens,
        peak_requests_in_server=run.peak_in_server,
        kv_blocks_used_after=status.kv_blocks_used,
        preemptions=status.preemptions,
        prefix_cache_hit_rate=round(status.prefix_cache_hit_rate, 3),
        server_rss_mib_first_half_peak=round(first_half / MIB),
        server_rss_mib_second_half_peak=round(second_half / MIB),
    )


async def _load(server: ServerProcess, pool: list[PoolEntry]) -> LoadRun:
    """Each of 128 workers sends one request after another until LOAD_S has passed; each output is
    checked against the request's greedy output run alone."""
    run = LoadRun(started=time.monotonic())
    deadline = run.started + LOAD_S
    clients = [AsyncClient(server.target) for _ in range(NUM_CHANNELS)]
    monitor = asyncio.create_task(_watch_server(server.admin_target, run))
    try:
        await asyncio.gather(
            *(
                _worker(index, clients[index % NUM_CHANNELS], pool, deadline, run)
                for index in range(NUM_STREAMS)
            )
        )
    finally:
        run.ended = time.monotonic()
        monitor.cancel()
        for client in clients:
            await client.close()
    return run


async def _worker(
    index: int, client: AsyncClient, pool: list[PoolEntry], deadline: float, run: LoadRun
) -> None:
    rng = random.Random(index)
    while time.monotonic() < deadline:
        entry = rng.choice(pool)
        try:
            outcome = await asyncio.wait_for(
                _request(client, entry, with_results=index % RESULTS_EVERY == 0), REQUEST_TIMEOUT_S
            )
        except (CbserveError, TimeoutError) as exc:
            run.errors.append(f"worker {index}: {type(exc).__name__}: {exc}")
            continue
        run.completed += 1
        run.generated_tokens += len(outcome.token_ids)
        problem = mismatch(entry, outcome)
        if problem is not None:
            run.mismatches.append(problem)


async def _request(client: AsyncClient, entry: PoolEntry, *, with_results: bool) -> Outcome:
    if with_results:
        request_id = await client.submit(entry.prompt, max_new_tokens=entry.max_new_tokens, ignore_eos=True)
        return await read_to_end_async(client.results(request_id))
    return await read_to_end_async(
        client.stream(entry.prompt, max_new_tokens=entry.max_new_tokens, ignore_eos=True)
    )


async def _watch_server(admin_target: str, run: LoadRun) -> None:
    loop = asyncio.get_running_loop()
    with AdminClient(admin_target, token=ADMIN_TOKEN, timeout=10) as admin:
        while True:
            status = await loop.run_in_executor(None, admin.status)
            run.peak_in_server = max(run.peak_in_server, status.active_requests + status.queued_requests)
            await asyncio.sleep(0.5)


def test_sigterm_under_load_finishes_in_flight_requests_refuses_new_ones_and_exits_0(
    server: ServerProcess, prompt_pool: list[PoolEntry]
) -> None:
    server.wait_serving()
    # One try: the draining server's refusal is what is checked, not the SDK's retries of it, whose
    # backoff on a loaded machine outlasted the requests still draining.
    with Client(server.target, timeout=30, retry_attempts=1) as client:
        outcomes, refusal, unfinished_at_refusal = _sigterm_under_load(server, client, prompt_pool)
    assert server.process.wait(timeout=REQUEST_TIMEOUT_S) == 0, server.log_tail()
    assert unfinished_at_refusal > 0, "every request had ended before the new one was tried"
    assert isinstance(refusal, UnavailableError) and "draining" in refusal.details, repr(refusal)
    exact, long = outcomes[: len(prompt_pool)], outcomes[len(prompt_pool) :]
    for entry, outcome in zip(prompt_pool, exact, strict=True):
        assert mismatch(entry, outcome) is None, mismatch(entry, outcome)
    for entry, outcome in zip(prompt_pool, long, strict=False):
        assert (outcome.status, len(outcome.token_ids)) == (
            "finished",
            entry.max_new_tokens + SIGTERM_EXTRA_TOKENS,
        )
        assert outcome.token_ids[: len(entry.expected)] == entry.expected
    report(
        "sigterm",
        in_flight_at_sigterm=len(outcomes),
        in_flight_finished=sum(1 for outcome in outcomes if outcome.status == "finished"),
        still_running_when_a_new_request_was_refused=unfinished_at_refusal,
        exit_code=0,
    )


def _sigterm_under_load(
    server: ServerProcess, client: Client, pool: list[PoolEntry]
) -> tuple[list[Outcome], CbserveError | None, int]:
    """Starts the pool's requests and a few longer ones, sends SIGTERM once all are queued, then tries
    a new request while they drain."""
    requests = [(entry, entry.max_new_tokens) for entry in pool]
    requests += [
        (entry, entry.max_new_tokens + SIGTERM_EXTRA_TOKENS) for entry in pool[:SIGTERM_LONG_STREAMS]
    ]
    streams = [
        client.stream(entry.prompt, max_new_tokens=max_new_tokens, ignore_eos=True, timeout=REQUEST_TIMEOUT_S)
        for entry, max_new_tokens in requests
    ]
    outcomes = [Outcome(stream.request_id) for stream in streams]
    for stream, outcome in zip(streams, outcomes, strict=True):
        outcome.add(next(stream))  # queued on the server
    with ThreadPoolExecutor(len(streams), thread_name_prefix="in-flight") as readers:
        finishing = [readers.submit(read_to_end, *pair) for pair in zip(streams, outcomes, strict=True)]
        server.terminate()
        wait_until(lambda: probe_health(server.target) == NOT_SERVING, what="NOT_SERVING after SIGTERM")
        refusal = None
        try:
            client.generate(pool[0].prompt, max_new_tokens=4, timeout=10)
        except CbserveError as exc:
            refusal = exc
        unfinished = sum(1 for future in finishing if not future.done())
        finished = [future.result() for future in finishing]
    return finished, refusal, unfinished
