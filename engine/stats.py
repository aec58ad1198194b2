"""`ManagerStats`: a snapshot of the engine's counters that any thread may read."""

from __future__ import annotations

from dataclasses import dataclass

from engine.engine_core import EngineCore


@dataclass
class ManagerStats:
    """A snapshot of the engine's counters, safe to read from any thread."""

    running: bool
    paused: bool
    num_pause_holders: int
    num_waiting: int
    num_running: int
    num_blocks_total: int
    num_blocks_used: int
    num_blocks_cached: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    prefix_cache_hit_rate: float
    preemptions: int
    offloaded_blocks: int
    restored_blocks: int
    recomputed_tokens: int
    # Sequences of n > 1 requests forked from their request's prompt KV instead of computing it.
    forked_sequences: int
    failed_steps: int
    prefix_caching_enabled: bool
    # Seconds per step phase since the engine was built: schedule, prepare_inputs, forward, sample, update.
    step_timings: dict[str, float]
    # Version of the weights served: 1 at start, +1 per `update_weights`.
    weight_version: int = 1
    weight_version_label: str | None = None
    # Tokens sampled since the engine was built.
    num_generated_tokens: int = 0
    # 0 awake; 1 KV cache freed; 2 weights in host memory too (engine.weights.sleep). Steps run only at 0.
    sleep_level: int = 0
    # Why the weights are a mix of two versions (a transfer failed midway); None when whole. Steps run
    # only when None.
    weights_incomplete: str | None = None
    # Ranks this engine's tensor-parallel ranks hold in a trainer's weight-update group; () when none.
    weights_update_group_ranks: tuple[int, ...] = ()
    # Token work no step has done yet (engine.scheduling.pending_work): tokens the queued requests will
    # compute beyond their prefix-cache hits, and prompt tokens still to compute of the requests with no
    # token yet.
    waiting_uncached_tokens: int = 0
    prefill_pending_tokens: int = 0
    # Requests waiting in the queue to run again after a preemption.
    num_preempted_waiting: int = 0
    # Whether requests are queued or running in the engine (posted ones join it between two steps).
    has_unfinished_requests: bool = False
    # Steps the loop completed since it was built, and the `time.monotonic()` of its last sign of
    # progress: the end of its last step, or the moment an idle engine took a request, whichever is later.
    # While requests are unfinished, now less `progress_at` is how long the engine has been silent.
    num_steps: int = 0
    progress_at: float = 0.0

    @property
    def serving(self) -> bool:
        """Whether requests can make progress: running, awake and with whole weights."""
        return self.running and self.sleep_level == 0 and self.weights_incomplete is None

    @classmethod
    def of(
        cls,
        engine: EngineCore,
        *,
        running: bool,
        paused: bool,
        num_pause_holders: int,
        num_waiting: int,
        weight_version: int,
        weight_version_label: str | None,
        num_generated_tokens: int,
        sleep_level: int,
        weights_incomplete: str | None,
        weights_update_group_ranks: tuple[int, ...],
        num_steps: int,
        progress_at: float,
    ) -> ManagerStats:
        """The engine's counters now (each of its parts makes its own: `EngineCore.make_stats`), with the
        loop's own state (passed in by the loop)."""
        stats = engine.make_stats()
        kv_cache, counters, pending = stats.kv_cache, stats.scheduler.counters, stats.scheduler.pending
        return cls(
            running=running,
            paused=paused,
            num_pause_holders=num_pause_holders,
            num_waiting=num_waiting,
            num_running=stats.scheduler.num_running,
            num_blocks_total=kv_cache.num_blocks_total,
            num_blocks_used=kv_cache.num_blocks_used,
            num_blocks_cached=kv_cache.num_blocks_cached,
            prefix_cache_queried_tokens=kv_cache.prefix_cache.queried_tokens,
            prefix_cache_hit_tokens=kv_cache.prefix_cache.hit_tokens,
            prefix_cache_hit_rate=kv_cache.prefix_cache.hit_rate,
            preemptions=counters.preemptions,
            offloaded_blocks=counters.offloaded_blocks,
            restored_blocks=counters.restored_blocks,
            recomputed_tokens=counters.recomputed_tokens,
            forked_sequences=counters.forked_sequences,
            failed_steps=stats.failed_steps,
            prefix_caching_enabled=kv_cache.prefix_caching_enabled,
            step_timings=stats.step_timings.as_dict(),
            weight_version=weight_version,
            weight_version_label=weight_version_label,
            num_generated_tokens=num_generated_tokens,
            sleep_level=sleep_level,
            weights_incomplete=weights_incomplete,
            weights_update_group_ranks=weights_update_group_ranks,
            waiting_uncached_tokens=pending.waiting_uncached_tokens,
            prefill_pending_tokens=pending.prefill_pending_tokens,
            num_preempted_waiting=pending.num_preempted_waiting,
            has_unfinished_requests=engine.has_unfinished_requests(),
            num_steps=num_steps,
            progress_at=progress_at,
        )
