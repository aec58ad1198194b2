"""Synchronous client of the cbserve GenerationService."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import grpc

from cbserve_client._call import (
    DEFAULT_STREAM_TIMEOUT_S,
    DEFAULT_TIMEOUT,
    DEFAULT_TIMEOUT_S,
    GenerationRetry,
    MetadataArg,
    Timeout,
    call_once,
    call_with_retry,
    explain_deadline,
    resolve_timeout,
)
from cbserve_client._channel import ChannelOwner, Closeable, Interceptor, ServingFirstCall
from cbserve_client._connection import (
    DEFAULT_KEEPALIVE_TIMEOUT_S,
    DEFAULT_LOAD_BALANCING,
    DEFAULT_RETRY_ATTEMPTS,
    ChannelSettings,
    no_replica_serving,
)
from cbserve_client._convert import (
    CompletionsBuilder,
    Prompt,
    build_request,
    cancel_message,
    chunk_from_proto,
    model_info_from_proto,
    num_sequences,
    rejection_error,
    with_request_id,
)
from cbserve_client._generated.cbserve.v1 import generation_pb2, generation_pb2_grpc, types_pb2
from cbserve_client._types import Chunk, Completion, ModelInfo
from cbserve_client.errors import CbserveError, from_rpc_error
from cbserve_client.session import GenerateSession

__all__ = ["ChunkStream", "Client"]

T = TypeVar("T")


class ChunkStream(Closeable, Iterator[Chunk]):
    """An iterator over a streaming call's chunks.

    ``close()`` (or leaving a ``with`` block, or dropping the iterator) cancels the RPC. For
    :meth:`Client.stream` that cancels the request on the server too; for :meth:`Client.results`
    it only stops reading (the request goes on: use :meth:`Client.cancel`).
    """

    def __init__(
        self,
        call: Any,
        extract: Callable[[Any], types_pb2.GenerationChunk],
        request_id: str,
        *,
        timeout: float | None = None,
        raise_rejections: bool = False,
        to_error: Callable[[grpc.RpcError], CbserveError] = from_rpc_error,
        retry: GenerationRetry | None = None,
    ) -> None:
        self._call = call
        self._extract = extract
        self._timeout = timeout
        self._to_error = to_error
        self._retry = retry
        self._raise_rejections = raise_rejections
        #: The id of the request this stream follows.
        self.request_id = request_id

    def __iter__(self) -> ChunkStream:
        return self

    def __next__(self) -> Chunk:
        while True:
            try:
                message = next(self._call)
            except grpc.RpcError as exc:
                error = self._to_error(exc)
                if self._try_again(error):
                    continue
                raise explain_deadline(error, self._timeout) from exc
            chunk = chunk_from_proto(self._extract(message))
            rejection = rejection_error(chunk) if self._raise_rejections else None
            if rejection is not None:
                self.close()
                if self._try_again(rejection):
                    continue
                raise rejection
            if self._retry is not None:
                self._retry.saw(chunk.token_ids, chunk.finished)
            return chunk

    def _try_again(self, error: CbserveError) -> bool:
        """Opens the call anew when ``error`` allows another try (see GenerationRetry)."""
        delay = None if self._retry is None else self._retry.delay(error)
        if self._retry is None or delay is None:
            return False
        time.sleep(delay)
        self._call = self._retry.start(self._retry.time_left())
        return True

    def close(self) -> None:
        """Cancels the RPC (no-op once it has completed)."""
        self._call.cancel()

    cancel = close

    def __del__(self) -> None:
        call = getattr(self, "_call", None)
        if call is not None:
            with contextlib.suppress(Exception):
                call.cancel()


class Client(ChannelOwner):
    """A connection to a cbserve server's GenerationService.

    Args:
        target: the server address, e.g. ``"localhost:50051"``; several replicas as a list
            (``["10.0.0.5:50051", "10.0.0.6:50051"]``, host names resolved once) or as a name that
            resolves to all of them (``"dns:///cbserve.ns.svc.cluster.local:50051"``, re-resolved when
            a connection breaks); or any gRPC target string.
        credentials: TLS channel credentials; None for a plaintext channel.
        token: bearer token sent as ``authorization: Bearer <token>`` on every call, if set.
        timeout: default deadline, in seconds, of unary calls (submit, cancel, model_info); None
            for none.
        stream_timeout: default deadline, in seconds, of streaming calls (generate, stream,
            results), so that a stalled server cannot hold one forever; it caps a whole generation,
            so raise it for long outputs. None for none.
        load_balancing: gRPC's load-balancing policy over the addresses the target gives:
            ``"round_robin"`` (each call on the next ready address whose gRPC health says SERVING:
            dead ones, and ones still loading their model, skipped) or ``"pick_first"`` (one address
            at a time, the next when it fails; health not watched).
        retry_attempts: tries, on UNAVAILABLE, of the read-only calls (model_info, cancel, results;
            admin status: by gRPC, backoff from 0.1 s to 1 s) and of a generation (generate,
            generate_n, stream) that failed before its first token (backoff from 0.1 s, doubling);
            each try goes to the next ready replica. In [1, 5], 1 turns retries off. The deadline
            bounds all tries together.
        keepalive_s: ping a connection that has calls open after this many seconds without reads,
            and drop it (failing its calls with UnavailableError) when no answer comes within
            ``keepalive_timeout_s``: finds a dead server or dropped connection under a long quiet
            stream. None (the default) sends no pings; at least 10.
        options: extra gRPC channel options; they replace the SDK's own of the same name (a
            ``grpc.service_config`` replaces the load balancing, health checking and retry policy).
        interceptors: gRPC client interceptors (``grpc.UnaryUnaryClientInterceptor`` and the other three
            kinds), applied to every call, the first one outermost: a place for logging, metrics or
            headers computed per call.

    Every call also takes ``metadata=``: (key, value) pairs, or a dict, sent as gRPC metadata with that
    call, after ``authorization`` and the trace context (keys lowercase; bytes values under keys ending
    in ``-bin``); a key or value gRPC would refuse raises ValueError naming it.

    Sampling keyword arguments accepted by :meth:`generate`, :meth:`stream` and :meth:`submit`:
    ``max_new_tokens``, ``temperature``, ``top_k``, ``top_p``, ``min_p``, ``seed``, ``eos_token_ids``,
    ``ignore_eos``, ``logprobs``, ``top_logprobs``, ``logprobs_mode`` ("raw_logprobs": of the model's
    logits; "processed_logprobs": of the distribution each token was drawn from, after penalties,
    temperature and top-k/top-p/min-p; unset: the server's default), ``return_kept_mass`` (each
    TokenLogprob also carries ``log_kept_mass``, the log of the mass top-k/top-p/min-p kept; implies
    ``logprobs``; refused for greedy requests), ``prompt_logprobs``, ``stop``
    (strings that end the output, which stops before the first one), ``stop_token_ids`` (token ids that
    end it, included), ``skip_special_tokens``, ``repetition_penalty``, ``presence_penalty``,
    ``frequency_penalty``, ``min_new_tokens``, ``logit_bias`` ({token id: bias}), at most one
    structured-output constraint (``json_schema`` (a dict or its JSON text), ``json_object=True``,
    ``regex`` or ``grammar``), ``request_id``, ``priority`` (smaller first under the server's
    "priority" scheduler), ``record_timestamps``, ``kv_on_weight_update`` ("keep" or "recompute": what
    a weight update while the request lives does to its KV) and, for chat prompts,
    ``add_generation_prompt``. Unset arguments take the server's defaults.
    """

    def __init__(
        self,
        target: str | Sequence[str],
        *,
        credentials: grpc.ChannelCredentials | None = None,
        token: str | None = None,
        timeout: float | None = DEFAULT_TIMEOUT_S,
        stream_timeout: float | None = DEFAULT_STREAM_TIMEOUT_S,
        load_balancing: str = DEFAULT_LOAD_BALANCING,
        retry_attempts: int = DEFAULT_RETRY_ATTEMPTS,
        keepalive_s: float | None = None,
        keepalive_timeout_s: float = DEFAULT_KEEPALIVE_TIMEOUT_S,
        options: Sequence[tuple[str, Any]] = (),
        interceptors: Sequence[Interceptor] = (),
    ) -> None:
        settings = ChannelSettings(load_balancing, retry_attempts, keepalive_s, keepalive_timeout_s)
        super().__init__(target, credentials, token, timeout, options, settings, interceptors)
        self.stream_timeout = stream_timeout
        self._stub: Any = generation_pb2_grpc.GenerationServiceStub(self._channel)
        self._any_replica_stub: Any = None

    def _timeout(self, timeout: Timeout) -> float | None:
        return resolve_timeout(timeout, self.timeout)

    def _stub_to_any_replica(self) -> Any:
        if self._any_replica_stub is None:
            self._any_replica_stub = generation_pb2_grpc.GenerationServiceStub(self._channel_to_any_replica())
        return self._any_replica_stub

    def _serving_first(self, invoke: Callable[[Any], T]) -> T:
        """``invoke(stub)`` on the client's channel, which sends a call only to a replica whose health
        says SERVING; when none does, ``invoke`` again on a channel that sends it to any replica, so that
        the server says why it refuses the call (its model still loading, asleep, draining, ...), or
        serves it, having just become ready. round_robin fails such a call at once, so the second try
        has the whole deadline. Raises grpc.RpcError."""
        try:
            return invoke(self._stub)
        except grpc.RpcError as exc:
            if not no_replica_serving(exc):
                raise
        return invoke(self._stub_to_any_replica())

    # -- generation --------------------------------------------------------------------------

    def generate(
        self,
        prompt: Prompt,
        *,
        timeout: Timeout = DEFAULT_TIMEOUT,
        metadata: MetadataArg = (),
        **sampling: Any,
    ) -> Completion:
        """Generates a completion for ``prompt`` and returns it whole.

        ``prompt``: text (str), token ids (list of int), or chat messages (list of
        ``{"role": ..., "content": ...}``). A request rejected by the server raises the matching
        :class:`~cbserve_client.errors.CbserveError`; a request that fails while running returns a
        Completion with ``finish_reason == "error"`` and ``error`` set. ``timeout`` bounds the whole
        call (default: the client's ``stream_timeout``; None for no deadline). ``n`` > 1 is refused
        (ValueError): :meth:`generate_n` returns every completion.
        """
        num_sequences(sampling, many=False)
        [completion] = self._generate(prompt, 1, timeout, metadata, sampling)
        return completion

    def generate_n(
        self,
        prompt: Prompt,
        n: int,
        *,
        timeout: Timeout = DEFAULT_TIMEOUT,
        metadata: MetadataArg = (),
        **sampling: Any,
    ) -> list[Completion]:
        """Samples ``n`` completions of ``prompt`` in one request (``SamplingParams.n``): the server
        computes the prompt once and shares its KV cache between the sequences. Returns them by
        ``index``; with a ``seed``, completion i is the one a single request seeded with seed + i
        gives. Otherwise as :meth:`generate`."""
        sampling = {**sampling, "n": n}
        return self._generate(prompt, num_sequences(sampling, many=True), timeout, metadata, sampling)

    def _generate(
        self, prompt: Prompt, n: int, timeout: Timeout, metadata: MetadataArg, sampling: dict[str, Any]
    ) -> list[Completion]:
        with self.stream(prompt, timeout=timeout, metadata=metadata, **sampling) as stream:
            return CompletionsBuilder(stream.request_id, n, sampling).collect(stream)

    def stream(
        self,
        prompt: Prompt,
        *,
        timeout: Timeout = DEFAULT_TIMEOUT,
        metadata: MetadataArg = (),
        **sampling: Any,
    ) -> ChunkStream:
        """Starts generating and returns an iterator over the output chunks, as they come.

        Runs on the bidirectional ``Generate`` RPC: closing the iterator before the request
        finished (``close()``, leaving a ``with`` block, ``break`` then dropping it) cancels the
        RPC, and the server then cancels the request and frees its KV cache. ``timeout`` bounds the
        whole stream (default: the client's ``stream_timeout``; None for no deadline). A call that
        fails with UNAVAILABLE before its first token (the server still loading or draining, a
        replica killed) is tried again, up to ``retry_attempts`` tries; after it, the error is raised.
        """
        request = build_request(prompt, **with_request_id(sampling))
        deadline, call_metadata = resolve_timeout(timeout, self.stream_timeout), self._metadata(metadata)

        def start(left: float | None) -> Any:
            def open_on(stub: Any) -> Any:
                messages = iter([generation_pb2.GenerateRequest(add=request)])
                return stub.Generate(messages, timeout=left, metadata=call_metadata)

            return ServingFirstCall(open_on, self._stub, self._stub_to_any_replica)

        return ChunkStream(
            call_once(lambda: start(deadline), self._error),
            _generate_chunk,
            request.request_id,
            timeout=deadline,
            raise_rejections=True,
            to_error=self._error,
            retry=GenerationRetry(start, self._retry_attempts, deadline),
        )

    def session(self, *, metadata: MetadataArg = ()) -> GenerateSession:
        """Opens one ``Generate`` call for many requests, whose chunks the server sends batched, one message
        per engine step (see :class:`GenerateSession`): ``with client.session() as session:`` then
        ``session.stream(...)`` or ``session.generate(...)`` from any thread. The call has no deadline: each
        request's ``timeout`` (default: the client's ``stream_timeout``) bounds that request only. Requests
        are not retried: a session whose call fails raises the error from every unfinished request. The call
        goes to a replica as :meth:`stream`'s does: one whose health says SERVING, else any replica.
        """
        call_metadata = self._metadata(metadata)

        def open_call(messages: Callable[[], Iterator[generation_pb2.GenerateRequest]]) -> ServingFirstCall:
            return ServingFirstCall(
                lambda stub: stub.Generate(messages(), metadata=call_metadata),
                self._stub,
                self._stub_to_any_replica,
            )

        return GenerateSession(open_call, self._error, self.stream_timeout)

    def submit(
        self,
        prompt: Prompt,
        *,
        timeout: Timeout = DEFAULT_TIMEOUT,
        metadata: MetadataArg = (),
        **sampling: Any,
    ) -> str:
        """Queues a request (``AddRequest``) and returns its id without waiting for any output.

        Read the outputs with :meth:`results`. Retried (3 tries, exponential backoff) when the
        server answers UNAVAILABLE or RESOURCE_EXHAUSTED, which mean that nothing was queued. The
        request id is chosen client-side when not given, so a retry can never queue it twice.
        """
        request = build_request(prompt, **with_request_id(sampling))
        message = generation_pb2.AddRequestRequest(request=request)
        call_metadata = self._metadata(metadata)

        def attempt(left: float | None) -> str:
            response = self._serving_first(
                lambda stub: stub.AddRequest(message, timeout=left, metadata=call_metadata)
            )
            return str(response.request_id)

        return call_with_retry(
            attempt,
            timeout=self._timeout(timeout),
            on_already_exists=lambda: request.request_id,
            to_error=self._error,
        )

    def results(
        self,
        request_id: str,
        from_index: int = 0,
        *,
        timeout: Timeout = DEFAULT_TIMEOUT,
        metadata: MetadataArg = (),
    ) -> ChunkStream:
        """Streams the outputs of a request (``StreamResults``) from token index ``from_index`` on.

        To resume after a broken connection, pass the number of tokens already received.
        Closing this iterator does not cancel the request. ``timeout``: as for :meth:`stream`.
        """
        message = generation_pb2.StreamResultsRequest(request_id=request_id, from_token_index=from_index)
        deadline, call_metadata = resolve_timeout(timeout, self.stream_timeout), self._metadata(metadata)
        call = call_once(
            lambda: ServingFirstCall(
                lambda stub: stub.StreamResults(message, timeout=deadline, metadata=call_metadata),
                self._stub,
                self._stub_to_any_replica,
            ),
            self._error,
        )
        return ChunkStream(call, _results_chunk, request_id, timeout=deadline, to_error=self._error)

    def cancel(
        self,
        request_id: str,
        *,
        index: int | None = None,
        timeout: Timeout = DEFAULT_TIMEOUT,
        metadata: MetadataArg = (),
    ) -> bool:
        """Cancels a request, or with ``index`` only that sequence of it (``n`` > 1). Returns True if it
        was live, False if it had already ended (also when a retry follows a first try whose answer was
        lost). Retried on UNAVAILABLE (``retry_attempts``)."""
        message = cancel_message(request_id, index)
        deadline, call_metadata = self._timeout(timeout), self._metadata(metadata)
        response = call_once(
            lambda: self._serving_first(
                lambda stub: stub.Cancel(message, timeout=deadline, metadata=call_metadata)
            ),
            self._error,
        )
        return bool(response.cancelled)

    def model_info(self, *, timeout: Timeout = DEFAULT_TIMEOUT, metadata: MetadataArg = ()) -> ModelInfo:
        """Describes the served model. Retried on UNAVAILABLE (``retry_attempts``)."""
        message = generation_pb2.GetModelInfoRequest()
        deadline, call_metadata = self._timeout(timeout), self._metadata(metadata)
        response = call_once(
            lambda: self._serving_first(
                lambda stub: stub.GetModelInfo(message, timeout=deadline, metadata=call_metadata)
            ),
            self._error,
        )
        return model_info_from_proto(response)


def _generate_chunk(message: generation_pb2.GenerateResponse) -> types_pb2.GenerationChunk:
    return message.chunk


def _results_chunk(message: generation_pb2.StreamResultsResponse) -> types_pb2.GenerationChunk:
    return message.chunk
