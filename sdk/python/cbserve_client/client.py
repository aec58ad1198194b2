"""Synchronous client of the cbserve GenerationService."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc

from cbserve_client._call import (
    DEFAULT_TIMEOUT,
    Timeout,
    call_once,
    call_with_retry,
    resolve_timeout,
)
from cbserve_client._channel import ChannelOwner, Closeable
from cbserve_client._convert import (
    CompletionBuilder,
    Prompt,
    build_request,
    chunk_from_proto,
    model_info_from_proto,
    new_request_id,
    rejection_error,
)
from cbserve_client._generated.cbserve.v1 import generation_pb2, generation_pb2_grpc, types_pb2
from cbserve_client._types import Chunk, Completion, ModelInfo
from cbserve_client.errors import from_rpc_error

__all__ = ["ChunkStream", "Client"]

DEFAULT_TIMEOUT_S = 60.0


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
        raise_rejections: bool = False,
    ) -> None:
        self._call = call
        self._extract = extract
        self._raise_rejections = raise_rejections
        #: The id of the request this stream follows.
        self.request_id = request_id

    def __iter__(self) -> ChunkStream:
        return self

    def __next__(self) -> Chunk:
        try:
            message = next(self._call)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from exc
        chunk = chunk_from_proto(self._extract(message))
        if self._raise_rejections:
            error = rejection_error(chunk)
            if error is not None:
                self.close()
                raise error
        return chunk

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
        target: the server address, e.g. ``"localhost:50051"`` (any gRPC target string, such as
            ``"dns:///cbserve.ns.svc:50051"`` with ``options=[("grpc.lb_policy_name", "round_robin")]``).
        credentials: TLS channel credentials; None for a plaintext channel.
        token: bearer token sent as ``authorization: Bearer <token>`` on every call, if set.
        timeout: default deadline, in seconds, of unary calls (submit, cancel, model_info).
            Streaming calls (generate, stream, results) have no deadline unless given one.
        options: extra gRPC channel options.

    Sampling keyword arguments accepted by :meth:`generate`, :meth:`stream` and :meth:`submit`:
    ``max_new_tokens``, ``temperature``, ``top_k``, ``top_p``, ``seed``, ``eos_token_ids``,
    ``ignore_eos``, ``logprobs``, ``top_logprobs``, ``stop`` (strings that end the output, which stops
    before the first one), ``repetition_penalty``, ``presence_penalty``, ``frequency_penalty``,
    ``min_new_tokens``, ``logit_bias`` ({token id: bias}), ``request_id``, ``record_timestamps`` and,
    for chat prompts, ``add_generation_prompt``. Unset arguments take the server's defaults.
    """

    def __init__(
        self,
        target: str,
        *,
        credentials: grpc.ChannelCredentials | None = None,
        token: str | None = None,
        timeout: float | None = DEFAULT_TIMEOUT_S,
        options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        super().__init__(target, credentials, token, timeout, options)
        self._stub: Any = generation_pb2_grpc.GenerationServiceStub(self._channel)

    def _timeout(self, timeout: Timeout) -> float | None:
        return resolve_timeout(timeout, self.timeout)

    # -- generation --------------------------------------------------------------------------

    def generate(self, prompt: Prompt, *, timeout: float | None = None, **sampling: Any) -> Completion:
        """Generates a completion for ``prompt`` and returns it whole.

        ``prompt``: text (str), token ids (list of int), or chat messages (list of
        ``{"role": ..., "content": ...}``). A request rejected by the server raises the matching
        :class:`~cbserve_client.errors.CbserveError`; a request that fails while running returns a
        Completion with ``finish_reason == "error"`` and ``error`` set.
        """
        with self.stream(prompt, timeout=timeout, **sampling) as stream:
            builder = CompletionBuilder(stream.request_id)
            for chunk in stream:
                if chunk.request_id != stream.request_id:
                    continue
                builder.add(chunk)
                if builder.done:
                    break
        return builder.build(
            logprobs_requested=bool(sampling.get("logprobs") or sampling.get("top_logprobs")),
            timestamps_requested=bool(sampling.get("record_timestamps")),
        )

    def stream(self, prompt: Prompt, *, timeout: float | None = None, **sampling: Any) -> ChunkStream:
        """Starts generating and returns an iterator over the output chunks, as they come.

        Runs on the bidirectional ``Generate`` RPC: closing the iterator before the request
        finished (``close()``, leaving a ``with`` block, ``break`` then dropping it) cancels the
        RPC, and the server then cancels the request and frees its KV cache.
        """
        sampling.setdefault("request_id", None)
        if sampling["request_id"] is None:
            sampling["request_id"] = new_request_id()
        request = build_request(prompt, **sampling)
        call = call_once(
            lambda: self._stub.Generate(
                iter([generation_pb2.GenerateRequest(add=request)]),
                timeout=timeout,
                metadata=self._metadata(),
            )
        )
        return ChunkStream(call, _generate_chunk, request.request_id, raise_rejections=True)

    def submit(self, prompt: Prompt, *, timeout: Timeout = DEFAULT_TIMEOUT, **sampling: Any) -> str:
        """Queues a request (``AddRequest``) and returns its id without waiting for any output.

        Read the outputs with :meth:`results`. Retried (3 tries, exponential backoff) when the
        server answers UNAVAILABLE or RESOURCE_EXHAUSTED, which mean that nothing was queued. The
        request id is chosen client-side when not given, so a retry can never queue it twice.
        """
        sampling.setdefault("request_id", None)
        if sampling["request_id"] is None:
            sampling["request_id"] = new_request_id()
        request = build_request(prompt, **sampling)
        message = generation_pb2.AddRequestRequest(request=request)
        metadata = self._metadata()

        def attempt(left: float | None) -> str:
            response = self._stub.AddRequest(message, timeout=left, metadata=metadata)
            return str(response.request_id)

        return call_with_retry(
            attempt,
            timeout=self._timeout(timeout),
            on_already_exists=lambda: request.request_id,
        )

    def results(self, request_id: str, from_index: int = 0, *, timeout: float | None = None) -> ChunkStream:
        """Streams the outputs of a request (``StreamResults``) from token index ``from_index`` on.

        To resume after a broken connection, pass the number of tokens already received.
        Closing this iterator does not cancel the request.
        """
        message = generation_pb2.StreamResultsRequest(request_id=request_id, from_token_index=from_index)
        metadata = self._metadata()
        call = call_once(lambda: self._stub.StreamResults(message, timeout=timeout, metadata=metadata))
        return ChunkStream(call, _results_chunk, request_id)

    def cancel(self, request_id: str, *, timeout: Timeout = DEFAULT_TIMEOUT) -> bool:
        """Cancels a request. Returns True if it was live, False if it had already ended."""
        message = generation_pb2.CancelRequest(request_id=request_id)
        response = call_once(
            lambda: self._stub.Cancel(message, timeout=self._timeout(timeout), metadata=self._metadata())
        )
        return bool(response.cancelled)

    def model_info(self, *, timeout: Timeout = DEFAULT_TIMEOUT) -> ModelInfo:
        """Describes the served model."""
        message = generation_pb2.GetModelInfoRequest()
        deadline, metadata = self._timeout(timeout), self._metadata()
        response = call_once(lambda: self._stub.GetModelInfo(message, timeout=deadline, metadata=metadata))
        return model_info_from_proto(response)


def _generate_chunk(message: generation_pb2.GenerateResponse) -> types_pb2.GenerationChunk:
    return message.chunk


def _results_chunk(message: generation_pb2.StreamResultsResponse) -> types_pb2.GenerationChunk:
    return message.chunk
