"""`vllm.grpc.engine.VllmEngine`, the gRPC protocol gateways route on (SMG, the Kubernetes inference
gateway's endpoint picker, Dynamo), served beside cbserve's own GenerationService on the same port.

Token ids in, token ids out: the gateway tokenizes, applies chat templates and detokenizes. Requests from
both protocols share the engine, its queue and prefix cache, the metrics and the traces
(service.request_intake). Stubs come from the PyPI package `smg-grpc-proto`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from importlib.metadata import version

import grpc
from cbserve_client.proto import types_pb2
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2, vllm_engine_pb2_grpc

from engine import EngineBusyError, FinishReason, RequestStatus
from service.host_slot import HostSlot
from service.kv_event_stream import StreamAborted
from service.metrics import NO_METRICS, MetricsObserver
from service.request_intake import RequestIntake
from service.request_record import RequestRecord
from service.sequence_group import merged
from service.tokenizer_archive import archive_chunks, build_tokenizer_archive
from service.tracing import RequestTracer, parent_context
from service.vllm_requests import prepare_vllm_request, vllm_span_attributes

logger = logging.getLogger(__name__)

# vLLM's finish reasons: a stop string and an EOS or stop token id are both "stop".
_FINISH_REASONS = {
    FinishReason.EOS: "stop",
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.CANCELLED: "abort",
    FinishReason.ERROR: "error",
}
SERVER_TYPE = "cbserve-grpc"
# How often FlushCache looks again for an idle engine while its timeout_s lasts.
FLUSH_RETRY_INTERVAL_S = 0.05


class VllmEngineServicer(vllm_engine_pb2_grpc.VllmEngineServicer):
    def __init__(self, slot: HostSlot, tracer: RequestTracer, metrics: MetricsObserver = NO_METRICS) -> None:
        self.slot = slot
        self.intake = RequestIntake(tracer, metrics)
        self.started_at = time.monotonic()
        self.last_receive_timestamp = 0.0
        self._tokenizer_archive: tuple[bytes, str] | None = None
        self._tokenizer_archive_lock = asyncio.Lock()

    # ------------------------------------------------------------------ generation

    async def Generate(
        self, request: vllm_engine_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[vllm_engine_pb2.GenerateResponse]:
        host = await self.slot.require(context)
        self.last_receive_timestamp = time.time()
        wants_logprobs = request.sampling_params.HasField("logprobs")
        # The gateway detokenizes: text is decoded here only to match stop strings. A refusal escapes as
        # RequestRejected, which ends the call with its status (service.message_decoding).
        group = self.intake.submit(
            host,
            vllm_span_attributes(request),
            lambda: prepare_vllm_request(request, host),
            parent_context(context.invocation_metadata()),
            detokenize=False,
        )
        # With n > 1, each sequence streams its chunks and ends with its own completion, marked with its
        # index; the call ends after the last.
        updates = merged([record.token_ranges(0, send_current=False) for record in group.records])
        try:
            async for index, (start, end, finished) in updates:
                record = group.records[index]
                if request.stream and end > start:
                    yield vllm_engine_pb2.GenerateResponse(
                        chunk=_stream_chunk(record, start, end, wants_logprobs)
                    )
                if not finished:
                    continue
                if record.status == RequestStatus.FAILED:
                    await context.abort(grpc.StatusCode.INTERNAL, record.error or "the engine failed")
                # Streaming, the completion repeats the last delta, as vLLM's servicer does (the gateway
                # has added up the chunks); otherwise it carries the whole output.
                complete = _complete(record, start if request.stream else 0, end, wants_logprobs)
                yield vllm_engine_pb2.GenerateResponse(complete=complete)
        finally:
            await updates.aclose()
            # However the call ends (client gone, deadline, abort): an unfinished request frees its blocks.
            if not group.finished:
                host.cancel(group.request_id)

    async def Abort(
        self, request: vllm_engine_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> vllm_engine_pb2.AbortResponse:
        host = await self.slot.require(context)
        for request_id in request.request_ids:
            host.cancel(request_id)
        return vllm_engine_pb2.AbortResponse()

    async def Embed(
        self, request: vllm_engine_pb2.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> vllm_engine_pb2.EmbedResponse:
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED,
            "Embed: cbserve serves generation models; embeddings are not supported",
        )
        raise AssertionError("context.abort raises")

    # ------------------------------------------------------------------ state of the engine

    async def HealthCheck(
        self, request: vllm_engine_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> vllm_engine_pb2.HealthCheckResponse:
        host = self.slot.host
        if host is None:
            return vllm_engine_pb2.HealthCheckResponse(healthy=False, message="the model is still loading")
        unavailable = host.unavailable_reason()
        if unavailable is None:
            return vllm_engine_pb2.HealthCheckResponse(healthy=True, message="serving")
        return vllm_engine_pb2.HealthCheckResponse(healthy=False, message=unavailable)

    async def GetModelInfo(
        self, request: vllm_engine_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> vllm_engine_pb2.GetModelInfoResponse:
        host = await self.slot.require(context)
        config = host.model.config
        generation_config = getattr(host.model, "generation_config", None)
        info = vllm_engine_pb2.GetModelInfoResponse(
            model_path=host.model_path,
            is_generation=True,
            max_context_length=host.limits.max_context_length,
            vocab_size=host.limits.vocab_size,
            served_model_name=host.model_name,
            tokenizer_path=host.model_path,
            model_type=str(getattr(config, "model_type", "") or ""),
            architectures=list(getattr(config, "architectures", None) or [type(host.model).__name__]),
            eos_token_ids=host.eos_token_ids,
            max_req_input_len=host.limits.max_context_length - 1,
            default_sampling_params_json=json.dumps(_default_sampling(generation_config)),
        )
        for field, name in (("pad_token_id", "pad_token_id"), ("bos_token_id", "bos_token_id")):
            value = getattr(generation_config, name, None)
            if value is None:
                value = getattr(config, name, None)
            if isinstance(value, int):
                setattr(info, field, value)
        return info

    async def GetServerInfo(
        self, request: vllm_engine_pb2.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> vllm_engine_pb2.GetServerInfoResponse:
        host = await self.slot.require(context)
        stats = host.stats()
        return vllm_engine_pb2.GetServerInfoResponse(
            active_requests=host.num_live_requests,
            is_paused=stats.paused,
            last_receive_timestamp=self.last_receive_timestamp,
            uptime_seconds=time.monotonic() - self.started_at,
            server_type=SERVER_TYPE,
            data_parallel_size=1,
            kv_cache_dtype="auto",
            block_size=host.page_size,
            attention_backend="cbserve_paged_sdpa",
            model_dtype=str(host.dtype),
            max_num_seqs=host.max_requests_per_batch,
        )

    async def GetLoads(
        self, request: vllm_engine_pb2.GetLoadsRequest, context: grpc.aio.ServicerContext
    ) -> vllm_engine_pb2.GetLoadsResponse:
        host = await self.slot.require(context)
        response = vllm_engine_pb2.GetLoadsResponse(
            timestamp=datetime.now(UTC).isoformat(), version=version("cbserve"), dp_rank_count=1
        )
        if request.HasField("dp_rank") and request.dp_rank != 0:
            return response
        load = host.engine_load()
        response.loads.append(
            vllm_engine_pb2.SchedulerLoad(
                dp_rank=0,
                num_running_reqs=load.running_requests,
                num_waiting_reqs=load.waiting_requests,
                num_total_reqs=load.running_requests + load.waiting_requests,
                num_used_tokens=load.num_used_tokens,
                max_total_num_tokens=load.max_total_num_tokens,
                token_usage=load.token_usage,
                gen_throughput=load.gen_throughput,
                cache_hit_rate=load.cache_hit_rate,
                utilization=load.token_usage,
                max_running_requests=load.max_running_requests,
                num_waiting_uncached_tokens=min(load.waiting_uncached_tokens, 2**31 - 1),
            )
        )
        return response

    async def GetTokenizer(
        self, request: common_pb2.GetTokenizerRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.GetTokenizerChunk]:
        host = await self.slot.require(context)
        if host.tokenizer is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "the served model has no tokenizer")
        if not hasattr(host.tokenizer, "save_pretrained"):
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "the served model's tokenizer is not a transformers tokenizer and cannot be exported",
            )
        async with self._tokenizer_archive_lock:
            if self._tokenizer_archive is None:
                generation_config = getattr(host.model, "generation_config", None)
                self._tokenizer_archive = await asyncio.get_running_loop().run_in_executor(
                    None, build_tokenizer_archive, host.tokenizer, host.model.config, generation_config
                )
        data, digest = self._tokenizer_archive
        chunks = archive_chunks(data)
        for index, piece in enumerate(chunks):
            yield common_pb2.GetTokenizerChunk(data=piece, sha256=digest if index == len(chunks) - 1 else "")

    async def FlushCache(
        self, request: common_pb2.FlushCacheRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.FlushCacheResponse:
        host = await self.slot.require(context)
        # The protocol's contract: wait up to timeout_s for the engine to go idle, then flush; with 0, a
        # flush with requests in flight fails at once. A refusal is an answer (success false, saying
        # why), not an error status.
        if not math.isfinite(request.timeout_s) or request.timeout_s < 0:
            message = f"timeout_s must be finite and >= 0, got {request.timeout_s}"
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
        deadline = time.monotonic() + request.timeout_s
        loop = asyncio.get_running_loop()
        while True:
            try:
                reset = await loop.run_in_executor(None, host.admin.reset_prefix_cache)
            except EngineBusyError as exc:
                if time.monotonic() >= deadline:
                    return common_pb2.FlushCacheResponse(success=False, message=str(exc))
                await asyncio.sleep(FLUSH_RETRY_INTERVAL_S)
                continue
            return common_pb2.FlushCacheResponse(
                success=True, message=f"dropped {reset.num_blocks} cached blocks"
            )

    async def StartProfile(
        self, request: common_pb2.StartProfileRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.ProfileResponse:
        return _no_profiler()

    async def StopProfile(
        self, request: common_pb2.StopProfileRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.ProfileResponse:
        return _no_profiler()

    async def SubscribeKvEvents(
        self, request: common_pb2.SubscribeKvEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.KvEventBatch]:
        host = await self.slot.require(context)
        # A gateway gives a subscription two seconds to answer (SMG marks the replica unreachable
        # otherwise), and the first batch may be a while: answer the call at once.
        await context.send_initial_metadata(())
        batches = host.kv_events.subscribe(
            request.start_sequence_number, request.load_records_before_first_batch
        )
        try:
            async for batch in batches:
                yield batch
        except StreamAborted as exc:
            await context.abort(exc.code, exc.message)


def _stream_chunk(
    record: RequestRecord, start: int, end: int, wants_logprobs: bool
) -> vllm_engine_pb2.GenerateStreamChunk:
    """Tokens [start, end); counts are of the delta, as vLLM's streaming chunks carry them."""
    token_ids = record.token_ids[start:end]
    stream_chunk = vllm_engine_pb2.GenerateStreamChunk(
        token_ids=token_ids,
        prompt_tokens=record.prompt_len,
        completion_tokens=len(token_ids),
        cached_tokens=record.num_cached_tokens,
        index=record.index,
    )
    if wants_logprobs:
        stream_chunk.output_logprobs.CopyFrom(_output_logprobs(token_ids, record.token_logprobs(start, end)))
    return stream_chunk


def _complete(
    record: RequestRecord, start: int, end: int, wants_logprobs: bool
) -> vllm_engine_pb2.GenerateComplete:
    """The end of a request, carrying tokens [start, end)."""
    token_ids = record.token_ids[start:end]
    complete = vllm_engine_pb2.GenerateComplete(
        output_ids=token_ids,
        finish_reason=_FINISH_REASONS[record.finish_reason or FinishReason.ERROR],
        prompt_tokens=record.prompt_len,
        completion_tokens=len(token_ids),
        cached_tokens=record.num_cached_tokens,
        index=record.index,
    )
    if wants_logprobs:
        complete.output_logprobs.CopyFrom(_output_logprobs(token_ids, record.token_logprobs(start, end)))
    if record.prompt_logprobs:
        complete.input_logprobs.CopyFrom(_input_logprobs(record))
    # Which stop ended the output (vLLM names none for an EOS): a stop string or a stop token id.
    if isinstance(record.stop_reason, str):
        complete.matched_stop_str = record.stop_reason
    elif record.stop_reason is not None:
        complete.matched_token_id = record.stop_reason
    return complete


def _input_logprobs(record: RequestRecord) -> vllm_engine_pb2.InputLogProbs:
    """Prompt logprobs as vLLM sends them: the first prompt token has none (an empty entry)."""
    output = vllm_engine_pb2.InputLogProbs(
        token_ids=[record.prompt_token_ids[0]] if record.prompt_token_ids else []
    )
    output.token_logprobs.append(vllm_engine_pb2.InputTokenLogProb())
    output.top_logprobs.append(vllm_engine_pb2.TopLogProbs())
    for entry in record.prompt_logprobs:
        output.token_ids.append(entry.token_id)
        output.token_logprobs.append(vllm_engine_pb2.InputTokenLogProb(value=entry.logprob))
        output.top_logprobs.append(
            vllm_engine_pb2.TopLogProbs(
                values=[top.logprob for top in entry.top_logprobs],
                token_ids=[top.token_id for top in entry.top_logprobs],
            )
        )
    return output


def _output_logprobs(
    token_ids: list[int], logprobs: list[types_pb2.TokenLogprob]
) -> vllm_engine_pb2.OutputLogProbs:
    output = vllm_engine_pb2.OutputLogProbs(token_ids=token_ids)
    for logprob in logprobs:
        output.token_logprobs.append(logprob.logprob)
        output.top_logprobs.append(
            vllm_engine_pb2.TopLogProbs(
                values=[top.logprob for top in logprob.top_logprobs],
                token_ids=[top.token_id for top in logprob.top_logprobs],
            )
        )
    return output


def _default_sampling(generation_config: object) -> dict[str, object]:
    """The model's own sampling defaults, as vLLM reports its generation config's."""
    defaults = {}
    for name in ("temperature", "top_p", "top_k", "repetition_penalty", "max_new_tokens"):
        value = getattr(generation_config, name, None)
        if value is not None:
            defaults[name] = value
    return defaults


def _no_profiler() -> common_pb2.ProfileResponse:
    return common_pb2.ProfileResponse(
        success=False,
        message="cbserve runs no profiler behind this RPC; profile the engine in-process (torch.profiler)",
    )
