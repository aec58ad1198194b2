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
    failed_steps: int
    prefix_caching_enabled: bool
    # Seconds per step phase since the engine was built: schedule, prepare_inputs, forward, sample, update.
    step_timings: dict[str, float]
    # Version of the weights served: 1 at start, +1 per `update_weights`.
    weight_version: int = 1
    weight_version_label: str | None = None
    # Tokens sampled since the engine was built.
    num_generated_tokens: int = 0

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
    ) -> ManagerStats:
        """The engine's counters now, with the loop's own state (passed in by the loop)."""
        # Every cache group counts: a hybrid model's sliding-window blocks are memory too.
        pools = [group.block_pool for group in engine.kv_cache_manager.groups]
        prefix = engine.kv_cache_manager.prefix_cache_stats
        counters = engine.scheduler.counters
        return cls(
            running=running,
            paused=paused,
            num_pause_holders=num_pause_holders,
            num_waiting=num_waiting,
            num_running=engine.scheduler.num_running,
            num_blocks_total=sum(pool.num_usable_blocks for pool in pools),
            num_blocks_used=sum(pool.num_used_blocks for pool in pools),
            num_blocks_cached=sum(pool.num_cached_blocks for pool in pools),
            prefix_cache_queried_tokens=prefix.queried_tokens,
            prefix_cache_hit_tokens=prefix.hit_tokens,
            prefix_cache_hit_rate=prefix.hit_rate,
            preemptions=counters.preemptions,
            offloaded_blocks=counters.offloaded_blocks,
            restored_blocks=counters.restored_blocks,
            recomputed_tokens=counters.recomputed_tokens,
            failed_steps=engine.num_failed_steps,
            prefix_caching_enabled=engine.kv_cache_manager.enable_prefix_caching,
            step_timings=engine.runner.timings.as_dict(),
            weight_version=weight_version,
            weight_version_label=weight_version_label,
            num_generated_tokens=num_generated_tokens,
        )
