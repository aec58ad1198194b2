"""The AdminService's weight sync and memory RPCs: the trainer's weight-update group, CUDA IPC updates,
sleep and wake, as translations around the shared admin operations (service.admin_operations), whose
errors end the RPC with their status (`engine_errors`); health follows the outcome (asleep, or weights left
incomplete, is NOT_SERVING)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import NoReturn, TypeVar

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
from service.admin_operations import AdminOperations, ModelStillLoading, run_engine

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
    if isinstance(exc, ModelStillLoading):
        return grpc.StatusCode.UNAVAILABLE
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, WeightTransferTimeout):
        return grpc.StatusCode.DEADLINE_EXCEEDED
    if isinstance(exc, WeightTransferError):
        return grpc.StatusCode.ABORTED
    if isinstance(exc, RuntimeError):  # already or not in a group, no CUDA, the engine destroyed
        return grpc.StatusCode.FAILED_PRECONDITION
    return None


@contextlib.asynccontextmanager
async def engine_errors(context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
    """Ends the RPC with the status of an engine error raised in the block (service.admin_operations)."""
    try:
        yield
    except Exception as exc:
        code = status_code_of(exc)
        if code is None:
            raise
        await abort(context, code, str(exc))


async def call_engine(context: grpc.aio.ServicerContext, call: Callable[[], T]) -> T:
    """Runs a blocking engine call in a worker thread; its errors end the RPC with their status."""
    async with engine_errors(context):
        return await run_engine(call)
    raise AssertionError("engine_errors re-raises or aborts")


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
    snake case calls it), each a translation around the shared `AdminOperations`."""

    def __init__(self, operations: AdminOperations) -> None:
        self.operations = operations
        self.slot = operations.slot
        self.metrics = operations.metrics

    async def init_weights_update_group(
        self, request: admin_pb2.InitWeightsUpdateGroupRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.InitWeightsUpdateGroupResponse:
        timeout_s = request.timeout_s if request.HasField("timeout_s") else DEFAULT_GROUP_TIMEOUT_S
        async with engine_errors(context):
            joined = await self.operations.init_weights_update_group(
                request.master_address,
                request.master_port,
                request.rank_offset,
                request.world_size,
                backend=request.backend or "auto",
                group_name=request.group_name or DEFAULT_GROUP_NAME,
                timeout_s=timeout_s,
            )
        return admin_pb2.InitWeightsUpdateGroupResponse(ranks=joined.ranks, backend=joined.backend)

    async def update_weights_from_distributed(
        self, request: admin_pb2.UpdateWeightsFromDistributedRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[admin_pb2.UpdateWeightsFromDistributedResponse]:
        plan = bucket_plan(request)
        if request.validate_only:
            async with engine_errors(context):
                await self.operations.check_weights_update(plan)
            return
        ready = asyncio.Event()
        update = asyncio.ensure_future(
            self.operations.update_weights_from_distributed(plan, request.version_label or None, ready)
        )
        readiness = asyncio.ensure_future(ready.wait())
        try:
            async with engine_errors(context):
                await asyncio.wait([update, readiness], return_when=asyncio.FIRST_COMPLETED)
                if ready.is_set():
                    message = admin_pb2.WeightTransferReady(
                        num_buckets=len(plan.buckets), num_bytes=plan.num_bytes
                    )
                    yield admin_pb2.UpdateWeightsFromDistributedResponse(ready=message)
                version = await update
        except asyncio.CancelledError:
            # The trainer gave up (its call ended): the update's own cancellation fails a receive still
            # waiting for the trainer's bytes.
            update.cancel()
            raise
        finally:
            readiness.cancel()
        yield admin_pb2.UpdateWeightsFromDistributedResponse(
            done=admin_pb2.UpdateWeightsResponse(
                weight_version=version,
                tensors_updated=len(plan.tensor_names),
                version_label=request.version_label,
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
        mode = PAUSE_MODES.get(request.mode)
        if mode is None:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"mode: unknown pause mode {request.mode}")
        async with engine_errors(context):
            outcome = await self.operations.sleep(request.level, mode)
        affected = outcome.cancelled_requests if mode == "abort" else outcome.requeued_requests
        return admin_pb2.SleepResponse(
            released_bytes=outcome.released_bytes,
            affected_requests=affected,
            resident_bytes_released=outcome.resident_bytes_released,
        )

    async def wake_up(
        self, request: admin_pb2.WakeUpRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.WakeUpResponse:
        async with engine_errors(context):
            level = await self.operations.wake_up(list(request.tags))
        return admin_pb2.WakeUpResponse(sleep_level=level)
