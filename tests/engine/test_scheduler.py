"""Spec of the `Scheduler`: token budget, chunked prefill, policies, admission, preemption, finishing.

No model: each step's sampled tokens are fed to `update_from_output` by hand, one token for every item
that `samples_token`, None for the others (as the model runner does).
"""

from __future__ import annotations

import pytest

from engine.kv.cache_manager import KVCacheManager
from engine.request import FinishReason, Request, RequestStatus
from engine.sampling.params import SamplingParams
from engine.scheduling.scheduler import Scheduler, SchedulerOutput

EOS = 99
TOKEN = 7


def make_scheduler(
    num_blocks: int = 32,
    page_size: int = 4,
    max_batch_tokens: int = 64,
    max_requests_per_batch: int = 8,
    safety_margin: float = 0.0,
    policy: str = "fifo",
    enable_prefix_caching: bool = True,
    max_model_len: int | None = None,
) -> Scheduler:
    manager = KVCacheManager(num_blocks, page_size, enable_prefix_caching)
    return Scheduler(
        manager, max_batch_tokens, max_requests_per_batch, safety_margin, policy, max_model_len=max_model_len
    )


def make_request(request_id: str, prompt: list[int], max_new_tokens: int = 8) -> Request:
    return Request(
        request_id, prompt, SamplingParams(max_new_tokens=max_new_tokens, eos_token_ids=frozenset({EOS}))
    )


def sampled(output: SchedulerOutput, token: int = TOKEN) -> list[int | None]:
    return [token if item.samples_token else None for item in output.scheduled]


def step(scheduler: Scheduler, token: int = TOKEN) -> SchedulerOutput:
    """One engine step: schedule, then feed back one token per item that `samples_token`."""
    output = scheduler.schedule()
    scheduler.update_from_output(output, sampled(output, token))
    return output


def plan(output: SchedulerOutput) -> list[tuple[str, int]]:
    return [(item.request.request_id, item.num_new_tokens) for item in output.scheduled]


def prompt(start: int, length: int) -> list[int]:
    return list(range(start, start + length))


# --- construction ---------------------------------------------------------------------------------


def test_unknown_policy_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"scheduler_type must be one of .*'lifo'"):
        make_scheduler(policy="lifo")


# --- token budget and chunked prefill --------------------------------------------------------------


def test_a_prompt_within_the_budget_is_prefilled_in_one_step_and_samples() -> None:
    scheduler = make_scheduler(max_batch_tokens=64)
    request = make_request("r", prompt(100, 10))
    scheduler.add_request(request)
    output = step(scheduler)
    assert plan(output) == [("r", 10)]
    assert [item.samples_token for item in output.scheduled] == [True]
    assert request.generated_tokens == [TOKEN]
    assert request.num_computed_tokens == 10
    assert request.status == RequestStatus.DECODING


def test_token_budget_splits_a_long_prompt_into_chunks() -> None:
    scheduler = make_scheduler(page_size=4, max_batch_tokens=8)
    request = make_request("r", prompt(100, 20))
    scheduler.add_request(request)
    chunks = []
    for _ in range(3):
        output = step(scheduler)
        item = output.scheduled[0]
        chunks.append((item.num_computed_tokens, item.num_new_tokens))
    assert chunks == [(0, 8), (8, 8), (16, 4)]
    assert request.num_computed_tokens == 20


def test_a_chunked_request_samples_only_on_its_last_chunk() -> None:
    scheduler = make_scheduler(page_size=4, max_batch_tokens=8)
    request = make_request("r", prompt(100, 20))
    scheduler.add_request(request)
    samples = []
    for _ in range(3):
        [item] = step(scheduler).scheduled
        samples.append(item.samples_token)
        if not samples[-1]:
            assert request.generated_tokens == [], "no token may be sampled mid-prefill"
            assert request.status == RequestStatus.PREFILLING
    assert samples == [False, False, True]
    assert request.generated_tokens == [TOKEN]


def test_chunked_prefill_allocates_blocks_chunk_by_chunk() -> None:
    scheduler = make_scheduler(page_size=4, max_batch_tokens=6)
    request = make_request("r", prompt(100, 14))
    scheduler.add_request(request)
    table_sizes = []
    for _ in range(3):
        step(scheduler)
        table_sizes.append(len(scheduler.kv_cache_manager.block_ids("r")))
    assert table_sizes == [2, 3, 4], "6, 12, then 14 tokens in pages of 4"


def test_after_prefill_a_request_decodes_one_token_per_step() -> None:
    scheduler = make_scheduler()
    request = make_request("r", prompt(100, 5))
    scheduler.add_request(request)
    step(scheduler)
    for expected_tokens in (6, 7, 8):
        output = step(scheduler)
        assert plan(output) == [("r", 1)]
        assert output.scheduled[0].num_computed_tokens == expected_tokens - 1
        assert request.num_tokens == expected_tokens + 1


def test_budget_is_shared_across_requests_in_queue_order() -> None:
    scheduler = make_scheduler(max_batch_tokens=10)
    for index, request_id in enumerate("abc"):
        scheduler.add_request(make_request(request_id, prompt(100 * (index + 1), 4)))
    output = scheduler.schedule()
    assert plan(output) == [("a", 4), ("b", 4), ("c", 2)]
    assert [item.samples_token for item in output.scheduled] == [True, True, False]
    assert output.num_batched_tokens == 10


# --- policies -------------------------------------------------------------------------------------


def _one_decoding_one_waiting(policy: str, max_batch_tokens: int) -> Scheduler:
    scheduler = make_scheduler(policy=policy, max_batch_tokens=max_batch_tokens)
    scheduler.add_request(make_request("decoding", prompt(100, 4)))
    step(scheduler)
    scheduler.add_request(make_request("waiting", prompt(200, 10)))
    return scheduler


def test_fifo_schedules_running_requests_before_waiting_ones() -> None:
    scheduler = _one_decoding_one_waiting("fifo", max_batch_tokens=64)
    assert plan(scheduler.schedule()) == [("decoding", 1), ("waiting", 10)]


def test_fifo_gives_decodes_their_token_before_a_prefill_takes_the_rest_of_the_budget() -> None:
    scheduler = _one_decoding_one_waiting("fifo", max_batch_tokens=5)
    assert plan(scheduler.schedule()) == [("decoding", 1), ("waiting", 4)]


def test_prefill_first_admits_waiting_requests_before_running_ones() -> None:
    scheduler = _one_decoding_one_waiting("prefill_first", max_batch_tokens=64)
    assert plan(scheduler.schedule()) == [("waiting", 10), ("decoding", 1)]


def test_prefill_first_lets_a_prefill_take_the_whole_budget() -> None:
    scheduler = _one_decoding_one_waiting("prefill_first", max_batch_tokens=5)
    assert plan(scheduler.schedule()) == [("waiting", 5)]


def test_max_requests_per_batch_caps_the_requests_in_a_step() -> None:
    scheduler = make_scheduler(max_requests_per_batch=2)
    for index in range(3):
        scheduler.add_request(make_request(f"r{index}", prompt(100 * (index + 1), 4)))
    assert plan(step(scheduler)) == [("r0", 4), ("r1", 4)]
    assert plan(step(scheduler)) == [("r0", 1), ("r1", 1)], "the third may not join two running requests"
    assert scheduler.num_waiting == 1


def test_max_requests_per_batch_caps_a_prefill_first_step() -> None:
    scheduler = make_scheduler(max_requests_per_batch=2, policy="prefill_first")
    for index in range(3):
        scheduler.add_request(make_request(f"r{index}", prompt(100 * (index + 1), 4)))
    assert plan(scheduler.schedule()) == [("r0", 4), ("r1", 4)]


def test_a_waiting_request_joins_when_a_running_one_finishes() -> None:
    scheduler = make_scheduler(max_requests_per_batch=1)
    scheduler.add_request(make_request("a", prompt(100, 4), max_new_tokens=2))
    scheduler.add_request(make_request("b", prompt(200, 4)))
    assert plan(step(scheduler)) == [("a", 4)]
    assert plan(step(scheduler)) == [("a", 1)]
    assert plan(step(scheduler)) == [("b", 4)]


# --- safety margin --------------------------------------------------------------------------------


def test_safety_margin_blocks_admission_while_running_requests_decode() -> None:
    # 10 usable blocks of 4; "a" takes 6, leaving 40% free under a 50% margin.
    scheduler = make_scheduler(num_blocks=11, page_size=4, safety_margin=0.5)
    scheduler.add_request(make_request("a", prompt(100, 24), max_new_tokens=2))
    scheduler.add_request(make_request("b", prompt(200, 4)))
    assert plan(step(scheduler)) == [("a", 24)]
    assert scheduler.kv_cache_manager.free_fraction == pytest.approx(0.4)
    assert plan(step(scheduler)) == [("a", 1)], "b must wait while the pool is under the margin"
    assert scheduler.num_waiting == 1
    assert plan(step(scheduler)) == [("b", 4)], "a finished: b is admitted"


def test_safety_margin_does_not_block_admission_into_an_idle_engine() -> None:
    scheduler = make_scheduler(num_blocks=11, page_size=4, safety_margin=0.99)
    scheduler.add_request(make_request("a", prompt(100, 24)))
    assert plan(scheduler.schedule()) == [("a", 24)]


def test_safety_margin_is_checked_before_each_admission_in_a_step() -> None:
    scheduler = make_scheduler(num_blocks=11, page_size=4, safety_margin=0.5)
    scheduler.add_request(make_request("a", prompt(100, 24)))
    scheduler.add_request(make_request("b", prompt(200, 4)))
    assert plan(scheduler.schedule()) == [("a", 24)], "a, admitted this step, already counts as running"


# --- preemption -----------------------------------------------------------------------------------


def _three_requests_filling_the_pool(enable_prefix_caching: bool = False) -> tuple[Scheduler, list[Request]]:
    # 6 usable blocks of 4. a and c (8-token prompts) need a new block for their first decode;
    # b (7 tokens) decodes into the free slot of its second block.
    scheduler = make_scheduler(num_blocks=7, page_size=4, enable_prefix_caching=enable_prefix_caching)
    requests = [
        make_request("a", prompt(100, 8), max_new_tokens=2),
        make_request("b", prompt(200, 7), max_new_tokens=6),
        make_request("c", prompt(300, 8), max_new_tokens=4),
    ]
    for request in requests:
        scheduler.add_request(request)
    assert plan(step(scheduler)) == [("a", 8), ("b", 7), ("c", 8)]
    assert scheduler.kv_cache_manager.block_pool.num_free_blocks == 0
    return scheduler, requests


def test_growth_into_a_full_pool_preempts_the_most_recently_admitted_request() -> None:
    scheduler, _ = _three_requests_filling_the_pool()
    output = step(scheduler)
    assert [request.request_id for request in output.preempted] == ["c"]
    assert plan(output) == [("a", 1), ("b", 1)]


def test_a_preempted_request_goes_back_to_the_queue_head_with_its_blocks_freed() -> None:
    scheduler, (_, _, c) = _three_requests_filling_the_pool()
    manager = scheduler.kv_cache_manager
    assert (manager.block_ids("a"), manager.block_ids("c")) == ([1, 2], [5, 6])
    late = make_request("late", prompt(400, 4))
    scheduler.add_request(late)
    scheduler.schedule()
    assert c.status == RequestStatus.PENDING
    assert c.num_computed_tokens == 0
    assert c.num_preemptions == 1
    assert "c" not in manager.block_tables
    assert manager.block_ids("a") == [1, 2, 5], "c's freed blocks are reused first"
    assert manager.block_pool.free_queue.block_ids() == [6]
    assert c not in scheduler.running
    assert list(scheduler.waiting) == [c, late], "the preempted request goes ahead of later arrivals"
    assert scheduler.counters.preemptions == 1
    assert c.generated_tokens == [TOKEN], "preemption by recompute keeps generated tokens"


def test_fifo_admits_nothing_in_a_step_that_preempted() -> None:
    scheduler, _ = _three_requests_filling_the_pool()
    scheduler.add_request(make_request("late", prompt(400, 1)))
    output = step(scheduler)
    assert [item.request.request_id for item in output.scheduled] == ["a", "b"]


def test_a_preempted_request_recomputes_prompt_and_generated_tokens() -> None:
    scheduler, (a, _, c) = _three_requests_filling_the_pool(enable_prefix_caching=False)
    step(scheduler)  # c preempted; a reaches max_new_tokens=2 and frees its blocks
    assert a.finish_reason == FinishReason.LENGTH
    output = step(scheduler)
    assert [item.request.request_id for item in output.scheduled] == ["b", "c"]
    resumed = output.scheduled[1]
    assert (resumed.num_computed_tokens, resumed.num_new_tokens) == (0, 9), "8 prompt + 1 generated"
    assert resumed.samples_token, "catching up on prompt + generated tokens samples the next token"
    assert c.generated_tokens == [TOKEN, TOKEN]
    assert c.status == RequestStatus.DECODING


def _recomputed_tokens_after_c_catches_up(recompute_budget: int) -> int:
    scheduler, (_, _, c) = _three_requests_filling_the_pool(enable_prefix_caching=False)
    step(scheduler)  # c preempted after computing its 8 prompt tokens
    assert c.num_preemptions == 1
    scheduler.max_batch_tokens = recompute_budget
    for _ in range(10):
        step(scheduler)
        if c.num_computed_tokens >= 9:
            break
    assert c.num_computed_tokens >= 9, f"c did not catch up: {c!r}"
    assert (c.num_preemptions, scheduler.counters.preemptions) == (1, 1)
    return scheduler.counters.recomputed_tokens


def test_recomputed_tokens_counts_a_chunked_recompute_in_full() -> None:
    whole = _recomputed_tokens_after_c_catches_up(recompute_budget=64)
    chunked = _recomputed_tokens_after_c_catches_up(recompute_budget=4)
    assert whole >= 8, f"c had computed 8 prompt tokens before its preemption, counter {whole}"
    assert chunked == whole, (
        f"the same recompute counted {chunked} recomputed tokens in chunks of <= 3, {whole} in one chunk"
    )


def test_a_preempted_request_resumes_from_its_surviving_cached_prefix() -> None:
    # 4 usable blocks of 4: a holds [1, 2], b holds [3, 4]; a's first decode preempts b (freed as
    # [4, 3]) and takes block 4, evicting b's second page. b keeps its first page (block 3).
    scheduler = make_scheduler(num_blocks=5, page_size=4, enable_prefix_caching=True)
    a = make_request("a", prompt(100, 8), max_new_tokens=2)
    b = make_request("b", prompt(200, 8), max_new_tokens=4)
    scheduler.add_request(a)
    scheduler.add_request(b)
    step(scheduler)
    output = step(scheduler)
    assert output.preempted == [b]
    assert a.is_finished
    output = step(scheduler)
    [resumed] = output.scheduled
    assert resumed.request is b
    assert (resumed.num_computed_tokens, resumed.num_new_tokens) == (4, 5)
    assert scheduler.kv_cache_manager.block_ids("b")[0] == 3
    assert b.num_cached_tokens == 0, "num_cached_tokens counts the first admission only"


def test_a_request_that_cannot_grow_and_has_no_victim_preempts_itself() -> None:
    # prefill_first: b is admitted into the last 2 blocks first; a request admitted this step is never
    # a victim, so a, needing a third block, has to give way itself.
    scheduler = make_scheduler(num_blocks=5, page_size=4, policy="prefill_first")
    a = make_request("a", prompt(100, 8))
    scheduler.add_request(a)
    step(scheduler)
    scheduler.add_request(make_request("b", prompt(200, 8)))
    output = scheduler.schedule()
    assert output.preempted == [a]
    assert plan(output) == [("b", 8)]
    assert a.status == RequestStatus.PENDING
    assert list(scheduler.waiting) == [a]


# --- finishing ------------------------------------------------------------------------------------


def test_eos_finishes_a_request_and_frees_its_blocks() -> None:
    scheduler = make_scheduler(num_blocks=8)
    request = make_request("r", prompt(100, 6), max_new_tokens=10)
    scheduler.add_request(request)
    step(scheduler)
    step(scheduler, token=EOS)
    assert request.status == RequestStatus.FINISHED
    assert request.finish_reason == FinishReason.EOS
    assert request.generated_tokens == [TOKEN, EOS]
    assert "r" not in scheduler.kv_cache_manager.block_tables
    assert scheduler.kv_cache_manager.block_pool.num_free_blocks == 7
    assert scheduler.running == []
    assert not scheduler.has_unfinished_requests()


def test_max_new_tokens_finishes_a_request_and_frees_its_blocks() -> None:
    scheduler = make_scheduler(num_blocks=8)
    request = make_request("r", prompt(100, 6), max_new_tokens=3)
    scheduler.add_request(request)
    for _ in range(3):
        step(scheduler)
    assert request.status == RequestStatus.FINISHED
    assert request.finish_reason == FinishReason.LENGTH
    assert request.generated_tokens == [TOKEN] * 3
    assert scheduler.kv_cache_manager.block_pool.num_free_blocks == 7
    assert scheduler.schedule().scheduled == []


def test_update_from_output_returns_the_items_that_gained_a_token() -> None:
    scheduler = make_scheduler(max_batch_tokens=6)
    scheduler.add_request(make_request("a", prompt(100, 3)))
    scheduler.add_request(make_request("b", prompt(200, 5)))
    output = scheduler.schedule()
    assert plan(output) == [("a", 3), ("b", 3)]
    advanced = scheduler.update_from_output(output, sampled(output))
    assert [item.request.request_id for item in advanced] == ["a"]


# --- requests that can never fit ------------------------------------------------------------------


def test_a_queued_request_that_can_never_fit_fails_when_scheduled() -> None:
    scheduler = make_scheduler(num_blocks=3, page_size=4, max_batch_tokens=64)
    request = make_request("huge", prompt(0, 12))
    scheduler.add_request(request)  # admission is the caller's check (engine.loop.admission); this copes
    output = scheduler.schedule()
    assert output.failed == [request]
    assert output.scheduled == []
    assert request.status == RequestStatus.FAILED
    assert request.error is not None and "needs 3 KV blocks for its 12 tokens" in request.error
    assert "only 2 of 2 can ever be free" in request.error
    assert not scheduler.has_unfinished_requests()


# --- cancellation ---------------------------------------------------------------------------------


def test_cancelling_a_running_request_frees_its_blocks() -> None:
    scheduler = make_scheduler(num_blocks=8)
    request = make_request("r", prompt(100, 6))
    scheduler.add_request(request)
    step(scheduler)
    scheduler.finish_request(request, RequestStatus.CANCELLED, FinishReason.CANCELLED)
    scheduler.remove_finished_running()
    assert request.status == RequestStatus.CANCELLED
    assert "r" not in scheduler.kv_cache_manager.block_tables
    assert scheduler.kv_cache_manager.block_pool.num_free_blocks == 7
    assert scheduler.running == []
    assert scheduler.schedule().scheduled == []


def test_cancelling_twice_is_a_no_op() -> None:
    scheduler = make_scheduler(num_blocks=8)
    request = make_request("r", prompt(100, 6))
    scheduler.add_request(request)
    step(scheduler)
    scheduler.finish_request(request, RequestStatus.CANCELLED, FinishReason.CANCELLED)
    scheduler.finish_request(request, RequestStatus.FAILED, FinishReason.ERROR, "late failure")
    assert (request.status, request.finish_reason, request.error) == (
        RequestStatus.CANCELLED,
        FinishReason.CANCELLED,
        None,
    )
    assert scheduler.kv_cache_manager.block_pool.num_free_blocks == 7


def test_a_cancelled_waiting_request_is_never_scheduled() -> None:
    scheduler = make_scheduler()
    request = make_request("r", prompt(100, 6))
    scheduler.add_request(request)
    scheduler.finish_request(request, RequestStatus.CANCELLED, FinishReason.CANCELLED)
    assert scheduler.num_waiting == 0
    assert not scheduler.has_unfinished_requests()
    assert scheduler.schedule().scheduled == []
    assert list(scheduler.waiting) == []


def test_a_request_cancelled_mid_step_gains_no_token() -> None:
    scheduler = make_scheduler()
    request = make_request("r", prompt(100, 6))
    scheduler.add_request(request)
    output = scheduler.schedule()
    scheduler.finish_request(request, RequestStatus.CANCELLED, FinishReason.CANCELLED)
    advanced = scheduler.update_from_output(output, sampled(output))
    assert advanced == []
    assert request.generated_tokens == []
    assert scheduler.running == []


# --- prefix cache through the scheduler ------------------------------------------------------------


def test_admission_records_prefix_hits_on_the_request_and_the_stats() -> None:
    scheduler = make_scheduler(page_size=4)
    shared = prompt(100, 8)
    scheduler.add_request(make_request("a", [*shared, 1, 2]))
    step(scheduler)
    second = make_request("b", [*shared, 3])
    scheduler.add_request(second)
    output = step(scheduler)
    item = {item.request.request_id: item for item in output.scheduled}["b"]
    assert (item.num_computed_tokens, item.num_new_tokens) == (8, 1)
    assert second.num_cached_tokens == 8
    stats = scheduler.kv_cache_manager.prefix_cache_stats
    assert (stats.queried_tokens, stats.hit_tokens) == (10 + 9, 8)
    assert scheduler.counters.admitted == 2


def test_requests_admitted_in_the_same_step_share_a_prefix() -> None:
    scheduler = make_scheduler(page_size=4)
    shared = prompt(100, 12)
    scheduler.add_request(make_request("a", [*shared, 1]))
    scheduler.add_request(make_request("b", [*shared, 2]))
    output = scheduler.schedule()
    assert [(item.num_computed_tokens, item.num_new_tokens) for item in output.scheduled] == [
        (0, 13),
        (12, 1),
    ]
    manager = scheduler.kv_cache_manager
    assert manager.block_ids("b")[:3] == manager.block_ids("a")[:3]


# --- scheduling one step ahead (async batching) ---------------------------------------------------


def _two_steps_ahead(
    prompt_length: int, max_new_tokens: int
) -> tuple[Scheduler, Request, SchedulerOutput, SchedulerOutput]:
    """One request scheduled twice in a row, as async batching does: the first step's token not back."""
    scheduler = make_scheduler(page_size=4)
    request = make_request("r", prompt(100, prompt_length), max_new_tokens=max_new_tokens)
    scheduler.add_request(request)
    first = scheduler.schedule()
    second = scheduler.schedule()
    return scheduler, request, first, second


def test_a_step_scheduled_ahead_gives_a_decoding_request_the_position_of_its_placeholder() -> None:
    scheduler, request, first, second = _two_steps_ahead(prompt_length=6, max_new_tokens=4)
    [item] = second.scheduled
    assert (item.num_computed_tokens, item.num_new_tokens, item.samples_token) == (6, 1, True)
    assert (request.num_computed_tokens, request.num_output_placeholders, request.num_tokens) == (7, 2, 8)
    assert scheduler.update_from_output(first, [11])[0].request is request
    assert (request.generated_tokens, request.num_output_placeholders) == ([11], 1)
    scheduler.update_from_output(second, [12])
    assert (request.generated_tokens, request.num_output_placeholders) == ([11, 12], 0)
    assert request.num_computed_tokens == 7


def test_a_request_whose_last_token_is_in_flight_is_not_scheduled_again() -> None:
    scheduler, request, first, second = _two_steps_ahead(prompt_length=7, max_new_tokens=2)
    assert plan(second) == [("r", 1)]
    assert plan(scheduler.schedule()) == [], "its second and last token is already being sampled"
    blocks_held = len(scheduler.kv_cache_manager.block_ids("r"))
    assert blocks_held == 2, "no slot allocated past the 8 positions whose KV is ever read"
    scheduler.update_from_output(first, [11])
    scheduler.update_from_output(second, [12])
    assert request.finish_reason == FinishReason.LENGTH and request.generated_tokens == [11, 12]


def test_the_step_run_ahead_of_an_eos_is_dropped() -> None:
    scheduler, request, first, second = _two_steps_ahead(prompt_length=6, max_new_tokens=8)
    assert scheduler.update_from_output(first, [EOS])[0].request is request
    assert request.finish_reason == FinishReason.EOS
    assert scheduler.update_from_output(second, [12]) == [], "a finished request gains no token"
    assert request.generated_tokens == [EOS]
    assert scheduler.kv_cache_manager.block_pool.num_used_blocks == 0


# ------------------------------------------------------------------ the "priority" policy


def make_prioritised(request_id: str, priority: int, length: int, start: int) -> Request:
    request = make_request(request_id, prompt(start, length))
    request.priority = priority
    return request


def test_priority_admits_waiting_requests_by_priority_then_arrival() -> None:
    scheduler = make_scheduler(policy="priority", max_requests_per_batch=1)
    arrivals = [("low", 5), ("high", -1), ("mid", 2), ("high-later", -1), ("mid-later", 2)]
    for index, (name, priority) in enumerate(arrivals):
        scheduler.add_request(make_prioritised(name, priority, 3, 100 * index))
    admitted = []
    while scheduler.has_unfinished_requests():
        output = step(scheduler, token=EOS)  # each request ends on its first token: one admission per step
        admitted += [item.request.request_id for item in output.scheduled]
    assert admitted == ["high", "high-later", "mid", "mid-later", "low"]


def test_priority_preempts_the_lowest_priority_running_request_first() -> None:
    # 7 usable blocks of 4 tokens; three prompts of 8, 7 and 8 tokens fill them, admitted by priority.
    scheduler = make_scheduler(num_blocks=7, page_size=4, policy="priority")
    for index, (name, priority) in enumerate([("a", 1), ("b", 9), ("c", 0)]):
        scheduler.add_request(make_prioritised(name, priority, (8, 7, 8)[index], 100 * index))
    assert plan(step(scheduler)) == [("c", 8), ("a", 8), ("b", 7)]
    assert scheduler.kv_cache_manager.block_pool.num_free_blocks == 0
    # c and a grow into a new block each: b, the lowest priority although not the latest admitted, goes.
    output = step(scheduler)
    assert [request.request_id for request in output.preempted] == ["b"]
    assert plan(output) == [("c", 1), ("a", 1)]
    assert [request.request_id for request in scheduler.waiting] == ["b"]


def test_priority_puts_a_preempted_request_back_in_priority_order() -> None:
    scheduler = make_scheduler(num_blocks=7, page_size=4, policy="priority")
    for index, (name, priority) in enumerate([("a", 1), ("b", 9), ("c", 0)]):
        scheduler.add_request(make_prioritised(name, priority, (8, 7, 8)[index], 100 * index))
    step(scheduler)
    scheduler.add_request(make_prioritised("urgent", -5, 4, 900))
    scheduler.add_request(make_prioritised("lowest", 20, 4, 950))
    output = step(scheduler)
    assert [request.request_id for request in output.preempted] == ["b"]
    assert [request.request_id for request in scheduler.waiting] == ["urgent", "b", "lowest"]


def test_priority_ranks_a_request_that_cannot_grow_below_those_after_it() -> None:
    # Only the running request with the lowest priority is preempted, even when it is the one that grows.
    scheduler = make_scheduler(num_blocks=5, page_size=4, policy="priority")
    scheduler.add_request(make_prioritised("first", 3, 8, 0))
    scheduler.add_request(make_prioritised("second", 3, 8, 100))
    assert plan(step(scheduler)) == [("first", 8), ("second", 8)]
    output = step(scheduler)
    assert [request.request_id for request in output.preempted] == ["second"], "ties: the later arrival"
    assert plan(output) == [("first", 1)]
