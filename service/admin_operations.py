"""The admin operations both admin front ends call: the gRPC AdminService (service.admin_servicer) and the
HTTP control port (service.control_routes). Each takes plain arguments, runs the engine's blocking call off
the event loop and raises the engine's own errors (ValueError for a bad argument, RuntimeError for a state
that forbids the call, WeightTransferError when a transfer fails, ModelStillLoading before the model is
up); each front end maps them onto its status codes, so a rule kept here holds on both."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractContextManager
from typing import Any, TypeVar

from cbserve_client.proto import admin_pb2

from engine import BucketPlan, JoinedGroup, PauseHandle, PrefixCacheReset, SleepOutcome
from service.engine_host import EngineHost
from service.host_slot import HostSlot
from service.metrics import MetricsObserver

logger = logging.getLogger(__name__)
T = TypeVar("T")


class ModelStillLoading(Exception):
    """An admin call made before the engine exists (gRPC UNAVAILABLE, HTTP 503)."""


async def run_engine(call: Callable[[], T]) -> T:
    """The result of a blocking engine call, run in a worker thread; its exception as it is raised.

    Shielded: a caller that goes away does not cancel the call (the thread runs on regardless, and a
    transfer's end is what health waits for); its late failure is logged, so asyncio never reports it as
    "never retrieved"."""
    return await run_engine_future(asyncio.get_running_loop().run_in_executor(None, call))


async def run_engine_future(running: asyncio.Future[T]) -> T:
    """`run_engine` for a call already running in a worker thread."""
    try:
        return await asyncio.shield(running)
    except asyncio.CancelledError:
        running.add_done_callback(_log_late_failure)
        raise


def _log_late_failure(running: asyncio.Future[Any]) -> None:
    if not running.cancelled() and running.exception() is not None:
        logger.info("a call whose caller had already gone failed: %s", running.exception())


def _taken(done: asyncio.Future[Any]) -> BaseException | None:
    """A finished future's exception, marked as retrieved."""
    return None if done.cancelled() else done.exception()


class AdminOperations:
    """What an operator or a trainer does to the engine, front-end free. It counts the pauses held through
    it (both front ends' holds add up in `pause_holders`) and observes holds and updates in the metrics."""

    def __init__(self, slot: HostSlot, max_pause_lease_s: float, metrics: MetricsObserver) -> None:
        self.slot = slot
        self.max_pause_lease_s = max_pause_lease_s
        self.metrics = metrics
        # Pauses held now; the engine's own snapshot is stale while its loop is parked.
        self.pause_holders = 0

    def host(self) -> EngineHost:
        if self.slot.host is None:
            raise ModelStillLoading("the model is still loading")
        return self.slot.host

    @contextlib.asynccontextmanager
    async def pause(self, mode: str) -> AsyncIterator[PauseHandle | None]:
        """Holds the engine paused ("keep", "wait" or "abort" the requests in flight) while the block runs;
        entered once the loop is parked."""
        host = self.host()
        async with _held_pause(host.admin.pause(mode)) as handle:
            held_since = time.monotonic()
            self.pause_holders += 1
            try:
                yield handle
            finally:
                self.pause_holders -= 1
                # In the `finally`, so a hold ended by a cancelled or broken call is observed too.
                self.metrics.observe_pause_held(time.monotonic() - held_since)

    def status(self) -> admin_pb2.GetStatusResponse:
        """The engine's state and counters, as GetStatus answers them."""
        host = self.host()
        stats = host.stats()
        counters = host.counters
        return admin_pb2.GetStatusResponse(
            running=host.admin.is_running(),
            paused=stats.paused,
            pause_holders=self.pause_holders,
            queued_requests=stats.num_waiting,
            active_requests=stats.num_running,
            kv_blocks_used=stats.num_blocks_used,
            kv_blocks_total=stats.num_blocks_total,
            prefix_cache_hit_rate=stats.prefix_cache_hit_rate,
            weight_version=host.weight_version,
            preemptions=stats.preemptions,
            offloads=stats.offloaded_blocks,
            restores=stats.restored_blocks,
            recomputed_tokens=stats.recomputed_tokens,
            prefix_cache_queries=stats.prefix_cache_queried_tokens,
            prefix_cache_hits=stats.prefix_cache_hit_tokens,
            finished_requests=counters.finished_requests,
            prompt_tokens=counters.prompt_tokens,
            generated_tokens=counters.generated_tokens,
            counters={
                "failed_steps": float(stats.failed_steps),
                "forked_sequences": float(stats.forked_sequences),
                **step_phase_counters(stats.step_timings),
            },
            prefix_caching_enabled=stats.prefix_caching_enabled,
            sleep_level=stats.sleep_level,
            weights_incomplete=stats.weights_incomplete or "",
            weights_update_group_ranks=stats.weights_update_group_ranks,
            tensor_parallel_size=host.admin.tensor_parallel_size,
        )

    async def reset_prefix_cache(self, abort: bool) -> PrefixCacheReset:
        """Drops every cached prefix block; EngineBusyError with requests in flight unless `abort`."""
        host = self.host()
        reset = await run_engine(lambda: host.admin.reset_prefix_cache(abort=abort))
        logger.info(
            "ResetPrefixCache: %d blocks dropped, %d requests aborted", reset.num_blocks, reset.num_aborted
        )
        return reset

    async def label_weights(self, label: str) -> None:
        """Names the weights served now (their version number and the prefix cache stay)."""
        host = self.host()
        await run_engine(lambda: host.admin.label_weights(label))
        logger.info("the weights served (weight_version %d) are labelled %r", host.weight_version, label)

    # ------------------------------------------------------------------ the trainer's weight-update group

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        backend: str,
        group_name: str,
        timeout_s: float,
    ) -> JoinedGroup:
        host = self.host()
        return await run_engine(
            lambda: host.admin.init_weights_update_group(
                master_address,
                master_port,
                rank_offset,
                world_size,
                backend=backend,
                group_name=group_name,
                timeout_s=timeout_s,
            )
        )

    async def check_weights_update(self, plan: BucketPlan) -> None:
        """ValueError naming the first tensor or bucket of `plan` the model cannot take."""
        host = self.host()
        await run_engine(lambda: host.admin.check_weights_update(plan))

    async def update_weights_from_distributed(
        self, plan: BucketPlan, label: str | None, ready: asyncio.Event | None = None
    ) -> int:
        """Receives the buckets of `plan` the trainer broadcasts (checked first); `ready` is set once the
        engine waits for the first one. Returns the new weight version. A caller that goes away (its call
        cancelled) fails a receive still waiting, at once rather than at the group's timeout."""
        started = time.monotonic()
        host = self.host()
        await self.check_weights_update(plan)
        loop = asyncio.get_running_loop()

        def on_ready() -> None:
            if ready is not None:
                loop.call_soon_threadsafe(ready.set)

        update = loop.run_in_executor(
            None, lambda: host.admin.update_weights_from_distributed(plan, label, on_ready)
        )
        # Health follows the outcome when the transfer ends, which may be after the caller went away
        # (its error is then taken here, not left for asyncio to report as never retrieved).
        update.add_done_callback(_taken)
        update.add_done_callback(lambda _: host.state_changed())
        try:
            version = await run_engine_future(update)
        except asyncio.CancelledError:
            host.admin.abort_weights_transfer()
            raise
        logger.info(
            "UpdateWeightsFromDistributed: weight_version %d, %d tensors", version, len(plan.tensor_names)
        )
        self.metrics.observe_weight_update(time.monotonic() - started)
        return version

    # ------------------------------------------------------------------ memory

    async def sleep(self, level: int, mode: str) -> SleepOutcome:
        """Frees the KV cache (level 1) and the weights' device memory too (level 2); health follows."""
        host = self.host()
        try:
            outcome = await run_engine(lambda: host.admin.sleep(level, mode))
        finally:
            host.state_changed()
        resident = outcome.resident_bytes_released
        logger.info(
            "asleep at level %d: %.1f MiB released, of which %s resident",
            level,
            outcome.released_bytes / 2**20,
            "unknown" if resident is None else f"{resident / 2**20:.1f} MiB",
        )
        return outcome

    async def wake_up(self, tags: list[str]) -> int:
        """Takes back what sleep released (all of it when `tags` is empty); returns the sleep level left."""
        host = self.host()
        try:
            return await run_engine(lambda: host.admin.wake_up(tags))
        finally:
            host.state_changed()


def step_phase_counters(step_timings: dict[str, float]) -> dict[str, float]:
    """The engine's step phases as status counters: `steps`, and `step_seconds.<phase>` for schedule,
    prepare_inputs, forward, sample and update, since the engine was last built (a Start rebuilds it).
    Two readings' difference says where a workload's steps went."""
    counters = {}
    for name, value in step_timings.items():
        if name == "num_steps":
            counters["steps"] = float(value)
        else:
            counters[f"step_seconds.{name.removesuffix('_s')}"] = float(value)
    return counters


@contextlib.asynccontextmanager
async def _held_pause(pause: AbstractContextManager[T]) -> AsyncIterator[T]:
    """Enters the engine's (blocking) pause in a worker thread and always leaves it.

    Waiting for the loop to park blocks, so it runs off the event loop. If the caller goes away while that
    wait is still going, the pause is released as soon as it is taken, so no hold outlives its caller.
    """
    entering = asyncio.get_running_loop().run_in_executor(None, pause.__enter__)
    try:
        value = await asyncio.shield(entering)
    except asyncio.CancelledError:
        entering.add_done_callback(lambda _: _release(pause))
        raise
    try:
        yield value
    finally:
        _release(pause)


def _release(pause: AbstractContextManager[Any]) -> None:
    pause.__exit__(None, None, None)
