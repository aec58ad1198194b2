"""`PendingWork`: the token work the scheduler holds that no step has done yet, as running sums.

Gateways stretch their wedge bound by the prefill work a replica reports, and score queues by the token
work waiting in them (service.engine_load). Summing over every queued and running request at each step
would make the step loop O(all requests); instead the scheduler hands over one request's share whenever
it changes (queued: `queued_share`; scheduled, preempted, finished: `scheduled_share`), and the sums
move by the difference, O(1) per change.

Each share counts, for a request:
- `waiting_uncached_tokens`: while it waits in the queue, the tokens it will compute when admitted — its
  tokens less the prefix-cache hit looked up when it joined the queue (a preempted request counts what it
  recomputes; one parked in host memory only what it lacks beyond its parked KV);
- `prefill_pending_tokens`: while it has produced no token, the prompt tokens it has still to compute
  (queued: as above; running: its prompt less its computed tokens, cache hits included);
- `preempted_waiting`: 1 while it waits in the queue after a preemption.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.request import Request


@dataclass(frozen=True)
class PendingShare:
    waiting_uncached_tokens: int = 0
    prefill_pending_tokens: int = 0
    preempted_waiting: int = 0


NO_SHARE = PendingShare()


def queued_share(request: Request, num_present_tokens: int) -> PendingShare:
    """The share of `request` as it joins the queue with its first `num_present_tokens` already in the
    cache or in host memory (a prefix-cache hit, or its parked KV): it will compute the rest."""
    num_to_compute = request.num_tokens - num_present_tokens
    return PendingShare(
        waiting_uncached_tokens=num_to_compute,
        prefill_pending_tokens=num_to_compute if request.num_generated_tokens == 0 else 0,
        preempted_waiting=1 if request.num_preemptions > 0 else 0,
    )


def scheduled_share(request: Request) -> PendingShare:
    """The share of `request` once scheduled or finished: the prompt it has still to compute while it has
    produced no token, nothing once it is finished."""
    prompt_to_compute = request.num_prompt_tokens - request.num_computed_tokens
    if request.is_finished or request.num_generated_tokens > 0 or prompt_to_compute <= 0:
        return NO_SHARE
    return PendingShare(prefill_pending_tokens=prompt_to_compute)


@dataclass(frozen=True)
class PendingTotals:
    """The sums over every live request (`PendingWork.totals`)."""

    waiting_uncached_tokens: int = 0
    prefill_pending_tokens: int = 0
    num_preempted_waiting: int = 0


class PendingWork:
    """Each live request's share of the pending work, and their sums. Owned by the scheduler, which
    updates it on the loop thread; others read the `totals` snapshot."""

    def __init__(self) -> None:
        self._shares: dict[str, PendingShare] = {}
        self._waiting_uncached_tokens = 0
        self._prefill_pending_tokens = 0
        self._preempted_waiting = 0

    def set_share(self, request_id: str, share: PendingShare) -> None:
        """`request_id`'s share is now `share` (NO_SHARE once it is finished)."""
        old = self._shares.pop(request_id, NO_SHARE)
        if share != NO_SHARE:
            self._shares[request_id] = share
        self._waiting_uncached_tokens += share.waiting_uncached_tokens - old.waiting_uncached_tokens
        self._prefill_pending_tokens += share.prefill_pending_tokens - old.prefill_pending_tokens
        self._preempted_waiting += share.preempted_waiting - old.preempted_waiting

    def totals(self) -> PendingTotals:
        return PendingTotals(
            self._waiting_uncached_tokens, self._prefill_pending_tokens, self._preempted_waiting
        )
