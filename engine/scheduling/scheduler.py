"""The scheduler: which requests run this step, with how many tokens each. It never touches tensors.

There is no prefill phase and no decode phase. Each request has `num_computed_tokens` catching up with
`num_tokens` (prompt + generated); a step hands out at most `max_batch_tokens` tokens. A fresh prompt
gets many (chunked when it does not fit the budget), a decoding request gets one, a request resumed
after preemption recomputes what it lost — all the same rule. A request samples a token in the step
where it catches up.

Scheduling a step commits it: `num_computed_tokens` advances at once, and a request that samples in it
holds a placeholder token (`num_output_placeholders`) until `update_from_output` brings the real one.
So the next step can be scheduled while this one still runs (async batching): a decoding request is
then scheduled for the position of its placeholder, whose input id the runner takes from the previous
step's sampled tokens on the device. A request whose placeholders already reach `max_new_tokens` is not
scheduled again; one that turns out to have hit EOS wastes its row in one step, and its output is dropped.

Parallel sampling (n > 1): the request's first sequence computes the prompt but its last token, holding
the other sequences in `pending_forks`. The next step forks them (`_fork_sequences`): each shares the
prompt's full pages and gets a copy of the partly filled one (copied on the device before the forward
pass), then all n compute the prompt's last token and sample their first tokens in that same step.
Sequences that cannot be forked then (no free blocks, a full batch, or a first sequence that ended) wait
as requests of their own and compute the prompt themselves.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field, replace

from engine.kv.cache_manager import DeviceBlockCopy, KVCacheManager, blocks_for_tokens
from engine.kv.offload import BlockCopy, HostBlockPool
from engine.request import FinishReason, KVOnWeightUpdate, Request, RequestStatus, check_stop
from engine.scheduling.pending_work import PendingTotals, PendingWork, queued_share, scheduled_share
from engine.scheduling.waiting_queue import WaitingQueue, priority_key

SCHEDULING_POLICIES = ("fifo", "prefill_first", "priority")


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    # Tokens of this request already in the cache when the step starts (after prefix hits).
    num_computed_tokens: int
    # Its block table in each cache group (null-block entries before a sliding window): the cache
    # manager's own lists, not copies, so a step costs nothing for tables that did not change. They are
    # current until the next `schedule()`, which may grow them: the runner reads them while launching
    # the step, before the next one is scheduled, and a copy sent elsewhere (a tensor-parallel follower)
    # is made then too.
    block_ids: tuple[list[int], ...]
    # True when this step catches the request up, so its last position yields the next token.
    samples_token: bool = field(init=False)

    def __post_init__(self) -> None:
        self.samples_token = self.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Requests that can never run (they outgrew the whole cache), failed by this step's scheduling.
    failed: list[Request] = field(default_factory=list)
    # KV copies the runner makes before the forward pass: offloads first, then restores.
    offloads: list[BlockCopy] = field(default_factory=list)
    restores: list[BlockCopy] = field(default_factory=list)
    # Sequences forked this step (n > 1), and the copies of their partly filled pages, made first.
    forked: list[Request] = field(default_factory=list)
    block_copies: list[DeviceBlockCopy] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(item.num_new_tokens for item in self.scheduled)


@dataclass
class SchedulerCounters:
    preemptions: int = 0
    recomputed_tokens: int = 0
    admitted: int = 0
    # Blocks copied to and from host memory by offloading preemptions and their resumptions.
    offloaded_blocks: int = 0
    restored_blocks: int = 0
    # Sequences of n > 1 requests forked from their first sequence's prompt KV instead of computing it.
    forked_sequences: int = 0


@dataclass(frozen=True)
class SchedulerStats:
    """The queues now and the counters since the scheduler was built (`Scheduler.make_stats`)."""

    num_running: int
    num_waiting: int
    counters: SchedulerCounters
    pending: PendingTotals


class Scheduler:
    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_batch_tokens: int,
        max_requests_per_batch: int,
        safety_margin: float,
        policy: str = "fifo",
        max_model_len: int | None = None,
        host_block_pool: HostBlockPool | None = None,
    ) -> None:
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduler_type must be one of {SCHEDULING_POLICIES}, got {policy!r}")
        self.kv_cache_manager = kv_cache_manager
        self.max_batch_tokens = max_batch_tokens
        self.max_requests_per_batch = max_requests_per_batch
        self.safety_margin = safety_margin
        self.policy = policy
        self.max_model_len = max_model_len
        # Preemption offloads to this pool when it has room, and falls back to recompute otherwise.
        self.host_block_pool = host_block_pool
        self.waiting = WaitingQueue(by_priority=policy == "priority")
        self._arrivals = itertools.count()
        # While True, only preempted requests are (re)admitted: a WAIT pause lets in-flight work finish.
        self.hold_new_admissions = False
        # Under "priority", in `priority_key` order, as `waiting` is.
        self.running: list[Request] = []
        # First sequences of n > 1 requests whose other sequences wait to be forked from them.
        self._forking: list[Request] = []
        self.counters = SchedulerCounters()
        # Every live request's share of the work no step has done yet, kept as each request changes.
        self.pending_work = PendingWork()

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or bool(self.waiting)

    def make_stats(self) -> SchedulerStats:
        return SchedulerStats(
            self.num_running, self.num_waiting, replace(self.counters), self.pending_work.totals()
        )

    def add_request(self, request: Request) -> None:
        """Queues `request`; its `pending_forks` (n > 1) wait on it to be forked."""
        request.arrival_index = next(self._arrivals)
        for sequence in request.pending_forks:
            sequence.arrival_index = next(self._arrivals)
            sequence.fork_source = request
        if request.pending_forks:
            self._forking.append(request)
        self._enqueue(request, preempted=False)

    def _enqueue(self, request: Request, preempted: bool) -> None:
        self.waiting.push(request, preempted)
        self._track_queued(request)

    def has_preempted_waiting(self) -> bool:
        """Whether a preempted request waits to run again (it is still in flight)."""
        return self.waiting.has_preempted()

    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput()
        if self._forking:
            self._fork_sequences(output)
        budget = self.max_batch_tokens
        if self.policy == "prefill_first":
            budget = self._schedule_waiting(output, budget)
            self._schedule_running(output, budget)
        else:
            budget = self._schedule_running(output, budget)
            if not output.preempted:
                self._schedule_waiting(output, budget)
        return output

    def _fork_sequences(self, output: SchedulerOutput) -> None:
        """Forks the pending sequences of every first sequence whose prompt KV, all but the last token,
        earlier steps have computed. It may have computed the last token too (its prompt was served from
        the prefix cache up to there): the copied page then holds it, and each sequence computes it again.
        """
        for source in list(self._forking):
            if source.status not in (RequestStatus.PREFILLING, RequestStatus.DECODING):
                continue  # queued, or preempted: its KV is not in the cache
            num_shared = source.num_prompt_tokens - 1
            if not num_shared <= source.num_computed_tokens <= num_shared + 1:
                continue
            self._forking.remove(source)
            sequences, source.pending_forks = source.pending_forks, []
            unforked = []
            for sequence in sequences:
                copies = None
                if len(self.running) < self.max_requests_per_batch:
                    copies = self.kv_cache_manager.fork(source, sequence, num_shared)
                if copies is None:
                    unforked.append(sequence)
                    continue
                output.block_copies.extend(copies)
                output.forked.append(sequence)
                sequence.num_computed_tokens = num_shared
                sequence.num_cached_tokens = num_shared
                sequence.start_running()
                self._add_running(sequence)
                self.counters.admitted += 1
                self.counters.forked_sequences += 1
            for sequence in reversed(unforked):
                self._release_fork(sequence)

    def _release_fork(self, sequence: Request) -> None:
        """A sequence that will not be forked waits in the queue as a request of its own."""
        sequence.fork_source = None
        self.waiting.push_released_fork(sequence)
        self._track_queued(sequence)

    def _num_new_tokens(self, request: Request, num_computed: int, budget: int) -> int:
        """The tokens `request` gets this step from `num_computed` on: all it lacks, within `budget`. A first
        sequence with sequences to fork stops one token short of its prompt (see `_fork_sequences`),
        unless it already reached that point."""
        num_new_tokens = min(request.num_tokens - num_computed, budget)
        num_shared = request.num_prompt_tokens - 1
        if request.pending_forks and num_computed < num_shared:
            num_new_tokens = min(num_new_tokens, num_shared - num_computed)
        return num_new_tokens

    def _schedule_running(self, output: SchedulerOutput, budget: int) -> int:
        newly_admitted = {item.request.request_id for item in output.scheduled}
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if request.request_id in newly_admitted:
                index += 1
                continue
            if len(output.scheduled) >= self.max_requests_per_batch:
                break
            if (
                request.num_generated_tokens + request.num_output_placeholders
                >= request.sampling.max_new_tokens
            ):
                index += 1  # its last token is still being sampled: the request ends when it lands
                continue
            if request.num_output_placeholders > 0 and request.sampling.structured_output is not None:
                index += 1  # its grammar's next mask depends on the token still being sampled
                continue
            num_new_tokens = self._num_new_tokens(request, request.num_computed_tokens, budget)
            while self.kv_cache_manager.allocate_slots(request, num_new_tokens) is None:
                victim = self._lowest_priority_victim(index, newly_admitted) or request
                self._preempt(victim, output)
                if victim is request:
                    break
            else:
                self._count_recompute(request, request.num_computed_tokens, num_new_tokens)
                self._commit(output, request, num_new_tokens, request.num_computed_tokens)
                budget -= num_new_tokens
                index += 1
                continue
            # `request` itself was preempted: nothing after it in `running` can be scheduled either.
            break
        return budget

    def _lowest_priority_victim(self, index: int, newly_admitted: set[str]) -> Request | None:
        """The running request not yet scheduled this step (after position `index`) to preempt first:
        the latest admitted, or under "priority" the lowest priority (`running` is kept in that order);
        None when there is none, or when the request at `index` itself has a lower priority."""
        for candidate in reversed(self.running[index + 1 :]):
            if candidate.request_id not in newly_admitted:
                if self.policy == "priority" and priority_key(candidate) < priority_key(self.running[index]):
                    return None
                return candidate
        return None

    def _schedule_waiting(self, output: SchedulerOutput, budget: int) -> int:
        while budget > 0:
            request = self.waiting.next_to_admit(self.hold_new_admissions)
            if request is None:
                break
            if len(self.running) >= self.max_requests_per_batch:
                break
            if len(output.scheduled) >= self.max_requests_per_batch:
                break
            if self.kv_cache_manager.free_fraction < self.safety_margin and self.running:
                break
            if request.offloaded is not None:
                if not self._restore(request, output, budget):
                    break
                budget -= output.scheduled[-1].num_new_tokens
                continue
            computed_blocks = self.kv_cache_manager.get_computed_blocks(request)
            num_hit_tokens = len(computed_blocks) * self.kv_cache_manager.page_size
            num_new_tokens = self._num_new_tokens(request, num_hit_tokens, budget)
            if self.kv_cache_manager.allocate_slots(request, num_new_tokens, computed_blocks) is None:
                if not self.running and not output.scheduled:
                    self._fail_unschedulable(request, output)
                    continue
                break
            self.waiting.remove(request)
            self.kv_cache_manager.record_prefix_lookup(request, num_hit_tokens)
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_hit_tokens
                self.counters.admitted += 1
            self._count_recompute(request, num_hit_tokens, num_new_tokens)
            request.num_computed_tokens = num_hit_tokens
            request.start_running()
            self._add_running(request)
            self._commit(output, request, num_new_tokens, num_hit_tokens)
            budget -= num_new_tokens
        return budget

    def _add_running(self, request: Request) -> None:
        if self.policy == "priority":
            bisect.insort(self.running, request, key=priority_key)
        else:
            self.running.append(request)

    def _commit(
        self, output: SchedulerOutput, request: Request, num_new_tokens: int, num_computed_tokens: int
    ) -> None:
        """Adds `request`'s `num_new_tokens` to the step, with its block tables as they now are: its tokens
        count as computed from now on, and a sampled token as a placeholder until the step's output comes
        back."""
        block_ids = self.kv_cache_manager.block_ids_per_group(request.request_id)
        item = ScheduledRequest(request, num_new_tokens, num_computed_tokens, block_ids)
        output.scheduled.append(item)
        request.num_computed_tokens = num_computed_tokens + num_new_tokens
        if item.samples_token:
            request.num_output_placeholders += 1
        self._track(request)

    def _track_queued(self, request: Request) -> None:
        """`request` has just joined the queue, finding its parked KV or the prefix-cache hit it finds now."""
        if request.offloaded is not None:
            num_present_tokens = request.offloaded.num_tokens
        else:
            num_hit_blocks = len(self.kv_cache_manager.get_computed_blocks(request))
            num_present_tokens = num_hit_blocks * self.kv_cache_manager.page_size
        self.pending_work.set_share(request.request_id, queued_share(request, num_present_tokens))

    def _track(self, request: Request) -> None:
        """`request` was scheduled or finished."""
        self.pending_work.set_share(request.request_id, scheduled_share(request))

    def _restore(self, request: Request, output: SchedulerOutput, budget: int) -> bool:
        """Re-admits an offloaded request: its KV comes back from the host instead of being recomputed."""
        offloaded = request.offloaded
        assert offloaded is not None and self.host_block_pool is not None
        num_new_tokens = self._num_new_tokens(request, offloaded.num_tokens, budget)
        # Allocated as already computed, so sliding-window groups only take the pages of the window.
        request.num_computed_tokens = offloaded.num_tokens
        if self.kv_cache_manager.allocate_slots(request, num_new_tokens) is None:
            request.num_computed_tokens = 0
            return False
        self.waiting.remove(request)
        output.restores.extend(self.kv_cache_manager.restore_copies(request, offloaded))
        all_host_block_ids = offloaded.all_host_block_ids
        self.host_block_pool.free_after_step(all_host_block_ids)
        request.offloaded = None
        request.start_running()
        self._add_running(request)
        self.counters.restored_blocks += len(all_host_block_ids)
        self._commit(output, request, num_new_tokens, offloaded.num_tokens)
        return True

    def _offload(self, request: Request, output: SchedulerOutput) -> bool:
        """Parks a request's computed KV in host blocks, if the host pool has room for it
        (`KVCacheManager.offload`)."""
        if self.host_block_pool is None or request.num_computed_tokens == 0:
            return False
        offload = self.kv_cache_manager.offload(request, self.host_block_pool)
        if offload is None:
            return False
        request.offloaded, copies = offload
        output.offloads.extend(copies)
        self.counters.offloaded_blocks += len(request.offloaded.all_host_block_ids)
        return True

    def forget_offloads(self, output: SchedulerOutput) -> None:
        """The step's copies may not have happened (it failed): its offloaded requests will recompute."""
        assert self.host_block_pool is not None or not output.offloads
        for request in output.preempted:
            self._drop_offload(request)

    def _drop_offload(self, request: Request) -> None:
        """A request parked in host memory will recompute its KV instead of restoring it."""
        if request.offloaded is not None and self.host_block_pool is not None:
            self.host_block_pool.free_now(request.offloaded.all_host_block_ids)
            request.num_tokens_to_recompute = max(
                request.num_tokens_to_recompute, request.offloaded.num_tokens
            )
            request.offloaded = None

    def _count_recompute(self, request: Request, num_computed: int, num_new_tokens: int) -> None:
        recomputed = min(num_computed + num_new_tokens, request.num_tokens_to_recompute) - num_computed
        if recomputed > 0:
            self.counters.recomputed_tokens += recomputed

    def preempt_all_for_recompute(self) -> int:
        """Puts every running request back at the head of the queue, in its order, to be recomputed
        (the KV cache is about to be freed: sleep); returns how many there were."""
        running = list(self.running)
        for request in reversed(running):
            self._preempt(request, None)
        return len(running)

    def recompute_after_weight_update(self) -> int:
        """New weights are in place: the requests that asked for it (KVOnWeightUpdate.RECOMPUTE) give up
        the KV the old weights made — running ones go back to the head of the queue, parked ones drop
        their host copy — and compute prompt and tokens so far again under the new weights. The caller
        has dropped the old weights' prefix cache. Returns how many requests will recompute."""
        running = [
            request for request in self.running if request.kv_on_weight_update is KVOnWeightUpdate.RECOMPUTE
        ]
        for request in reversed(running):
            self._preempt(request, None)
        parked = [
            request
            for request in self.waiting
            if request.offloaded is not None and request.kv_on_weight_update is KVOnWeightUpdate.RECOMPUTE
        ]
        for request in parked:
            self._drop_offload(request)
        for request in self.waiting:  # the prefix hits their pending work was counted after are gone
            self._track_queued(request)
        return len(running) + len(parked)

    def _preempt(self, request: Request, output: SchedulerOutput | None) -> None:
        """Frees a running request's blocks and puts it back at the head of the queue.

        Its computed KV is offloaded to host memory when the pool has room (it resumes where it
        stopped), else recomputed when it is scheduled again. Outside a step (`output` None) it is
        always recomputed.
        """
        self.running.remove(request)
        if output is None or not self._offload(request, output):
            request.num_tokens_to_recompute = max(
                request.num_tokens_to_recompute, request.num_computed_tokens
            )
        self.kv_cache_manager.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.mark_preempted()
        self._enqueue(request, preempted=True)
        self.counters.preemptions += 1
        if output is not None:
            output.preempted.append(request)

    def _fail_unschedulable(self, request: Request, output: SchedulerOutput) -> None:
        # Nothing else holds blocks, so the pool is as free as it will ever be: this request cannot fit.
        self.waiting.remove(request)
        page_size = self.kv_cache_manager.page_size
        needed = blocks_for_tokens(request.num_tokens, page_size)
        # Only the primary group is named: admission (engine.loop.admission.admit) already ruled out a too
        # small sliding-window group.
        request.finish(
            RequestStatus.FAILED,
            FinishReason.ERROR,
            f"request {request.request_id!r} needs {needed} KV blocks for its {request.num_tokens} tokens "
            f"but only {self.kv_cache_manager.block_pool.num_free_blocks} of "
            f"{self.kv_cache_manager.block_pool.num_usable_blocks} can ever be free; raise num_blocks",
        )
        self._track(request)
        output.failed.append(request)

    def update_from_output(
        self, output: SchedulerOutput, sampled_token_ids: list[int | None]
    ) -> list[ScheduledRequest]:
        """Folds a step's sampled tokens back into its requests; returns the items that gained a token.

        A request its new token stops (`check_stop`) is finished here and its blocks are freed.
        """
        advanced = []
        for item, token_id in zip(output.scheduled, sampled_token_ids, strict=True):
            request = item.request
            if token_id is None or request.is_finished:
                continue  # a finished request's row is dropped: it ended while this step ran
            request.append_token(token_id)
            advanced.append(item)
            stop = check_stop(request)
            if stop is not None:
                self.finish_request(request, *stop)
        self.remove_finished_running()
        return advanced

    def finish_request(
        self,
        request: Request,
        status: RequestStatus,
        reason: FinishReason,
        error: str | None = None,
        stop_reason: int | None = None,
    ) -> None:
        """Ends a request wherever it is (waiting, running; `Request.finish`) and frees its blocks.
        Idempotent."""
        if request.is_finished:
            return
        source = request.fork_source
        if source is not None and request in source.pending_forks:
            source.pending_forks.remove(request)  # never forked, never queued
            if not source.pending_forks:
                self._forking.remove(source)
        elif request.status == RequestStatus.PENDING:
            # Queued (fresh or preempted): leave the queue now, so it only ever holds live requests and
            # the loop's per-step checks stay O(1).
            self.waiting.remove(request)
        if request.pending_forks:  # its sequences cannot be forked from it any more
            self._forking.remove(request)
            for sequence in reversed(request.pending_forks):
                self._release_fork(sequence)
            request.pending_forks = []
        request.finish(status, reason, error, stop_reason)
        self._track(request)
        self.kv_cache_manager.free(request)
        if request.offloaded is not None and self.host_block_pool is not None:
            self.host_block_pool.free_now(request.offloaded.all_host_block_ids)
            request.offloaded = None

    def remove_finished_running(self) -> None:
        if any(request.is_finished for request in self.running):
            self.running = [request for request in self.running if not request.is_finished]
