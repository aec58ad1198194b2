"""Spec of the scheduler's pending work (engine.scheduling.pending_work): the token work no step has done
yet, as gateways read it in the load record (waiting_uncached_tokens, prefill_pending_tokens, retracted).

No model: each step's sampled tokens are fed back by hand, as in test_scheduler.
"""

from __future__ import annotations

from engine.kv.cache_manager import KVCacheManager
from engine.request import FinishReason, Request, RequestStatus
from engine.sampling.params import SamplingParams
from engine.scheduling.pending_work import PendingTotals
from engine.scheduling.scheduler import Scheduler, SchedulerOutput

PAGE_SIZE = 4
TOKEN = 7


def make_scheduler(num_blocks: int = 32, max_batch_tokens: int = 64) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, PAGE_SIZE, True), max_batch_tokens, 8, 0.0)


def make_request(request_id: str, prompt: list[int], max_new_tokens: int = 8) -> Request:
    return Request(request_id, prompt, SamplingParams(max_new_tokens=max_new_tokens))


def step(scheduler: Scheduler) -> SchedulerOutput:
    output = scheduler.schedule()
    scheduler.update_from_output(output, [TOKEN if item.samples_token else None for item in output.scheduled])
    return output


def totals(scheduler: Scheduler) -> PendingTotals:
    return scheduler.make_stats().pending


def test_queued_requests_count_their_tokens_beyond_the_cached_prefix() -> None:
    scheduler = make_scheduler()
    shared = list(range(100, 112))  # three full pages
    warm = make_request("warm", [*shared, 1], max_new_tokens=1)
    scheduler.add_request(warm)
    step(scheduler)
    assert warm.is_finished
    scheduler.hold_new_admissions = True  # both stay queued
    scheduler.add_request(make_request("hit", [*shared, 5, 6]))
    scheduler.add_request(make_request("fresh", list(range(200, 210))))
    cached = len(shared)
    expected = (len(shared) + 2 - cached) + 10
    assert totals(scheduler) == PendingTotals(expected, expected, 0)


def test_a_chunked_prompt_counts_down_its_pending_prefill_and_a_decoding_request_counts_none() -> None:
    scheduler = make_scheduler(max_batch_tokens=8)
    scheduler.add_request(make_request("long", list(range(100, 120))))
    assert totals(scheduler).prefill_pending_tokens == 20
    step(scheduler)
    assert totals(scheduler) == PendingTotals(0, 12, 0), "admitted: no longer waiting, 12 prompt tokens left"
    step(scheduler)
    assert totals(scheduler).prefill_pending_tokens == 4
    step(scheduler)
    assert totals(scheduler) == PendingTotals(0, 0, 0), "the prompt is computed and the first token sampled"
    step(scheduler)
    assert totals(scheduler) == PendingTotals(0, 0, 0)


def test_a_preempted_request_waits_as_retracted_with_the_tokens_it_recomputes() -> None:
    # 6 usable blocks of 4: a and c need a new block for their first decode, b decodes in place.
    scheduler = Scheduler(KVCacheManager(7, PAGE_SIZE, False), 64, 8, 0.0)
    requests = [
        make_request("a", list(range(100, 108)), max_new_tokens=2),
        make_request("b", list(range(200, 207)), max_new_tokens=6),
        make_request("c", list(range(300, 308)), max_new_tokens=4),
    ]
    for request in requests:
        scheduler.add_request(request)
    step(scheduler)
    scheduler.hold_new_admissions = True
    output = scheduler.schedule()  # c, the latest admitted, is preempted to make room
    c = requests[2]
    assert output.preempted == [c] and c.status == RequestStatus.PENDING
    # Without a prefix cache it recomputes its 8 prompt tokens and its one generated token; it has a token
    # already, so none of it is pending prefill.
    assert totals(scheduler) == PendingTotals(8 + 1, 0, 1)


def test_cancelled_and_finished_requests_leave_no_pending_work() -> None:
    scheduler = make_scheduler(max_batch_tokens=8)
    running = make_request("running", list(range(100, 120)))
    queued = make_request("queued", list(range(200, 210)))
    scheduler.add_request(running)
    step(scheduler)
    scheduler.add_request(queued)
    scheduler.finish_request(queued, RequestStatus.CANCELLED, FinishReason.CANCELLED)
    scheduler.finish_request(running, RequestStatus.CANCELLED, FinishReason.CANCELLED)
    assert totals(scheduler) == PendingTotals(0, 0, 0)
