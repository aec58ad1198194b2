"""A `vllm.grpc.engine` GenerateRequest as the engine's request, with vLLM's defaults, in one translation.

The checks the two protocols share are service.validation's, with vLLM's field names (`VLLM_NAMES`); the
differences are vLLM's, applied here:

- an unset temperature samples at 1.0; top_p 0, top_k 0, min_p 0 and the penalties 0 mean "off";
- an unset max_tokens generates until the context (or the KV cache) is full, not to the model's default;
- stop_token_ids end the output in addition to the model's EOS ids, and still do under ignore_eos;
- skip_special_tokens and spaces_between_special_tokens are the gateway's: it detokenizes.

A field cbserve does not serve (a structural tag or a choice constraint, multimodal input, KV transfer, a
pinned data-parallel rank, all-vocabulary logprobs) fails the request with INVALID_ARGUMENT naming it,
never ignored. Errors name vLLM's fields, not cbserve's.
"""

from __future__ import annotations

from typing import Any

from smg_grpc_proto.generated import vllm_engine_pb2

from engine import StructuredOutput
from service.engine_host import EngineHost
from service.tracing import (
    OPERATION_NAME,
    OPERATION_TEXT_COMPLETION,
    REQUEST_FREQUENCY_PENALTY,
    REQUEST_MAX_TOKENS,
    REQUEST_PRESENCE_PENALTY,
    REQUEST_SEED,
    REQUEST_STOP_SEQUENCES,
    REQUEST_TEMPERATURE,
    REQUEST_TOP_K,
    REQUEST_TOP_P,
    float32,
)
from service.validation import (
    PreparedRequest,
    WireNames,
    checked_logit_bias,
    checked_max_new_tokens,
    checked_prompt,
    checked_request_id,
    checked_stop_strings,
    invalid,
    sampling_params,
)

# vLLM's default temperature when a request leaves it unset.
VLLM_DEFAULT_TEMPERATURE = 1.0

# The engine's parameter -> vLLM's field, where the names differ (the others are "sampling_params." and
# the engine's name).
VLLM_NAMES = WireNames(
    "sampling_params.",
    {
        "max_new_tokens": "sampling_params.max_tokens",
        "min_new_tokens": "sampling_params.min_tokens",
        "top_logprobs": "sampling_params.logprobs",
        "structured_output": "sampling_params.constraint",
        "structured_output.spec": "sampling_params.constraint",
    },
)

# Sampling fields whose name is the engine's and whose zero (proto3's unset) means "off".
_ZERO_IS_OFF = ("top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


def prepare_vllm_request(request: vllm_engine_pb2.GenerateRequest, host: EngineHost) -> PreparedRequest:
    """Raises RequestRejected (INVALID_ARGUMENT) naming the first field cbserve cannot serve or refuses."""
    _refuse_unsupported(request)
    params = request.sampling_params
    request_id = checked_request_id(request.request_id)
    input_ids = checked_prompt(*_prompt_ids(request, host), host.limits)
    if params.HasField("max_tokens"):
        requested = params.max_tokens
    else:
        requested = max(1, host.max_request_tokens - len(input_ids))
    max_new_tokens = checked_max_new_tokens(requested, len(input_ids), host.limits, VLLM_NAMES)
    return PreparedRequest(
        request_id=request_id,
        input_ids=input_ids,
        sampling=sampling_params(_sampling_settings(params, max_new_tokens), host.limits, VLLM_NAMES),
        record_timestamps=False,
        stop_strings=checked_stop_strings(list(params.stop), host.tokenizer, VLLM_NAMES),
    )


def _sampling_settings(params: vllm_engine_pb2.SamplingParams, max_new_tokens: int) -> dict[str, Any]:
    """The fields the request set, as generate's keyword arguments, with vLLM's defaults."""
    settings: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "temperature": params.temperature if params.HasField("temperature") else VLLM_DEFAULT_TEMPERATURE,
    }
    for name in _ZERO_IS_OFF:
        if getattr(params, name):
            settings[name] = getattr(params, name)
    if params.min_tokens:
        settings["min_new_tokens"] = params.min_tokens
    if params.ignore_eos:
        settings["eos_token_id"] = []  # no EOS id: the request runs to max_tokens (or a stop token id)
    if params.stop_token_ids:
        settings["stop_token_ids"] = list(params.stop_token_ids)
    if params.HasField("seed"):
        if params.seed < 0:
            raise invalid(f"sampling_params.seed must be >= 0, got {params.seed}")
        settings["seed"] = params.seed
    if params.HasField("logprobs"):
        settings["logprobs"] = True
        if params.logprobs:
            settings["top_logprobs"] = params.logprobs
    if params.HasField("prompt_logprobs"):
        settings["prompt_logprobs"] = params.prompt_logprobs
    if params.logit_bias:
        settings["logit_bias"] = checked_logit_bias(params.logit_bias, VLLM_NAMES)
    if params.n:
        settings["n"] = params.n
    constraint = params.WhichOneof("constraint")
    if constraint == "json_object":
        settings["structured_output"] = StructuredOutput("json_object")
    elif constraint is not None:
        settings["structured_output"] = StructuredOutput(constraint, getattr(params, constraint))
    return settings


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


def _prompt_ids(request: vllm_engine_pb2.GenerateRequest, host: EngineHost) -> tuple[str, list[int]]:
    """The prompt's field and its token ids (not yet checked against the vocabulary)."""
    kind = request.WhichOneof("input")
    if kind == "tokenized":
        ids = list(request.tokenized.input_ids)
        if not ids:
            raise invalid("tokenized.input_ids must not be empty")
        return "tokenized.input_ids", ids
    if kind == "text":
        if host.tokenizer is None:
            raise invalid("text: the served model has no tokenizer; send tokenized.input_ids")
        if not request.text:
            raise invalid("text must not be empty")
        return "text", list(host.tokenizer(request.text)["input_ids"])
    raise invalid("input: one of tokenized or text must be set")


def vllm_span_attributes(request: vllm_engine_pb2.GenerateRequest) -> dict[str, Any]:
    """What the caller asked for, as the request's span records it (service.tracing)."""
    params = request.sampling_params
    attributes: dict[str, Any] = {
        OPERATION_NAME: OPERATION_TEXT_COMPLETION,
        REQUEST_TEMPERATURE: float32(
            params.temperature if params.HasField("temperature") else VLLM_DEFAULT_TEMPERATURE
        ),
    }
    if params.HasField("max_tokens"):
        attributes[REQUEST_MAX_TOKENS] = params.max_tokens
    if params.top_p:
        attributes[REQUEST_TOP_P] = float32(params.top_p)
    if params.top_k:
        attributes[REQUEST_TOP_K] = params.top_k
    if params.HasField("seed"):
        attributes[REQUEST_SEED] = params.seed
    if params.stop:
        attributes[REQUEST_STOP_SEQUENCES] = list(params.stop)
    if params.presence_penalty:
        attributes[REQUEST_PRESENCE_PENALTY] = float32(params.presence_penalty)
    if params.frequency_penalty:
        attributes[REQUEST_FREQUENCY_PENALTY] = float32(params.frequency_penalty)
    return attributes
