"""A `vllm.grpc.engine` GenerateRequest as cbserve's own GenerationRequest, with vLLM's defaults.

Both protocols then share one path into the engine (service.generation_servicer.submit: validation, the
queue, traces and metrics). The differences are vLLM's, applied here:

- an unset temperature samples at 1.0; top_p 0, top_k 0 and repetition_penalty 0 mean "off";
- an unset max_tokens generates until the context (or the KV cache) is full, not to the model's default;
- stop_token_ids end the output in addition to the model's EOS ids, and still do under ignore_eos;
- skip_special_tokens and spaces_between_special_tokens are the gateway's: it detokenizes.

A field cbserve does not serve (n > 1, a structural tag or a choice constraint, multimodal input, KV
transfer, a pinned data-parallel rank, all-vocabulary logprobs) fails the request with INVALID_ARGUMENT
naming it, never ignored. Errors name vLLM's fields, not cbserve's.
"""

from __future__ import annotations

import re

from cbserve_client.proto import types_pb2
from smg_grpc_proto.generated import vllm_engine_pb2

from service.engine_host import EngineHost
from service.validation import RequestRejected, invalid

# vLLM's default temperature when a request leaves it unset.
VLLM_DEFAULT_TEMPERATURE = 1.0

# cbserve's wire field -> vLLM's, for error messages.
_FIELD_NAMES = {
    "sampling.max_new_tokens": "sampling_params.max_tokens",
    "sampling.min_new_tokens": "sampling_params.min_tokens",
    "sampling.top_logprobs": "sampling_params.logprobs",
    "sampling.structured_output.spec": "sampling_params.constraint",
    "sampling.structured_output": "sampling_params.constraint",
    "max_new_tokens": "max_tokens",
    "token_ids": "tokenized.input_ids",
    "sampling.": "sampling_params.",
}
# A name only where a field name starts: "token_ids" inside "stop_token_ids" is not the prompt's.
_FIELD_PATTERN = re.compile("(?<![A-Za-z_.])(?:" + "|".join(re.escape(name) for name in _FIELD_NAMES) + ")")


def vllm_field_names(message: str) -> str:
    """`message` with cbserve's field names replaced by vLLM's."""
    return _FIELD_PATTERN.sub(lambda match: _FIELD_NAMES[match.group(0)], message)


def to_generation_request(
    request: vllm_engine_pb2.GenerateRequest, host: EngineHost
) -> types_pb2.GenerationRequest:
    """Raises RequestRejected (INVALID_ARGUMENT) naming the first field cbserve cannot serve."""
    _refuse_unsupported(request)
    params = request.sampling_params
    translated = types_pb2.GenerationRequest(request_id=request.request_id)
    prompt_ids = _prompt_ids(request, host)
    translated.token_ids.ids.extend(prompt_ids)
    sampling = translated.sampling
    sampling.temperature = params.temperature if params.HasField("temperature") else VLLM_DEFAULT_TEMPERATURE
    if params.top_p:
        sampling.top_p = params.top_p
    if params.top_k:
        sampling.top_k = params.top_k
    if params.repetition_penalty:
        sampling.repetition_penalty = params.repetition_penalty
    if params.presence_penalty:
        sampling.presence_penalty = params.presence_penalty
    if params.frequency_penalty:
        sampling.frequency_penalty = params.frequency_penalty
    if params.HasField("max_tokens"):
        sampling.max_new_tokens = params.max_tokens
    else:
        sampling.max_new_tokens = max(1, host.max_request_tokens - len(prompt_ids))
    if params.min_tokens:
        sampling.min_new_tokens = params.min_tokens
    if params.HasField("seed"):
        if params.seed < 0:
            raise invalid(f"sampling_params.seed must be >= 0, got {params.seed}")
        sampling.seed = params.seed
    if params.HasField("logprobs"):
        sampling.logprobs = True
        if params.logprobs:
            sampling.top_logprobs = params.logprobs
    for token, bias in params.logit_bias.items():
        if token < 0:
            raise invalid(f"sampling_params.logit_bias: token id {token} is negative")
        sampling.logit_bias[token] = bias
    sampling.stop.extend(params.stop)
    sampling.ignore_eos = params.ignore_eos
    sampling.stop_token_ids.extend(params.stop_token_ids)
    if params.min_p:
        sampling.min_p = params.min_p
    if params.HasField("prompt_logprobs"):
        sampling.prompt_logprobs = params.prompt_logprobs
    if params.n:
        sampling.n = params.n
    constraint = params.WhichOneof("constraint")
    if constraint in ("json_schema", "regex", "grammar"):
        setattr(sampling.structured_output, constraint, getattr(params, constraint))
    elif constraint == "json_object":
        sampling.structured_output.json_object = True
    return translated


def _refuse_unsupported(request: vllm_engine_pb2.GenerateRequest) -> None:
    params = request.sampling_params
    unsupported: list[tuple[bool, str]] = [
        (
            params.WhichOneof("constraint") in ("structural_tag", "choice"),
            f"sampling_params.{params.WhichOneof('constraint')} is not supported: use json_schema, regex, "
            "grammar or json_object",
        ),
        (
            params.HasField("prompt_logprobs") and params.prompt_logprobs < 0,
            "sampling_params.prompt_logprobs: -1 (every token's logprob) is not supported; ask for at "
            "most 20",
        ),
        (
            params.HasField("logprobs") and params.logprobs < 0,
            "sampling_params.logprobs: -1 (every token's logprob) is not supported; ask for at most 20",
        ),
        (params.include_stop_str_in_output, "sampling_params.include_stop_str_in_output is not supported"),
        (
            params.HasField("truncate_prompt_tokens"),
            "sampling_params.truncate_prompt_tokens is not supported",
        ),
        (
            request.HasField("mm_inputs") or len(request.extra_mm_inputs) > 0,
            "mm_inputs: multimodal input is not supported",
        ),
        (request.HasField("media_refs"), "media_refs: multimodal input is not supported"),
        (
            request.HasField("kv_transfer_params") or request.HasField("kv_transfer_params_json"),
            "kv_transfer_params: KV transfer (prefill/decode disaggregation) is not supported",
        ),
        (
            request.HasField("data_parallel_rank") and request.data_parallel_rank != 0,
            f"data_parallel_rank: {request.data_parallel_rank} is not a rank of this server (it has one)",
        ),
    ]
    for refused, message in unsupported:
        if refused:
            raise invalid(message)


def _prompt_ids(request: vllm_engine_pb2.GenerateRequest, host: EngineHost) -> list[int]:
    kind = request.WhichOneof("input")
    if kind == "tokenized":
        ids = list(request.tokenized.input_ids)
        if not ids:
            raise invalid("tokenized.input_ids must not be empty")
        return ids
    if kind == "text":
        if host.tokenizer is None:
            raise invalid("text: the served model has no tokenizer; send tokenized.input_ids")
        if not request.text:
            raise invalid("text must not be empty")
        return list(host.tokenizer(request.text)["input_ids"])
    raise invalid("input: one of tokenized or text must be set")


def reject_with_vllm_names(exc: RequestRejected) -> RequestRejected:
    return RequestRejected(exc.code, vllm_field_names(exc.message))
