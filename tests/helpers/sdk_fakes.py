"""Fakes for the Python SDK tests: a fake RPC error, and FAKE GenerationService / AdminService
servicers (canned outputs, no engine) served by a real in-process gRPC server."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from cbserve_client.proto import admin_pb2, admin_pb2_grpc, generation_pb2, generation_pb2_grpc, types_pb2
from google.protobuf.timestamp_pb2 import Timestamp
from grpc_health.v1 import health_pb2, health_pb2_grpc

ADMIN_TOKEN = "s3cret-admin-token"

# The canned output of every request: three tokens whose texts concatenate to "Hello wörld".
CANNED_TOKENS = [(101, "Hel"), (102, "lo w"), (103, "örld")]


class FakeRpcError(grpc.RpcError):
    """What a failed call raises: a grpc.RpcError exposing code() and details()."""

    def __init__(self, code: grpc.StatusCode, details: str = "") -> None:
        super().__init__(details)
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def make_chunk(
    request_id: str, index: int, *, final: bool = False, **fields: Any
) -> types_pb2.GenerationChunk:
    token_id, text = CANNED_TOKENS[index]
    chunk = types_pb2.GenerationChunk(
        request_id=request_id,
        token_index=index,
        token_ids=[token_id],
        text=text,
        status=types_pb2.REQUEST_STATUS_FINISHED if final else types_pb2.REQUEST_STATUS_DECODING,
        weight_version=1,
        **fields,
    )
    if final:
        chunk.finish_reason = types_pb2.FINISH_REASON_EOS
        chunk.usage.CopyFrom(types_pb2.Usage(prompt_tokens=4, generated_tokens=len(CANNED_TOKENS)))
        chunk.timings.queued_at.FromSeconds(1_700_000_000)
        chunk.timings.queue_time_s = 0.25
    return chunk


def canned_chunks(request_id: str, from_index: int = 0) -> list[types_pb2.GenerationChunk]:
    last = len(CANNED_TOKENS) - 1
    return [make_chunk(request_id, i, final=i == last) for i in range(from_index, len(CANNED_TOKENS))]


@dataclass
class Recorder:
    """What the fake servicers saw."""

    metadata: list[dict[str, str]] = field(default_factory=list)
    added: list[types_pb2.GenerationRequest] = field(default_factory=list)
    cancelled_ids: list[str] = field(default_factory=list)
    stream_cancelled: threading.Event = field(default_factory=threading.Event)
    pause_released: threading.Event = field(default_factory=threading.Event)
    pause_requests: list[admin_pb2.PauseRequest] = field(default_factory=list)
    weights: dict[str, tuple[str, tuple[int, ...], bytes]] = field(default_factory=dict)
    version_label: str = ""
    distributed_updates: list[admin_pb2.UpdateWeightsFromDistributedRequest] = field(default_factory=list)
    groups_left: int = 0

    def see(self, context: grpc.ServicerContext) -> None:
        self.metadata.append({k: v for k, v in context.invocation_metadata() if isinstance(v, str)})


class FakeGenerationService(generation_pb2_grpc.GenerationServiceServicer):
    """Canned outputs. Prompt text "reject" is refused; "slow" streams until cancelled."""

    def __init__(self, recorder: Recorder) -> None:
        self.rec = recorder
        self.known: set[str] = set()

    def AddRequest(self, request: Any, context: Any) -> generation_pb2.AddRequestResponse:
        self.rec.see(context)
        self.rec.added.append(request.request)
        request_id = request.request.request_id or f"srv-{len(self.rec.added)}"
        if request_id in self.known:
            context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request {request_id} exists")
        self.known.add(request_id)
        return generation_pb2.AddRequestResponse(request_id=request_id)

    def StreamResults(self, request: Any, context: Any) -> Iterator[generation_pb2.StreamResultsResponse]:
        self.rec.see(context)
        if request.request_id not in self.known:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown request {request.request_id}")
        for chunk in canned_chunks(request.request_id, request.from_token_index):
            yield generation_pb2.StreamResultsResponse(chunk=chunk)

    def Cancel(self, request: Any, context: Any) -> generation_pb2.CancelResponse:
        self.rec.see(context)
        if request.request_id not in self.known:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown request {request.request_id}")
        first = request.request_id not in self.rec.cancelled_ids
        self.rec.cancelled_ids.append(request.request_id)
        return generation_pb2.CancelResponse(cancelled=first)

    def Generate(self, request_iterator: Any, context: Any) -> Iterator[generation_pb2.GenerateResponse]:
        self.rec.see(context)
        for message in request_iterator:
            if message.WhichOneof("action") != "add":
                continue
            add = message.add
            self.rec.added.append(add)
            rid = add.request_id
            if add.WhichOneof("prompt") == "text" and add.text == "reject":
                yield generation_pb2.GenerateResponse(
                    chunk=types_pb2.GenerationChunk(
                        request_id=rid,
                        status=types_pb2.REQUEST_STATUS_FAILED,
                        finish_reason=types_pb2.FINISH_REASON_ERROR,
                        error="max_new_tokens must be >= 1",
                        error_code=grpc.StatusCode.INVALID_ARGUMENT.value[0],
                    )
                )
                continue
            yield generation_pb2.GenerateResponse(
                chunk=types_pb2.GenerationChunk(request_id=rid, status=types_pb2.REQUEST_STATUS_QUEUED)
            )
            if add.WhichOneof("prompt") == "text" and add.text == "slow":
                # Never finishes by itself: the end of this call means the client cancelled it.
                context.add_callback(self.rec.stream_cancelled.set)
                i = 0
                while context.is_active():
                    yield generation_pb2.GenerateResponse(chunk=make_chunk(rid, i % 2))
                    i += 1
                    time.sleep(0.01)
                return
            if add.WhichOneof("prompt") == "text" and add.text == "crash":
                yield generation_pb2.GenerateResponse(chunk=make_chunk(rid, 0))
                yield generation_pb2.GenerateResponse(
                    chunk=types_pb2.GenerationChunk(
                        request_id=rid,
                        token_index=1,
                        status=types_pb2.REQUEST_STATUS_FAILED,
                        finish_reason=types_pb2.FINISH_REASON_ERROR,
                        error="CUDA error: device-side assert",
                        error_code=grpc.StatusCode.INTERNAL.value[0],
                    )
                )
                continue
            for chunk in canned_chunks(rid):
                if add.sampling.logprobs:
                    chunk.logprobs.add(logprob=-0.5).top_logprobs.add(token_id=7, logprob=-1.5)
                if add.record_timestamps:
                    chunk.token_timestamps.append(1_700_000_001.5)
                yield generation_pb2.GenerateResponse(chunk=chunk)

    def GetModelInfo(self, request: Any, context: Any) -> generation_pb2.GetModelInfoResponse:
        self.rec.see(context)
        return generation_pb2.GetModelInfoResponse(
            model_name="tiny-llama",
            vocab_size=32000,
            max_context_length=2048,
            eos_token_ids=[2],
            has_chat_template=True,
            has_tokenizer=True,
            weight_version=1,
        )


class FakeAdminService(admin_pb2_grpc.AdminServiceServicer):
    """Checks the bearer token on every call; records pauses and weight updates."""

    def __init__(self, recorder: Recorder) -> None:
        self.rec = recorder

    def _auth(self, context: Any) -> None:
        self.rec.see(context)
        if self.rec.metadata[-1].get("authorization") != f"Bearer {ADMIN_TOKEN}":
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "bad or missing bearer token")

    def Pause(self, request: Any, context: Any) -> Iterator[admin_pb2.PauseResponse]:
        self._auth(context)
        self.rec.pause_requests.append(request)
        context.add_callback(self.rec.pause_released.set)
        if request.lease_s == 999:  # marker: an engine that never manages to pause
            while context.is_active():
                time.sleep(0.01)
            return
        # As the server does: the hold lasts until the lease expires (then a last message, paused =
        # False) or the call ends.
        lease_s = request.lease_s if request.HasField("lease_s") else 300.0
        expires_at = Timestamp()
        expires_at.FromNanoseconds(int((time.time() + lease_s) * 1e9))
        yield admin_pb2.PauseResponse(paused=True, holders=1, weight_version=1, lease_expires_at=expires_at)
        held_until = time.monotonic() + lease_s
        while context.is_active() and time.monotonic() < held_until:
            time.sleep(0.01)
        if context.is_active():
            yield admin_pb2.PauseResponse(
                paused=False, holders=0, weight_version=1, lease_expires_at=expires_at
            )

    def Stop(self, request: Any, context: Any) -> admin_pb2.StopResponse:
        self._auth(context)
        return admin_pb2.StopResponse(failed_requests=3 if request.hard else 0, drained_requests=2)

    def Start(self, request: Any, context: Any) -> admin_pb2.StartResponse:
        self._auth(context)
        return admin_pb2.StartResponse(already_running=True)

    def GetStatus(self, request: Any, context: Any) -> admin_pb2.GetStatusResponse:
        self._auth(context)
        return admin_pb2.GetStatusResponse(
            running=True,
            kv_blocks_used=3,
            kv_blocks_total=64,
            prefix_cache_hit_rate=0.5,
            weight_version=1,
            preemptions=2,
            counters={"spec_decode_accepted": 4.0},
        )

    def UpdateWeights(self, request_iterator: Any, context: Any) -> admin_pb2.UpdateWeightsResponse:
        self._auth(context)
        parts: dict[str, list[admin_pb2.TensorChunk]] = {}
        for message in request_iterator:
            kind = message.WhichOneof("payload")
            if kind == "version_label":
                self.rec.version_label = message.version_label
            elif kind == "safetensors_path":
                self.rec.weights[message.safetensors_path] = ("path", (), b"")
            elif kind == "chunk":
                parts.setdefault(message.chunk.name, []).append(message.chunk)
        for name, chunks in parts.items():
            data = b""
            for chunk in chunks:
                if chunk.byte_offset != len(data):
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{name}: gap at {len(data)}")
                data += chunk.data
            if hashlib.sha256(data).hexdigest() != chunks[0].sha256:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{name}: sha256 mismatch")
            self.rec.weights[name] = (chunks[0].dtype, tuple(chunks[0].shape), data)
        return admin_pb2.UpdateWeightsResponse(
            weight_version=2, tensors_updated=len(parts), version_label=self.rec.version_label
        )

    def UpdateWeightsFromDistributed(
        self, request: Any, context: Any
    ) -> Iterator[admin_pb2.UpdateWeightsFromDistributedResponse]:
        """Accepts every announcement. `done` follows `ready` at once: the trainer reads it only after
        broadcasting (to a fake process group, which no server reads)."""
        self._auth(context)
        self.rec.distributed_updates.append(request)
        if request.validate_only:
            return
        ready = admin_pb2.WeightTransferReady(
            num_buckets=len(request.buckets), num_bytes=sum(bucket.num_bytes for bucket in request.buckets)
        )
        yield admin_pb2.UpdateWeightsFromDistributedResponse(ready=ready)
        done = admin_pb2.UpdateWeightsResponse(
            weight_version=2,
            tensors_updated=sum(len(bucket.tensors) for bucket in request.buckets),
            version_label=request.version_label,
        )
        yield admin_pb2.UpdateWeightsFromDistributedResponse(done=done)

    def DestroyWeightsUpdateGroup(
        self, request: Any, context: Any
    ) -> admin_pb2.DestroyWeightsUpdateGroupResponse:
        self._auth(context)
        self.rec.groups_left += 1
        return admin_pb2.DestroyWeightsUpdateGroupResponse(destroyed=True)


class WatchableHealth(health_pb2_grpc.HealthServicer):
    """grpc.health.v1 for a fake server on grpc's thread-pool server: `set` changes a service's status,
    `Check` reads it, `Watch` streams its changes.

    Not grpcio-health-checking's servicer, whose `set` and `Watch` call into the server while holding
    their lock, while the server's serving thread takes that lock to close a watch. Under the thread-pool
    server the two deadlock: a client watching stays deaf to a change of health, and the server's `stop`
    never returns (seen in a full test run; eight clients opening and cancelling watches while the
    health changed every millisecond deadlocked it within three changes). Its blocking mode survived that
    stress, but still registers each watch's close callback with grpc while holding the lock the
    callback takes. Here nothing calls into grpc under the lock: each watch waits for a change and yields
    outside it, and ends once its call is over. Each open watch holds a worker thread of the server's
    pool."""

    def __init__(self, statuses: dict[str, int] | None = None) -> None:
        self._changed = threading.Condition()
        self._statuses = dict(statuses or {})

    def set(self, service: str, status: int) -> None:
        with self._changed:
            self._statuses[service] = status
            self._changed.notify_all()

    def Check(self, request: health_pb2.HealthCheckRequest, context: Any) -> health_pb2.HealthCheckResponse:
        with self._changed:
            status = self._statuses.get(request.service)
        if status is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=status)

    def Watch(
        self, request: health_pb2.HealthCheckRequest, context: Any
    ) -> Iterator[health_pb2.HealthCheckResponse]:
        sent = None
        while context.is_active():
            with self._changed:
                status = self._statuses.get(request.service, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
                if status == sent:
                    # A bounded wait: the call's end notifies nothing here.
                    self._changed.wait(timeout=0.1)
                    continue
            sent = status
            yield health_pb2.HealthCheckResponse(status=status)


@dataclass
class FakeServer:
    target: str
    recorder: Recorder


def start_fake_server() -> tuple[grpc.Server, FakeServer]:
    """A real gRPC server on a free loopback port, serving the fake servicers (caller stops it)."""
    recorder = Recorder()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    generation_pb2_grpc.add_GenerationServiceServicer_to_server(FakeGenerationService(recorder), server)
    admin_pb2_grpc.add_AdminServiceServicer_to_server(FakeAdminService(recorder), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, FakeServer(target=f"127.0.0.1:{port}", recorder=recorder)
