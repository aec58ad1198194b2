"""Synchronous client of the cbserve AdminService (pause, stop/start, status, weight updates, sleep)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import grpc

from cbserve_client._buckets import WeightBucket
from cbserve_client._call import (
    DEFAULT_TIMEOUT,
    MetadataArg,
    Timeout,
    resolve_timeout,
)
from cbserve_client._channel import ChannelOwner, Interceptor
from cbserve_client._connection import ChannelSettings
from cbserve_client._convert import (
    distributed_update_request,
    init_weights_update_group_request,
    pause_info_from_proto,
    pause_request,
    prefix_cache_reset_from_proto,
    sleep_request,
    sleep_result_from_proto,
    status_from_proto,
    stop_result_from_proto,
    wake_up_request,
    weights_checksum_from_proto,
    weights_update_from_proto,
    weights_update_group_info_from_proto,
)
from cbserve_client._cuda_ipc import cuda_ipc_request
from cbserve_client._generated.cbserve.v1 import admin_pb2, admin_pb2_grpc
from cbserve_client._pause import PauseLease
from cbserve_client._types import (
    PauseInfo,
    PrefixCacheReset,
    SleepResult,
    Status,
    StopResult,
    WeightsChecksum,
    WeightsUpdate,
    WeightsUpdateGroupInfo,
)
from cbserve_client._weights import MAX_CHUNK_BYTES, NamedTensors, WeightsSource, update_weights_requests
from cbserve_client._weights_transfer import WeightsTransfer
from cbserve_client.errors import CbserveError, DeadlineExceededError, UnimplementedError

__all__ = ["AdminClient"]

DEFAULT_TIMEOUT_S = 60.0
#: How long the server waits for every member of a weight-update group, and for each of the group's
#: collectives, when the caller does not say (the server's own default).
DEFAULT_GROUP_TIMEOUT_S = 120.0

T = TypeVar("T")

#: The admin port serves no health service, and its calls must reach a server whose generation does
#: not serve (loading, asleep, stopped): no health checking.
_ADMIN_SETTINGS = ChannelSettings(health_check=False)


class AdminClient(ChannelOwner):
    """A connection to a cbserve server's AdminService (usually on its own port).

    Args:
        target: the admin address, e.g. ``"localhost:50052"``.
        token: the admin bearer token, sent as ``authorization: Bearer <token>`` on every call
            (None only for a server run without admin authentication).
        credentials: TLS (or mTLS) channel credentials; None for a plaintext channel.
        timeout: default deadline, in seconds, of unary calls (stop, start, status, sleep, ...).
            Streaming calls (paused, update_weights, update_weights_from_distributed) have no
            deadline unless given one.
        options: extra gRPC channel options.
        interceptors: gRPC client interceptors (``grpc.UnaryUnaryClientInterceptor`` and the other three
            kinds), applied to every call, first one outermost.

    Every call also takes ``metadata=``: (key, value) pairs, or a dict, sent as gRPC metadata with that
    call, after the token's ``authorization``.
    """

    port_flag = "--admin-port, 50052 by default"

    def __init__(
        self,
        target: str,
        token: str | None,
        *,
        credentials: grpc.ChannelCredentials | None = None,
        timeout: float | None = DEFAULT_TIMEOUT_S,
        options: Sequence[tuple[str, Any]] = (),
        interceptors: Sequence[Interceptor] = (),
    ) -> None:
        super().__init__(target, credentials, token, timeout, options, _ADMIN_SETTINGS, interceptors)
        self._stub: Any = admin_pb2_grpc.AdminServiceStub(self._channel)

    def pause(
        self,
        mode: str = "keep",
        lease_s: float | None = None,
        *,
        timeout: float | None = None,
        metadata: MetadataArg = (),
    ) -> PauseLease:
        """Pauses the engine and returns a :class:`PauseLease` that holds it paused until
        ``lease.release()`` (or the end of a ``with`` block around it), or until the lease expires.

        Opens the Pause stream and returns once the server reports the engine paused. ``mode``: "keep"
        (in-flight requests stay, with their KV cache), "wait" (let in-flight requests finish first)
        or "abort" (cancel them). ``lease_s`` caps the hold (the server also has a maximum:
        ``lease.lease_expires_at`` says when it ends). ``timeout`` bounds the wait for the pause.
        Requests added while paused are queued and run after the release.
        """
        request = pause_request(mode, lease_s)
        call = self._call(lambda: self._stub.Pause(request, metadata=self._metadata(metadata)))
        timed_out = threading.Event()
        timer: threading.Timer | None = None
        if timeout is not None:

            def expire() -> None:
                timed_out.set()
                call.cancel()

            timer = threading.Timer(timeout, expire)
            timer.daemon = True
            timer.start()
        try:
            first = next(call)
        except StopIteration:
            raise CbserveError(
                grpc.StatusCode.UNKNOWN, "the Pause stream ended before the engine was paused"
            ) from None
        except grpc.RpcError as exc:
            if timed_out.is_set():
                raise DeadlineExceededError(
                    grpc.StatusCode.DEADLINE_EXCEEDED, f"the engine did not pause within {timeout} s"
                ) from exc
            raise self._error(exc) from exc
        finally:
            if timer is not None:
                timer.cancel()
        return PauseLease(call, pause_info_from_proto(first))

    @contextlib.contextmanager
    def paused(
        self,
        mode: str = "keep",
        lease_s: float | None = None,
        *,
        timeout: float | None = None,
        metadata: MetadataArg = (),
    ) -> Iterator[PauseInfo]:
        """Holds the engine paused for the duration of a ``with`` block: :meth:`pause`, yielding the
        lease's :class:`PauseInfo`, and the release when the block exits."""
        with self.pause(mode, lease_s, timeout=timeout, metadata=metadata) as lease:
            yield lease.info

    def stop(
        self,
        hard: bool = False,
        *,
        drain_timeout_s: float | None = None,
        timeout: Timeout = DEFAULT_TIMEOUT,
        metadata: MetadataArg = (),
    ) -> StopResult:
        """Stops the engine: drains in-flight requests (up to ``drain_timeout_s``), or with
        ``hard=True`` fails them at once. Returns once the engine has stopped."""
        request = admin_pb2.StopRequest(hard=hard)
        if drain_timeout_s is not None:
            request.drain_timeout_s = float(drain_timeout_s)
        deadline = resolve_timeout(timeout, self.timeout)
        if deadline is not None and drain_timeout_s is not None and timeout is DEFAULT_TIMEOUT:
            deadline += drain_timeout_s  # the call lasts as long as the drain
        response = self._call(
            lambda: self._stub.Stop(request, timeout=deadline, metadata=self._metadata(metadata))
        )
        return stop_result_from_proto(response)

    def start(self, *, timeout: Timeout = DEFAULT_TIMEOUT, metadata: MetadataArg = ()) -> bool:
        """Starts the engine after a stop. Returns False if it was already running."""
        response = self._call(
            lambda: self._stub.Start(
                admin_pb2.StartRequest(),
                timeout=resolve_timeout(timeout, self.timeout),
                metadata=self._metadata(metadata),
            )
        )
        return not response.already_running

    def status(self, *, timeout: Timeout = DEFAULT_TIMEOUT, metadata: MetadataArg = ()) -> Status:
        """The engine's state and counters."""
        response = self._call(
            lambda: self._stub.GetStatus(
                admin_pb2.GetStatusRequest(),
                timeout=resolve_timeout(timeout, self.timeout),
                metadata=self._metadata(metadata),
            )
        )
        return status_from_proto(response)

    def update_weights(
        self,
        state_dict_or_path: WeightsSource,
        version: str | None = None,
        *,
        chunk_size: int = MAX_CHUNK_BYTES,
        timeout: float | None = None,
        metadata: MetadataArg = (),
    ) -> WeightsUpdate:
        """Replaces model weights in place.

        ``state_dict_or_path``: a mapping of parameter name -> tensor (torch tensors, numpy-like
        arrays, or ``(dtype, shape, bytes)`` triples), an iterable of (name, tensor) pairs, or
        the path of a safetensors file on the server. Tensors are streamed in chunks of at most
        ``chunk_size`` bytes (1 MiB), each with the sha256 of the whole tensor; ``version`` is a
        free-form label. torch is never imported by this package.
        """
        if not 0 < chunk_size <= MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_size must be in [1, {MAX_CHUNK_BYTES}], got {chunk_size}")
        failures: list[BaseException] = []

        def requests() -> Iterator[admin_pb2.UpdateWeightsRequest]:
            try:
                yield from update_weights_requests(state_dict_or_path, version, chunk_size=chunk_size)
            except Exception as exc:  # surfaced below: gRPC would only report "iterating requests"
                failures.append(exc)
                raise

        try:
            response = self._stub.UpdateWeights(
                requests(), timeout=timeout, metadata=self._metadata(metadata)
            )
        except grpc.RpcError as exc:
            if failures:
                raise failures[0] from None
            raise self._error(exc) from exc
        if failures:  # pragma: no cover - gRPC fails the call when the iterator raises
            raise failures[0]
        return weights_update_from_proto(response)

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        *,
        backend: str = "auto",
        group_name: str = "weights",
        group_timeout_s: float | None = None,
        timeout: Timeout = DEFAULT_TIMEOUT,
        metadata: MetadataArg = (),
    ) -> WeightsUpdateGroupInfo:
        """Joins the weight-update group a trainer hosts (SGLang's init_weights_update_group).

        The trainer is rank 0 and serves the rendezvous (a torch.distributed TCPStore) at
        ``master_address:master_port``; the server's tensor-parallel ranks join as ranks
        ``rank_offset``, ``rank_offset + 1``, ... of ``world_size``. The call returns only once every
        member joined and took part in a warm-up broadcast, so the trainer forms its side of the group
        while the call is in flight: :class:`~cbserve_client.WeightSyncGroup` does both. ``backend``:
        "nccl", "gloo", or "auto" (nccl when the server's model is on CUDA). ``group_timeout_s`` bounds
        the wait for the members and each later collective of the group (the server's 120 s when
        None); the default deadline of the call is the client's timeout plus that wait.
        """
        request = init_weights_update_group_request(
            master_address, master_port, rank_offset, world_size, backend, group_name, group_timeout_s
        )
        deadline = resolve_timeout(timeout, self.timeout)
        if deadline is not None and timeout is DEFAULT_TIMEOUT:
            deadline += DEFAULT_GROUP_TIMEOUT_S if group_timeout_s is None else group_timeout_s
        response = self._call(
            lambda: self._stub.InitWeightsUpdateGroup(
                request, timeout=deadline, metadata=self._metadata(metadata)
            )
        )
        return weights_update_group_info_from_proto(response)

    def start_update_weights_from_distributed(
        self,
        buckets: Sequence[WeightBucket],
        *,
        version: str | None = None,
        timeout: float | None = None,
        metadata: MetadataArg = (),
    ) -> WeightsTransfer:
        """Announces new weights that will arrive as broadcasts over the weight-update group, and
        returns the call in flight: :meth:`WeightsTransfer.wait_ready`, broadcast every bucket from
        rank 0, then :meth:`WeightsTransfer.wait_done`. ``buckets`` come from
        :func:`~cbserve_client.plan_buckets`; ``version`` is a free-form label."""
        request = distributed_update_request(buckets, version, validate_only=False)
        call = self._call(
            lambda: self._stub.UpdateWeightsFromDistributed(
                request, timeout=timeout, metadata=self._metadata(metadata)
            )
        )
        return WeightsTransfer(call, self._error)

    def update_weights_from_distributed(
        self,
        buckets: Sequence[WeightBucket],
        *,
        version: str | None = None,
        validate_only: bool = False,
        on_ready: Callable[[], None] | None = None,
        timeout: float | None = None,
        metadata: MetadataArg = (),
    ) -> WeightsUpdate | None:
        """Receives new weights as broadcasts over the weight-update group (SGLang's
        update_weights_from_distributed), for a trainer with one server.

        Announces ``buckets``, calls ``on_ready()`` once the server waits for them (the trainer
        broadcasts them there, or another thread does), and returns what the server applied. With
        ``validate_only`` the server only checks the announcement (a bad one raises
        InvalidArgumentError naming the tensor) and None is returned: a trainer with several servers
        checks with all of them before any waits for buckets. :class:`~cbserve_client.WeightSyncGroup`
        plans, checks, broadcasts and collects for one server or many.
        """
        if validate_only:
            request = distributed_update_request(buckets, version, validate_only=True)
            self._call(
                lambda: list(
                    self._stub.UpdateWeightsFromDistributed(
                        request, timeout=timeout, metadata=self._metadata(metadata)
                    )
                )
            )
            return None
        with self.start_update_weights_from_distributed(
            buckets, version=version, timeout=timeout, metadata=metadata
        ) as transfer:
            transfer.wait_ready()
            if on_ready is not None:
                on_ready()
            return transfer.wait_done()

    def destroy_weights_update_group(
        self, *, timeout: Timeout = DEFAULT_TIMEOUT, metadata: MetadataArg = ()
    ) -> bool:
        """Leaves the weight-update group (SGLang's destroy_weights_update_group). Returns False when
        the server was in none."""
        response = self._call(
            lambda: self._stub.DestroyWeightsUpdateGroup(
                admin_pb2.DestroyWeightsUpdateGroupRequest(),
                timeout=resolve_timeout(timeout, self.timeout),
                metadata=self._metadata(metadata),
            )
        )
        return bool(response.destroyed)

    def update_weights_from_ipc(
        self,
        named_tensors: NamedTensors,
        *,
        version: str | None = None,
        timeout: Timeout = DEFAULT_TIMEOUT,
        metadata: MetadataArg = (),
    ) -> WeightsUpdate:
        """Replaces weights with a colocated trainer's CUDA tensors, copied device to device through
        CUDA IPC handles (SGLang's update_weights_from_tensor): no bytes cross the network.

        ``named_tensors``: a mapping or (name, tensor) pairs of CUDA torch tensors; both processes must
        number the GPUs alike (same CUDA_VISIBLE_DEVICES). The tensors stay referenced until the call
        returns, since the server reads their memory while it runs. A tensor not on a CUDA device
        raises ValueError naming it, before any call.
        """
        request, shared_tensors = cuda_ipc_request(named_tensors, version)
        response = self._call(
            lambda: self._stub.UpdateWeightsFromIpc(
                request, timeout=resolve_timeout(timeout, self.timeout), metadata=self._metadata(metadata)
            )
        )
        del shared_tensors  # the server has copied out of them
        return weights_update_from_proto(response)

    def sleep(
        self,
        level: int = 1,
        *,
        mode: str = "keep",
        timeout: Timeout = DEFAULT_TIMEOUT,
        metadata: MetadataArg = (),
    ) -> SleepResult:
        """Frees device memory for a colocated trainer (vLLM's sleep): level 1 frees the KV cache,
        level 2 also moves the weights to host memory. Until :meth:`wake_up` the server refuses
        generation requests (UNAVAILABLE) and health reports NOT_SERVING; weight updates still apply.
        ``mode``: "keep" (in-flight requests are recomputed after waking), "wait" (they finish first:
        raise ``timeout`` to match) or "abort" (they are cancelled)."""
        request = sleep_request(level, mode)
        response = self._call(
            lambda: self._stub.Sleep(
                request, timeout=resolve_timeout(timeout, self.timeout), metadata=self._metadata(metadata)
            )
        )
        return sleep_result_from_proto(response)

    def wake_up(
        self,
        tags: Sequence[str] | None = None,
        *,
        timeout: Timeout = DEFAULT_TIMEOUT,
        metadata: MetadataArg = (),
    ) -> int:
        """Restores what :meth:`sleep` freed (vLLM's wake_up): ``tags`` "weights" and/or "kv_cache",
        both when None (a trainer restores the weights first, updates them, then the KV cache). Returns
        the sleep level left: 0 once the server serves again."""
        request = wake_up_request(tags)
        response = self._call(
            lambda: self._stub.WakeUp(
                request, timeout=resolve_timeout(timeout, self.timeout), metadata=self._metadata(metadata)
            )
        )
        return int(response.sleep_level)

    def reset_prefix_cache(
        self, abort: bool = False, *, timeout: Timeout = DEFAULT_TIMEOUT, metadata: MetadataArg = ()
    ) -> PrefixCacheReset:
        """Drops every reusable prefix block (TRL's /reset_prefix_cache, verl's clear_kv_cache, slime's
        flush_cache), so that no later request reuses KV computed before: by weights just replaced, say.

        Only an idle server is reset: with requests in flight (queued or running) it raises
        :class:`~cbserve_client.errors.FailedPreconditionError` and drops nothing, unless ``abort``,
        which cancels them first (each ends "cancelled"). Returns the blocks dropped and the requests
        cancelled."""
        request = admin_pb2.ResetPrefixCacheRequest(abort=bool(abort))
        response = self._call(
            lambda: self._stub.ResetPrefixCache(
                request, timeout=resolve_timeout(timeout, self.timeout), metadata=self._metadata(metadata)
            )
        )
        return prefix_cache_reset_from_proto(response)

    def weights_checksum(
        self, per_tensor: bool = False, *, timeout: Timeout = DEFAULT_TIMEOUT, metadata: MetadataArg = ()
    ) -> WeightsChecksum:
        """A digest of the weights the server holds (slime's check_weights), computed on its device
        between two steps, with the weight version it is of; with ``per_tensor``, each tensor's digest
        too (to find which differ). Equal weights give equal digests on any device:
        :func:`~cbserve_client.weights_checksum` computes the same of a trainer's tensors, and
        :meth:`AdminFleet.check_weights` compares every replica. The call takes as long as reading the
        whole model once on the server's device (seconds for a large model on a CPU)."""
        request = admin_pb2.GetWeightsChecksumRequest(per_tensor=bool(per_tensor))
        response = self._call(
            lambda: self._stub.GetWeightsChecksum(
                request, timeout=resolve_timeout(timeout, self.timeout), metadata=self._metadata(metadata)
            )
        )
        return weights_checksum_from_proto(response)

    def _call(self, fn: Callable[[], T]) -> T:
        """Calls ``fn()``, mapping a grpc.RpcError to the matching CbserveError (see ``_error``)."""
        try:
            return fn()
        except grpc.RpcError as exc:
            raise self._error(exc) from exc

    def _error(self, exc: grpc.RpcError) -> CbserveError:
        """The CbserveError for ``exc``: a call that reached no server says which target and what to
        check; UNIMPLEMENTED (no AdminService at the target: the generation port, most often) says which
        port to use instead."""
        error = super()._error(exc)
        if error.code != grpc.StatusCode.UNIMPLEMENTED:
            return error
        hinted = UnimplementedError(
            error.code,
            f"{error.details} ({self.target} does not serve the AdminService: is it the generation port? "
            "The admin API listens on the server's --admin-port, 50052 by default)",
        )
        hinted.__cause__ = exc
        return hinted
