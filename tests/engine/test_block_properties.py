"""Property tests: random workloads over a small pool keep the block accounting and the KV content sound.

Operations: add a request (prompts from a tiny vocabulary, so prefixes are shared), step the scheduler
with random sampled tokens, step it one ahead (async batching: the next step is scheduled and launched
before the previous one's tokens land), cancel or finish a random live request, add a burst of requests
that fill the pool (preemption by pressure), fail a step (as EngineCore does), reset the prefix cache.
Invariants are checked after every operation.

A fake model runner stands in for attention: each step it writes, into the slot the block table maps
each scheduled position to, the prefix that position's KV depends on, then checks that every position
the request attends to holds its own prefix. Prefix sharing, eviction, preemption and cancellation must
never let a request read KV computed for another prefix, or stale KV.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.kv.block_pool import NULL_BLOCK_ID
from engine.kv.cache_manager import KVCacheManager, blocks_for_tokens
from engine.loop.admission import size_rejection
from engine.request import FinishReason, Request, RequestStatus
from engine.sampling.params import SamplingParams
from engine.scheduling.scheduler import Scheduler, SchedulerOutput

EOS = 3
# Stands, in the fake KV, for a token the step in flight has not returned yet.
PENDING = -1
# Prompts are a prefix of one of a few base sequences plus a short random tail, so that full pages are
# often shared between requests.
BASES = ([1] * 48, [1, 2] * 24, [2, 1, 1] * 16)


@dataclass
class PendingStep:
    """A step launched ahead: its tokens land once the next step has been launched."""

    output: SchedulerOutput
    sampled: list[int | None]


@dataclass
class World:
    scheduler: Scheduler
    page_size: int
    # Fake KV cache: block id -> the prefix each slot's KV was computed for (None: never written).
    kv: dict[int, list[tuple[int, ...] | None]]
    live: dict[str, Request] = field(default_factory=dict)
    all_requests: list[Request] = field(default_factory=list)
    next_id: int = 0
    in_flight: PendingStep | None = None

    @property
    def manager(self) -> KVCacheManager:
        return self.scheduler.kv_cache_manager


configs = st.fixed_dictionaries(
    {
        # Small pools half of the time: that is where preemption happens.
        "num_blocks": st.one_of(st.integers(6, 14), st.integers(6, 40)),
        "page_size": st.integers(4, 8),
        "max_batch_tokens": st.integers(1, 48),
        "max_requests_per_batch": st.integers(1, 6),
        "safety_margin": st.sampled_from([0.0, 0.0, 0.0, 0.1, 0.3]),
        "policy": st.sampled_from(["fifo", "prefill_first"]),
        "enable_prefix_caching": st.sampled_from([True, True, True, False]),
    }
)

prompts = st.builds(
    lambda base, shared, tail: (BASES[base][:shared] + tail) or [1],
    st.integers(0, len(BASES) - 1),
    st.integers(0, 40),
    st.lists(st.sampled_from([1, 2]), max_size=6),
)

sampled_tokens = st.lists(st.sampled_from([1, 2, 1, 2, 1, 2, EOS]), min_size=1, max_size=6)

OPERATION_ARGUMENTS = {
    "add": st.tuples(prompts, st.integers(1, 16)),
    "step": st.tuples(sampled_tokens),
    "step_ahead": st.tuples(sampled_tokens),
    "cancel": st.tuples(st.integers(0, 1_000)),
    "finish": st.tuples(st.integers(0, 1_000)),
    "pressure": st.tuples(st.integers(2, 4), st.integers(0, len(BASES) - 1)),
    "fail_step": st.tuples(),
    "reset_prefix_cache": st.tuples(),
}
# Adds and steps dominate, so that the pool fills up and requests share prefixes and get preempted.
OPERATION_WEIGHTS = {
    "add": 6,
    "step": 6,
    "step_ahead": 6,
    "pressure": 2,
    "cancel": 1,
    "finish": 1,
    "fail_step": 1,
    "reset_prefix_cache": 1,
}
operations = st.sampled_from(
    [kind for kind, weight in OPERATION_WEIGHTS.items() for _ in range(weight)]
).flatmap(lambda kind: OPERATION_ARGUMENTS[kind].map(lambda arguments: (kind, *arguments)))


def make_world(config: dict) -> World:
    manager = KVCacheManager(config["num_blocks"], config["page_size"], config["enable_prefix_caching"])
    scheduler = Scheduler(
        manager,
        config["max_batch_tokens"],
        config["max_requests_per_batch"],
        config["safety_margin"],
        config["policy"],
    )
    kv = {block_id: [None] * config["page_size"] for block_id in range(config["num_blocks"])}
    return World(scheduler, config["page_size"], kv)


# --- invariants -----------------------------------------------------------------------------------


def check_invariants(world: World) -> None:
    manager, pool = world.manager, world.manager.block_pool
    holders = Counter(block.block_id for table in manager.block_tables.values() for block in table)
    for block in pool.blocks:
        assert block.ref_count == holders[block.block_id], (
            f"block {block.block_id}: ref_count {block.ref_count}, held by {holders[block.block_id]} tables"
        )
    queue = pool.free_queue.block_ids()
    assert len(queue) == len(set(queue)), f"a block appears twice in the free queue {queue}"
    assert NULL_BLOCK_ID not in queue, f"null block in the free queue {queue}"
    assert holders[NULL_BLOCK_ID] == 0, "null block in a block table"
    free_by_refcount = {block.block_id for block in pool.blocks[1:] if block.ref_count == 0}
    assert set(queue) == free_by_refcount, (
        f"free queue {sorted(queue)} != ref_count 0 {sorted(free_by_refcount)}"
    )
    assert pool.num_free_blocks == len(queue)
    num_used = sum(1 for block in pool.blocks[1:] if block.ref_count > 0)
    assert num_used + len(queue) == pool.num_usable_blocks
    assert pool.num_used_blocks == num_used

    cached = pool._cached_blocks
    for block_hash, block in cached.items():
        assert block.block_hash == block_hash, f"hash {block_hash} maps to {block!r}"
    registered = {block.block_id for block in pool.blocks if block.block_hash is not None}
    assert registered == {block.block_id for block in cached.values()}

    running_ids = {request.request_id for request in world.scheduler.running}
    assert len(running_ids) == len(world.scheduler.running), "a request runs twice"
    assert set(manager.block_tables) == running_ids, (
        f"block tables {sorted(manager.block_tables)} != running {sorted(running_ids)}"
    )
    for request in world.scheduler.running:
        assert not request.is_finished
        table = manager.block_tables[request.request_id]
        assert len(table) >= blocks_for_tokens(request.num_computed_tokens, world.page_size)
        assert len({block.block_id for block in table}) == len(table), f"a block twice in {request!r}'s table"
        for index, block in enumerate(table):
            if block.block_hash is None:
                continue
            page = tuple(request.all_token_ids[index * world.page_size : (index + 1) * world.page_size])
            assert block.token_ids == page, f"{request!r} page {index} holds {block!r} of other tokens"
            assert block.block_hash == request.block_hashes[index]
    for request in world.all_requests:
        if request.is_finished or request.status == RequestStatus.PENDING:
            assert request.request_id not in manager.block_tables, f"{request!r} holds blocks"

    # Only the step in flight leaves placeholders, one per request it samples for.
    sampling_in_flight = set()
    if world.in_flight is not None:
        sampling_in_flight = {
            item.request.request_id for item in world.in_flight.output.scheduled if item.samples_token
        }
    for request in world.all_requests:
        if request.is_finished:
            continue
        expected = int(request.request_id in sampling_in_flight)
        assert request.num_output_placeholders == expected, f"{request!r}: {request.num_output_placeholders}"


# --- operations -----------------------------------------------------------------------------------


def add(world: World, prompt: list[int], max_new_tokens: int) -> None:
    request = Request(
        f"r{world.next_id}",
        prompt,
        SamplingParams(max_new_tokens=max_new_tokens, eos_token_ids=frozenset({EOS})),
    )
    world.next_id += 1
    rejection = size_rejection(request, world.scheduler)
    if rejection is not None:
        assert request.request_id in rejection.message
        return
    world.scheduler.add_request(request)
    world.live[request.request_id] = request
    world.all_requests.append(request)


def add_pressure(world: World, num_requests: int, base: int) -> None:
    """Adds requests that together fill the pool with their prompts and must each grow by more than a
    page, so that running requests soon have to preempt one another."""
    usable = world.manager.block_pool.num_usable_blocks
    prompt_len = max(1, (usable // num_requests) * world.page_size - 1)
    for index in range(num_requests):
        # A distinct first token per request: they share no block, so they really fill the pool.
        body = (BASES[base] * (prompt_len // len(BASES[base]) + 1))[: prompt_len - 1]
        prompt = [10 + index, *body]
        add(world, prompt, world.page_size + 2)


def check_schedule(world: World, output: SchedulerOutput) -> None:
    scheduler = world.scheduler
    assert output.failed == [], f"admissible requests failed: {[r.error for r in output.failed]}"
    assert output.num_batched_tokens <= scheduler.max_batch_tokens
    assert len(output.scheduled) <= scheduler.max_requests_per_batch
    scheduled_ids = [item.request.request_id for item in output.scheduled]
    assert len(set(scheduled_ids)) == len(scheduled_ids), f"a request scheduled twice: {scheduled_ids}"
    for item in output.scheduled:
        assert item.num_new_tokens >= 1
        assert item.request in scheduler.running
        assert item.request not in output.preempted
        assert item.num_computed_tokens + item.num_new_tokens <= item.request.num_tokens


def run_fake_attention(world: World, output: SchedulerOutput) -> list[tuple[int, int, Request]]:
    """Writes the step's KV into its slots, then checks every attended slot holds the right KV, reading
    the block tables the step hands the runner (`ScheduledRequest.block_ids`), as the runner does.

    The KV of position p depends on every token up to p, so a slot holds that whole prefix: a block
    computed after another prefix reads as wrong even when its own tokens match. A position whose token
    the step in flight samples holds PENDING in its place; the slots so written are returned, for
    `resolve` to fill in once the token lands.
    """
    page_size = world.page_size
    placeholders = []
    for item in output.scheduled:
        request = item.request
        tokens = request.all_token_ids
        table = item.block_ids[0]
        assert table == [block.block_id for block in world.manager.block_tables[request.request_id]]
        end = item.num_computed_tokens + item.num_new_tokens
        assert len(table) >= blocks_for_tokens(end, page_size)
        for position in range(item.num_computed_tokens, end):
            block_id = table[position // page_size]
            assert block_id != NULL_BLOCK_ID
            if position < len(tokens):
                world.kv[block_id][position % page_size] = tuple(tokens[: position + 1])
                continue
            assert position == len(tokens) == end - 1, f"{request!r} scheduled past its placeholder"
            pending = world.in_flight
            assert pending is not None and any(
                other.request is request and other.samples_token for other in pending.output.scheduled
            ), f"{request!r} scheduled for a token no step in flight samples"
            world.kv[block_id][position % page_size] = (*tokens, PENDING)
            placeholders.append((block_id, position % page_size, request))
    for item in output.scheduled:
        tokens = item.request.all_token_ids
        table = item.block_ids[0]
        end = item.num_computed_tokens + item.num_new_tokens
        for position in range(end):
            held = world.kv[table[position // page_size]][position % page_size]
            expected = tuple(tokens[: position + 1]) if position < len(tokens) else (*tokens, PENDING)
            assert held == expected, (
                f"{item.request!r} position {position} attends to KV of {held}, its prefix is {expected}"
            )
    return placeholders


def sampled_tokens_of(output: SchedulerOutput, tokens: list[int]) -> list[int | None]:
    return [
        tokens[i % len(tokens)] if item.samples_token else None for i, item in enumerate(output.scheduled)
    ]


def resolve(world: World, pending: PendingStep, placeholders: list[tuple[int, int, Request]] = ()) -> None:
    """The tokens of `pending` land; the device computed `placeholders` from them."""
    world.scheduler.update_from_output(pending.output, pending.sampled)
    for block_id, slot, request in placeholders:
        held = world.kv[block_id][slot]
        assert held is not None
        world.kv[block_id][slot] = (*held[:-1], request.all_token_ids[len(held) - 1])
    for item in pending.output.scheduled:
        if item.request.is_finished:
            world.live.pop(item.request.request_id, None)


def flush(world: World) -> None:
    if world.in_flight is not None:
        pending, world.in_flight = world.in_flight, None
        resolve(world, pending)


def step(world: World, tokens: list[int]) -> None:
    flush(world)
    output = world.scheduler.schedule()
    check_schedule(world, output)
    run_fake_attention(world, output)
    resolve(world, PendingStep(output, sampled_tokens_of(output, tokens)))


def step_ahead(world: World, tokens: list[int]) -> None:
    """EngineCore.step with async batching: launch the next step, then let the one in flight land."""
    output = world.scheduler.schedule()
    check_schedule(world, output)
    placeholders = run_fake_attention(world, output)
    previous = world.in_flight
    world.in_flight = PendingStep(output, sampled_tokens_of(output, tokens)) if output.scheduled else None
    if previous is not None:
        resolve(world, previous, placeholders)


def fail_step(world: World) -> None:
    """A step whose model call raised, handled as EngineCore.step does: its requests fail and the
    prefix cache is reset, since blocks registered for the step were never written."""
    scheduler = world.scheduler
    output = scheduler.schedule()
    check_schedule(world, output)
    for item in output.scheduled:
        scheduler.finish_request(item.request, RequestStatus.FAILED, FinishReason.ERROR, "step failed")
        world.live.pop(item.request.request_id, None)
    scheduler.remove_finished_running()
    world.manager.reset_prefix_cache()
    flush(world)  # a step in flight still lands, with rows of the failed requests dropped


def end_request(world: World, index: int, status: RequestStatus, reason: str) -> None:
    if not world.live:
        return
    request = list(world.live.values())[index % len(world.live)]
    world.scheduler.finish_request(request, status, reason)
    world.scheduler.finish_request(request, status, reason)  # idempotent
    world.scheduler.remove_finished_running()
    del world.live[request.request_id]


def apply(world: World, operation: tuple) -> None:
    kind = operation[0]
    if kind == "add":
        add(world, operation[1], operation[2])
    elif kind == "pressure":
        add_pressure(world, operation[1], operation[2])
    elif kind == "step":
        step(world, operation[1])
    elif kind == "step_ahead":
        step_ahead(world, operation[1])
    elif kind == "cancel":
        end_request(world, operation[1], RequestStatus.CANCELLED, FinishReason.CANCELLED)
    elif kind == "finish":
        end_request(world, operation[1], RequestStatus.FINISHED, FinishReason.LENGTH)
    elif kind == "fail_step":
        fail_step(world)
    elif kind == "reset_prefix_cache":
        world.manager.reset_prefix_cache()
    else:
        raise AssertionError(kind)


def assert_all_blocks_free(world: World) -> None:
    pool = world.manager.block_pool
    assert world.manager.block_tables == {}
    assert sorted(pool.free_queue.block_ids()) == list(range(1, pool.num_blocks)), (
        f"free queue {pool.free_queue.block_ids()} after every request ended"
    )
    assert all(block.ref_count == 0 for block in pool.blocks)


# --- properties -----------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs, ops=st.lists(operations, min_size=15, max_size=50))
def test_block_accounting_survives_any_sequence_of_operations(config: dict, ops: list[tuple]) -> None:
    world = make_world(config)
    check_invariants(world)
    for operation in ops:
        apply(world, operation)
        check_invariants(world)
    flush(world)
    check_invariants(world)
    for request in list(world.live.values()):
        world.scheduler.finish_request(request, RequestStatus.CANCELLED, FinishReason.CANCELLED)
    world.scheduler.remove_finished_running()
    world.live.clear()
    check_invariants(world)
    assert not world.scheduler.has_unfinished_requests()
    assert_all_blocks_free(world)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    config=configs,
    requests=st.lists(st.tuples(prompts, st.integers(1, 8)), min_size=1, max_size=8),
    tokens=sampled_tokens,
)
@pytest.mark.parametrize("ahead", [False, True], ids=["sync", "ahead"])
def test_every_admissible_request_finishes_when_steps_keep_running(
    ahead: bool, config: dict, requests: list[tuple[list[int], int]], tokens: list[int]
) -> None:
    """No livelock: preemption and the safety margin may delay a request, never starve it forever, with
    steps resolved at once or launched one ahead."""
    world = make_world(config)
    for prompt, max_new_tokens in requests:
        add(world, prompt, max_new_tokens)
    max_steps = 4 * sum(len(r.all_token_ids) + r.sampling.max_new_tokens for r in world.all_requests) + 20
    steps = 0
    while world.scheduler.has_unfinished_requests() or world.in_flight is not None:
        assert steps < max_steps, (
            f"still unfinished after {steps} steps: running={world.scheduler.running} "
            f"waiting={list(world.scheduler.waiting)}"
        )
        (step_ahead if ahead else step)(world, tokens)
        check_invariants(world)
        steps += 1
    assert all(request.status == RequestStatus.FINISHED for request in world.all_requests)
    assert_all_blocks_free(world)
