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
    ) -> ManagerStats:
        """The engine's counters now (each of its parts makes its own: `EngineCore.make_stats`), with the
        loop's own state (passed in by the loop)."""
        stats = engine.make_stats()
        kv_cache, counters = stats.kv_cache, stats.scheduler.counters
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
        )
