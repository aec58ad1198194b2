"""The AdminService: pause (held while the call is open), stop, start, status, weight updates, the
weights' checksum and prefix-cache resets; the trainer's weight-update group, CUDA IPC, sleep and wake are
answered by its `WeightSync` (service.admin_weight_sync). What the HTTP control port does too (pause,
status, prefix-cache reset, the group, sleep and wake) is the shared `AdminOperations`
(service.admin_operations), which both call."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
from cbserve_client.proto import admin_pb2, admin_pb2_grpc
from google.protobuf.timestamp_pb2 import Timestamp

from engine import dtype_from_name
from service.admin_operations import AdminOperations
from service.admin_weight_sync import PAUSE_MODES, WeightSync, call_engine, engine_errors

logger = logging.getLogger(__name__)


class AdminServicer(admin_pb2_grpc.AdminServiceServicer):
    def __init__(self, operations: AdminOperations) -> None:
        self.operations = operations
        self.slot = operations.slot
        self.metrics = operations.metrics
        self.weight_sync = WeightSync(operations)
        # The weight version the last Pause message reported (read from the engine when it is sent).
        self.weight_version = 1

    async def Pause(
        self, request: admin_pb2.PauseRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[admin_pb2.PauseResponse]:
        host = await self.slot.require(context)
        lease_s = self.operations.max_pause_lease_s
        if request.HasField("lease_s"):
            if not request.lease_s > 0:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "lease_s must be > 0")
            lease_s = min(lease_s, request.lease_s)
        mode = PAUSE_MODES.get(request.mode)
        if mode is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown pause mode {request.mode}")
            raise AssertionError("context.abort raises")
        self.weight_version = host.weight_version
        async with self.operations.pause(mode) as handle:
            cancelled = handle.cancelled if handle is not None else 0
            expires_at = time.time() + lease_s
            yield self._message(True, expires_at, cancelled)
            # The hold lasts until the lease ends or the call does (client cancel, disconnect):
            # ending the call cancels this coroutine and the `async with` releases the pause.
            await asyncio.sleep(lease_s)
        self.weight_version = host.weight_version
        yield self._message(False, expires_at, cancelled)

    def _message(self, paused: bool, expires_at: float, cancelled: int) -> admin_pb2.PauseResponse:
        stamp = Timestamp()
        stamp.FromNanoseconds(int(expires_at * 1e9))
        return admin_pb2.PauseResponse(
            paused=paused,
            holders=self.operations.pause_holders,
            lease_expires_at=stamp,
            weight_version=self.weight_version,
            cancelled_requests=cancelled,
        )

    async def Stop(
        self, request: admin_pb2.StopRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.StopResponse:
        host = await self.slot.require(context)
        if not host.admin.is_running():
            return admin_pb2.StopResponse(already_stopped=True)
        timeout = request.drain_timeout_s if request.HasField("drain_timeout_s") else None
        drained, failed = await host.stop(hard=request.hard, drain_timeout_s=timeout)
        return admin_pb2.StopResponse(drained_requests=drained, failed_requests=failed)

    async def Start(
        self, request: admin_pb2.StartRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.StartResponse:
        host = await self.slot.require(context)
        try:
            started = await host.start_async()
        except RuntimeError as exc:  # a tensor-parallel group that lost a rank cannot start again
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
            raise AssertionError("context.abort raises") from exc
        return admin_pb2.StartResponse(already_running=not started)

    async def GetStatus(
        self, request: admin_pb2.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.GetStatusResponse:
        await self.slot.require(context)
        return self.operations.status()

    async def UpdateWeights(
        self,
        request_iterator: AsyncIterator[admin_pb2.UpdateWeightsRequest],
        context: grpc.aio.ServicerContext,
    ) -> admin_pb2.UpdateWeightsResponse:
        started = time.monotonic()
        host = await self.slot.require(context)
        try:
            source, label = await _read_update(request_iterator)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            raise AssertionError("context.abort raises") from exc
        loop = asyncio.get_running_loop()
        try:
            version = await loop.run_in_executor(None, host.admin.update_weights, source, label)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            raise AssertionError("context.abort raises") from exc
        except RuntimeError as exc:  # the engine was destroyed
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
            raise AssertionError("context.abort raises") from exc
        count = len(source) if isinstance(source, dict) else _count_tensors(source)
        logger.info("UpdateWeights: weight_version %d (%s), %d tensors", version, label or "-", count)
        # Every failure above aborts the call, so only successful updates reach the histogram.
        self.metrics.observe_weight_update(time.monotonic() - started)
        return admin_pb2.UpdateWeightsResponse(
            weight_version=version, tensors_updated=count, version_label=label or ""
        )

    async def ResetPrefixCache(
        self, request: admin_pb2.ResetPrefixCacheRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.ResetPrefixCacheResponse:
        await self.slot.require(context)
        # EngineBusyError (requests in flight, no abort) is a RuntimeError: FAILED_PRECONDITION.
        async with engine_errors(context):
            reset = await self.operations.reset_prefix_cache(request.abort)
        return admin_pb2.ResetPrefixCacheResponse(
            dropped_blocks=reset.num_blocks, aborted_requests=reset.num_aborted
        )

    async def GetWeightsChecksum(
        self, request: admin_pb2.GetWeightsChecksumRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.GetWeightsChecksumResponse:
        host = await self.slot.require(context)
        checksum = await call_engine(context, host.admin.weights_checksum)
        response = admin_pb2.GetWeightsChecksumResponse(
            digest=checksum.digest,
            algorithm=checksum.algorithm,
            weight_version=checksum.weight_version,
            num_tensors=len(checksum.tensors),
        )
        if request.per_tensor:
            response.tensors.extend(
                admin_pb2.TensorChecksum(
                    name=tensor.name, digest=tensor.digest, dtype=tensor.dtype, shape=tensor.shape
                )
                for tensor in checksum.tensors
            )
        return response

    # ------------------------------------------------------------------ weight sync and memory (WeightSync)

    async def InitWeightsUpdateGroup(
        self, request: admin_pb2.InitWeightsUpdateGroupRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.InitWeightsUpdateGroupResponse:
        return await self.weight_sync.init_weights_update_group(request, context)

    async def UpdateWeightsFromDistributed(
        self, request: admin_pb2.UpdateWeightsFromDistributedRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[admin_pb2.UpdateWeightsFromDistributedResponse]:
        async for response in self.weight_sync.update_weights_from_distributed(request, context):
            yield response

    async def DestroyWeightsUpdateGroup(
        self, request: admin_pb2.DestroyWeightsUpdateGroupRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.DestroyWeightsUpdateGroupResponse:
        return await self.weight_sync.destroy_weights_update_group(request, context)

    async def UpdateWeightsFromIpc(
        self, request: admin_pb2.UpdateWeightsFromIpcRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.UpdateWeightsFromIpcResponse:
        return await self.weight_sync.update_weights_from_ipc(request, context)

    async def Sleep(
        self, request: admin_pb2.SleepRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.SleepResponse:
        return await self.weight_sync.sleep(request, context)

    async def WakeUp(
        self, request: admin_pb2.WakeUpRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.WakeUpResponse:
        return await self.weight_sync.wake_up(request, context)


class _PendingTensor:
    """One tensor's chunks as they arrive, checked for continuity."""

    def __init__(self, chunk: admin_pb2.TensorChunk) -> None:
        self.name = chunk.name
        self.dtype_name = chunk.dtype
        try:
            self.dtype = dtype_from_name(chunk.dtype)
        except ValueError as exc:
            raise ValueError(f"tensor {chunk.name!r}: {exc}") from None
        self.shape = tuple(int(dim) for dim in chunk.shape)
        if any(dim < 0 for dim in self.shape):
            raise ValueError(f"tensor {chunk.name!r}: negative dimension in shape {list(self.shape)}")
        self.sha256 = chunk.sha256.lower()
        self.size = math.prod(self.shape) * self.dtype.itemsize
        self.data = bytearray()

    def add(self, chunk: admin_pb2.TensorChunk) -> None:
        if (chunk.dtype, tuple(chunk.shape), chunk.sha256.lower()) != (
            self.dtype_name,
            self.shape,
            self.sha256,
        ):
            raise ValueError(f"tensor {self.name!r}: dtype, shape or sha256 differ between its chunks")
        if chunk.byte_offset != len(self.data):
            raise ValueError(
                f"tensor {self.name!r}: chunk at byte_offset {chunk.byte_offset}, expected {len(self.data)} "
                "(chunks must be consecutive, without gaps or overlaps)"
            )
        if len(self.data) + len(chunk.data) > self.size:
            raise ValueError(f"tensor {self.name!r}: more bytes than shape and dtype allow ({self.size})")
        self.data += chunk.data

    def finish(self) -> Any:
        import torch

        if len(self.data) != self.size:
            raise ValueError(
                f"tensor {self.name!r}: {len(self.data)} bytes received, {self.size} expected "
                f"for shape {list(self.shape)} and dtype {self.dtype_name}"
            )
        if hashlib.sha256(self.data).hexdigest() != self.sha256:
            raise ValueError(f"tensor {self.name!r}: sha256 mismatch (the bytes are corrupted or incomplete)")
        if not self.data:
            return torch.empty(self.shape, dtype=self.dtype)
        return torch.frombuffer(self.data, dtype=self.dtype).reshape(self.shape)


async def _read_update(
    request_iterator: AsyncIterator[admin_pb2.UpdateWeightsRequest],
) -> tuple[Any, str | None]:
    """The update the stream carries: a dict of tensors or a safetensors path, and the version label."""
    label: str | None = None
    path: str | None = None
    tensors: dict[str, Any] = {}
    current: _PendingTensor | None = None
    async for message in request_iterator:
        kind = message.WhichOneof("payload")
        if kind == "version_label":
            if label is not None:
                raise ValueError("version_label given more than once")
            label = message.version_label
        elif kind == "safetensors_path":
            if path is not None or tensors or current is not None:
                raise ValueError("a stream carries either tensor chunks or one safetensors_path")
            path = message.safetensors_path
            if not path:
                raise ValueError("safetensors_path is empty")
        elif kind == "chunk":
            if path is not None:
                raise ValueError("a stream carries either tensor chunks or one safetensors_path")
            chunk = message.chunk
            if not chunk.name:
                raise ValueError("a tensor chunk has no name")
            if current is not None and chunk.name == current.name:
                current.add(chunk)
                continue
            if current is not None:
                tensors[current.name] = current.finish()
            if chunk.name in tensors:
                raise ValueError(f"tensor {chunk.name!r}: sent twice or its chunks are not consecutive")
            current = _PendingTensor(chunk)
            current.add(chunk)
        else:
            raise ValueError("an UpdateWeightsRequest has no payload")
    if current is not None:
        tensors[current.name] = current.finish()
    if path is not None:
        return path, label
    if not tensors:
        raise ValueError("the update has no tensors and no safetensors_path")
    return tensors, label


def _count_tensors(path: Any) -> int:
    from engine import safetensors_files

    count = 0
    try:
        from safetensors import safe_open

        for file in safetensors_files(str(path)):
            with safe_open(file, framework="pt") as handle:
                count += len(list(handle.keys()))
    except Exception:  # counted after a successful update: the files were readable then
        logger.exception("could not count the tensors of %s", path)
    return count
