"""The AdminService's weight sync and memory RPCs: the trainer's weight-update group, CUDA IPC updates,
sleep and wake. Each maps onto one call of the engine's admin handle (service.engine_admin) run off the
event loop; health follows the outcome (asleep, or weights left incomplete, is NOT_SERVING)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, NoReturn, TypeVar

import grpc
from cbserve_client.proto import admin_pb2

from engine import (
    DEFAULT_GROUP_NAME,
    DEFAULT_GROUP_TIMEOUT_S,
    BucketPlan,
    BucketTensor,
    CudaIpcHandle,
    WeightBucket,
    WeightTransferError,
    WeightTransferTimeout,
)
from service.engine_host import EngineHost
from service.host_slot import HostSlot
from service.metrics import MetricsObserver

logger = logging.getLogger(__name__)
T = TypeVar("T")

PAUSE_MODES = {
    admin_pb2.PAUSE_MODE_UNSPECIFIED: "keep",
    admin_pb2.PAUSE_MODE_KEEP: "keep",
    admin_pb2.PAUSE_MODE_WAIT: "wait",
    admin_pb2.PAUSE_MODE_ABORT: "abort",
}


async def abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    await context.abort(code, message)
    raise AssertionError("context.abort raises")


def status_code_of(exc: Exception) -> grpc.StatusCode | None:
    """The status a failed engine call ends with; None for an exception that is a server bug."""
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, WeightTransferTimeout):
        return grpc.StatusCode.DEADLINE_EXCEEDED
    if isinstance(exc, WeightTransferError):
        return grpc.StatusCode.ABORTED
    if isinstance(exc, RuntimeError):  # already or not in a group, no CUDA, the engine destroyed
        return grpc.StatusCode.FAILED_PRECONDITION
    return None


async def call_engine(context: grpc.aio.ServicerContext, call: Callable[[], T]) -> T:
    """Runs a blocking engine call in a worker thread; its errors end the RPC with their status."""
    return await outcome(context, asyncio.get_running_loop().run_in_executor(None, call))


async def outcome(context: grpc.aio.ServicerContext, running: asyncio.Future[T]) -> T:
    """The result of an engine call running in a worker thread, or the RPC ended with its error's status.
    Shielded: a cancelled RPC does not cancel the call's future (the thread runs on regardless, and a
    transfer's end is what health waits for)."""
    try:
        return await asyncio.shield(running)
    except asyncio.CancelledError:
        # The RPC ended first: the call's own end is still taken and logged when it comes, so asyncio
        # never reports its exception as "never retrieved".
        running.add_done_callback(_log_late_failure)
        raise
    except Exception as exc:
        code = status_code_of(exc)
        if code is None:
            raise
        await abort(context, code, str(exc))


def _taken(done: asyncio.Future[Any]) -> BaseException | None:
    """A finished future's exception, marked as retrieved."""
    return None if done.cancelled() else done.exception()


def _log_late_failure(running: asyncio.Future[Any]) -> None:
    if not running.cancelled() and running.exception() is not None:
        logger.info("a call whose RPC had already ended failed: %s", running.exception())


def bucket_plan(request: admin_pb2.UpdateWeightsFromDistributedRequest) -> BucketPlan:
    return BucketPlan(
        tuple(
            WeightBucket(
                bucket.num_bytes,
                tuple(
                    BucketTensor(tensor.name, tensor.dtype, tuple(tensor.shape), tensor.byte_offset)
                    for tensor in bucket.tensors
                ),
            )
            for bucket in request.buckets
        )
    )


def ipc_handle(tensor: admin_pb2.CudaIpcTensor) -> CudaIpcHandle:
    return CudaIpcHandle(
        name=tensor.name,
        dtype=tensor.dtype,
        shape=tuple(tensor.shape),
        stride=tuple(tensor.stride),
        storage_offset=tensor.storage_offset,
        device_index=tensor.device_index,
        storage_handle=tensor.storage_handle,
        storage_size_bytes=tensor.storage_size_bytes,
        storage_offset_bytes=tensor.storage_offset_bytes,
        ref_counter_handle=tensor.ref_counter_handle,
        ref_counter_offset=tensor.ref_counter_offset,
        event_handle=tensor.event_handle,
        event_sync_required=tensor.event_sync_required,
    )


class WeightSync:
    """The AdminServicer's RPCs for RL trainers, one method each (the servicer's RPC of the same name in
    snake case calls it)."""

    def __init__(self, slot: HostSlot, metrics: MetricsObserver) -> None:
        self.slot = slot
        self.metrics = metrics

    async def init_weights_update_group(
        self, request: admin_pb2.InitWeightsUpdateGroupRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.InitWeightsUpdateGroupResponse:
        host = await self.slot.require(context)
        timeout_s = request.timeout_s if request.HasField("timeout_s") else DEFAULT_GROUP_TIMEOUT_S
        joined = await call_engine(
            context,
            lambda: host.admin.init_weights_update_group(
                request.master_address,
                request.master_port,
                request.rank_offset,
                request.world_size,
                backend=request.backend or "auto",
                group_name=request.group_name or DEFAULT_GROUP_NAME,
                timeout_s=timeout_s,
            ),
        )
        return admin_pb2.InitWeightsUpdateGroupResponse(ranks=joined.ranks, backend=joined.backend)

    async def update_weights_from_distributed(
        self, request: admin_pb2.UpdateWeightsFromDistributedRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[admin_pb2.UpdateWeightsFromDistributedResponse]:
        started = time.monotonic()
        host = await self.slot.require(context)
        plan = bucket_plan(request)
        await call_engine(context, lambda: host.admin.check_weights_update(plan))
        if request.validate_only:
            return
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[None] = loop.create_future()
        label = request.version_label or None

        def on_ready() -> None:
            loop.call_soon_threadsafe(_resolve, ready)

        update = loop.run_in_executor(
            None, lambda: host.admin.update_weights_from_distributed(plan, label, on_ready)
        )
        # Health follows the outcome when the transfer ends, which may be after this call was cancelled
        # (its error is then taken here, not left for asyncio to report as never retrieved).
        update.add_done_callback(_taken)
        update.add_done_callback(lambda _: host.state_changed())
        try:
            waits: list[asyncio.Future[Any]] = [update, ready]
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            if ready.done():
                message = admin_pb2.WeightTransferReady(
                    num_buckets=len(plan.buckets), num_bytes=plan.num_bytes
                )
                yield admin_pb2.UpdateWeightsFromDistributedResponse(ready=message)
            version = await outcome(context, update)
        except asyncio.CancelledError:
            # The trainer gave up (its call ended): a receive still waiting fails now, not at the timeout.
            host.admin.abort_weights_transfer()
            raise
        finally:
            ready.cancel()
        num_tensors = len(plan.tensor_names)
        logger.info("UpdateWeightsFromDistributed: weight_version %d, %d tensors", version, num_tensors)
        self.metrics.observe_weight_update(time.monotonic() - started)
        yield admin_pb2.UpdateWeightsFromDistributedResponse(
            done=admin_pb2.UpdateWeightsResponse(
                weight_version=version, tensors_updated=num_tensors, version_label=request.version_label
            )
        )

    async def destroy_weights_update_group(
        self, request: admin_pb2.DestroyWeightsUpdateGroupRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.DestroyWeightsUpdateGroupResponse:
        host = await self.slot.require(context)
        destroyed = await call_engine(context, host.admin.destroy_weights_update_group)
        return admin_pb2.DestroyWeightsUpdateGroupResponse(destroyed=destroyed)

    async def update_weights_from_ipc(
        self, request: admin_pb2.UpdateWeightsFromIpcRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.UpdateWeightsFromIpcResponse:
        started = time.monotonic()
        host = await self.slot.require(context)
        if not request.tensors:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, "tensors: the update has no tensors")
        handles = [ipc_handle(tensor) for tensor in request.tensors]
        label = request.version_label or None
        version = await call_engine(context, lambda: host.admin.update_weights_from_ipc(handles, label))
        host.state_changed()
        self.metrics.observe_weight_update(time.monotonic() - started)
        return admin_pb2.UpdateWeightsFromIpcResponse(
            weight_version=version, tensors_updated=len(handles), version_label=request.version_label
        )

    async def sleep(
        self, request: admin_pb2.SleepRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.SleepResponse:
        host = await self.slot.require(context)
        mode = PAUSE_MODES.get(request.mode)
        if mode is None:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"mode: unknown pause mode {request.mode}")
        try:
            outcome = await call_engine(context, lambda: host.admin.sleep(request.level, mode))
        finally:
            host.state_changed()
        affected = outcome.cancelled_requests if mode == "abort" else outcome.requeued_requests
        resident = outcome.resident_bytes_released
        logger.info(
            "asleep at level %d: %.1f MiB released, of which %s resident",
            request.level,
            outcome.released_bytes / 2**20,
            "unknown" if resident is None else f"{resident / 2**20:.1f} MiB",
        )
        return admin_pb2.SleepResponse(
            released_bytes=outcome.released_bytes,
            affected_requests=affected,
            resident_bytes_released=resident,
        )

    async def wake_up(
        self, request: admin_pb2.WakeUpRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.WakeUpResponse:
        host = await self.slot.require(context)
        try:
            level = await call_engine(context, lambda: host.admin.wake_up(request.tags))
        finally:
            host.state_changed()
        return admin_pb2.WakeUpResponse(sleep_level=level)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def weight_sync_status(host: EngineHost) -> dict[str, Any]:
    """GetStatus's fields about sleep, the weights' state and the trainer's group."""
    stats = host.stats()
    return {
        "sleep_level": stats.sleep_level,
        "weights_incomplete": stats.weights_incomplete or "",
        "weights_update_group_ranks": stats.weights_update_group_ranks,
        "tensor_parallel_size": host.admin.tensor_parallel_size,
    }
