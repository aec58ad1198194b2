"""The AdminService: pause (held while the call is open), stop, start and status."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from contextlib import AbstractContextManager

import grpc
from cbserve_client.proto import admin_pb2, admin_pb2_grpc
from google.protobuf.timestamp_pb2 import Timestamp

from service.engine_host import WEIGHT_VERSION
from service.host_slot import HostSlot


class AdminServicer(admin_pb2_grpc.AdminServiceServicer):
    def __init__(self, slot: HostSlot, max_pause_lease_s: float) -> None:
        self.slot = slot
        self.max_pause_lease_s = max_pause_lease_s
        # Open Pause calls holding the engine; the engine's own snapshot is stale while its loop is parked.
        self.pause_holders = 0

    async def Pause(
        self, request: admin_pb2.PauseRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[admin_pb2.PauseResponse]:
        host = await self.slot.require(context)
        lease_s = self.max_pause_lease_s
        if request.HasField("lease_s"):
            if not request.lease_s > 0:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "lease_s must be > 0")
            lease_s = min(lease_s, request.lease_s)
        cancelled = 0
        if request.mode == admin_pb2.PAUSE_MODE_ABORT:
            cancelled = host.cancel_all()
        elif request.mode == admin_pb2.PAUSE_MODE_WAIT:
            await host.wait_idle(timeout=None)
        async with _held_pause(host.manager.pause()):
            self.pause_holders += 1
            try:
                expires_at = time.time() + lease_s
                yield self._message(True, expires_at, cancelled)
                # The hold lasts until the lease ends or the call does (client cancel, disconnect):
                # ending the call cancels this coroutine and the `async with` releases the pause.
                await asyncio.sleep(lease_s)
            finally:
                self.pause_holders -= 1
        yield self._message(False, expires_at, cancelled)

    def _message(self, paused: bool, expires_at: float, cancelled: int) -> admin_pb2.PauseResponse:
        stamp = Timestamp()
        stamp.FromNanoseconds(int(expires_at * 1e9))
        return admin_pb2.PauseResponse(
            paused=paused,
            holders=self.pause_holders,
            lease_expires_at=stamp,
            weight_version=WEIGHT_VERSION,
            cancelled_requests=cancelled,
        )

    async def Stop(
        self, request: admin_pb2.StopRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.StopResponse:
        host = await self.slot.require(context)
        if not host.manager.is_running():
            return admin_pb2.StopResponse(already_stopped=True)
        timeout = request.drain_timeout_s if request.HasField("drain_timeout_s") else None
        drained, failed = await host.stop(hard=request.hard, drain_timeout_s=timeout)
        return admin_pb2.StopResponse(drained_requests=drained, failed_requests=failed)

    async def Start(
        self, request: admin_pb2.StartRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.StartResponse:
        started = await (await self.slot.require(context)).start_async()
        return admin_pb2.StartResponse(already_running=not started)

    async def GetStatus(
        self, request: admin_pb2.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.GetStatusResponse:
        host = await self.slot.require(context)
        stats = host.stats()
        counters = host.counters
        return admin_pb2.GetStatusResponse(
            running=host.manager.is_running(),
            paused=stats.paused,
            pause_holders=self.pause_holders,
            queued_requests=stats.num_waiting,
            active_requests=stats.num_running,
            kv_blocks_used=stats.num_blocks_used,
            kv_blocks_total=stats.num_blocks_total,
            prefix_cache_hit_rate=stats.prefix_cache_hit_rate,
            weight_version=WEIGHT_VERSION,
            preemptions=stats.preemptions,
            offloads=stats.offloaded_blocks,
            restores=stats.restored_blocks,
            recomputed_tokens=stats.recomputed_tokens,
            prefix_cache_queries=stats.prefix_cache_queried_tokens,
            prefix_cache_hits=stats.prefix_cache_hit_tokens,
            finished_requests=counters.finished_requests,
            prompt_tokens=counters.prompt_tokens,
            generated_tokens=counters.generated_tokens,
            counters={"failed_steps": float(stats.failed_steps)},
            prefix_caching_enabled=stats.prefix_caching_enabled,
        )

    async def UpdateWeights(
        self,
        request_iterator: AsyncIterator[admin_pb2.UpdateWeightsRequest],
        context: grpc.aio.ServicerContext,
    ) -> admin_pb2.UpdateWeightsResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "weight updates arrive with issue 7")
        raise AssertionError("context.abort raises")


@contextlib.asynccontextmanager
async def _held_pause(pause: AbstractContextManager[None]) -> AsyncIterator[None]:
    """Enters the engine's (blocking) pause in a worker thread and always leaves it.

    Waiting for the loop to park blocks, so it runs off the event loop. If this call ends while that
    wait is still going, the pause is released as soon as it is taken, so no hold outlives its call.
    """
    entering = asyncio.get_running_loop().run_in_executor(None, pause.__enter__)
    try:
        await asyncio.shield(entering)
    except asyncio.CancelledError:
        entering.add_done_callback(lambda _: _release(pause))
        raise
    try:
        yield
    finally:
        _release(pause)


def _release(pause: AbstractContextManager[None]) -> None:
    pause.__exit__(None, None, None)
