"""Checks a wire GenerationRequest before the engine sees it and turns it into engine arguments."""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, field
from typing import Any

import grpc
from cbserve_client.proto import types_pb2

# The engine's own bounds: checked here too, so that the error names the wire field.
from engine.manager import MAX_ABS_LOGIT_BIAS, MAX_ABS_PRESENCE_FREQUENCY_PENALTY, MAX_TOP_LOGPROBS

MAX_REQUEST_ID_BYTES = 128
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_LOGIT_BIAS_ENTRIES = 300


class RequestRejected(Exception):
    """A request refused before it reached the engine, with the status code the caller gets."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def invalid(message: str) -> RequestRejected:
    return RequestRejected(grpc.StatusCode.INVALID_ARGUMENT, message)


@dataclass(frozen=True)
class ModelLimits:
    vocab_size: int
    max_context_length: int
    default_max_new_tokens: int


@dataclass
class PreparedRequest:
    """Everything `ContinuousBatchingManager.add_request` needs, already validated."""

    request_id: str
    input_ids: list[int]
    max_new_tokens: int
    record_timestamps: bool
    eos_token_id: list[int] | None
    sampling: dict[str, Any] = field(default_factory=dict)
    # Matched by the service on the decoded text (the engine sees only tokens).
    stop_strings: list[str] = field(default_factory=list)

    @property
    def wants_logprobs(self) -> bool:
        return bool(self.sampling.get("logprobs"))


def prepare(
    request: types_pb2.GenerationRequest, limits: ModelLimits, tokenizer: Any | None
) -> PreparedRequest:
    """Validates every field (INVALID_ARGUMENT naming the first bad one) and fills the defaults."""
    request_id = _request_id(request.request_id)
    input_ids = _prompt_ids(request, limits, tokenizer)
    if len(input_ids) >= limits.max_context_length:
        raise invalid(
            f"prompt: {len(input_ids)} tokens leave no room to generate within the model's context of "
            f"{limits.max_context_length} tokens"
        )
    params = request.sampling
    room = limits.max_context_length - len(input_ids)
    if params.HasField("max_new_tokens"):
        if params.max_new_tokens < 1:
            raise invalid("sampling.max_new_tokens must be >= 1")
        if params.max_new_tokens > room:
            raise invalid(
                f"sampling.max_new_tokens: {len(input_ids)} prompt tokens + {params.max_new_tokens} exceed "
                f"the model's context of {limits.max_context_length} tokens"
            )
        max_new_tokens = params.max_new_tokens
    else:
        max_new_tokens = min(limits.default_max_new_tokens, room)
    return PreparedRequest(
        request_id=request_id,
        input_ids=input_ids,
        max_new_tokens=max_new_tokens,
        record_timestamps=request.record_timestamps,
        eos_token_id=_eos_ids(params, limits),
        sampling=_sampling(params, max_new_tokens, limits),
        stop_strings=_stop_strings(params, tokenizer),
    )


def _request_id(request_id: str) -> str:
    if not request_id:
        return uuid.uuid4().hex
    if len(request_id.encode()) > MAX_REQUEST_ID_BYTES or not all(" " < c <= "~" for c in request_id):
        raise invalid(f"request_id must be at most {MAX_REQUEST_ID_BYTES} bytes of printable ASCII")
    return request_id


def _prompt_ids(
    request: types_pb2.GenerationRequest, limits: ModelLimits, tokenizer: Any | None
) -> list[int]:
    kind = request.WhichOneof("prompt")
    if kind is None:
        raise invalid("prompt: exactly one of token_ids, text or messages must be set")
    if kind == "token_ids":
        ids = list(request.token_ids.ids)
        if not ids:
            raise invalid("token_ids.ids must not be empty")
    elif kind == "text":
        if tokenizer is None:
            raise invalid("text: the served model has no tokenizer; send token_ids")
        if not request.text:
            raise invalid("text must not be empty")
        ids = list(tokenizer(request.text)["input_ids"])
    else:
        ids = _chat_ids(request.messages, tokenizer)
    bad = next((token for token in ids if token >= limits.vocab_size), None)
    if bad is not None:
        raise invalid(f"{kind}: token id {bad} is not below the vocab size {limits.vocab_size}")
    return ids


def _chat_ids(chat: types_pb2.ChatMessages, tokenizer: Any | None) -> list[int]:
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise invalid("messages: the served model has no chat template; send text or token_ids")
    if not chat.messages:
        raise invalid("messages.messages must not be empty")
    add_generation_prompt = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
    rendered = tokenizer.apply_chat_template(
        [{"role": message.role, "content": message.content} for message in chat.messages],
        add_generation_prompt=add_generation_prompt,
        tokenize=True,
        return_dict=True,
    )
    ids = list(rendered["input_ids"])
    if not ids:
        raise invalid("messages: the chat template rendered an empty prompt")
    return ids


def _eos_ids(params: types_pb2.SamplingParams, limits: ModelLimits) -> list[int] | None:
    if params.ignore_eos:
        return []  # an empty set of EOS ids: the request runs to max_new_tokens
    bad = next((token for token in params.eos_token_ids if token >= limits.vocab_size), None)
    if bad is not None:
        raise invalid(f"sampling.eos_token_ids: {bad} is not below the vocab size {limits.vocab_size}")
    return list(params.eos_token_ids) or None


def _penalties(params: types_pb2.SamplingParams, max_new_tokens: int) -> dict[str, Any]:
    penalties: dict[str, Any] = {}
    if params.HasField("repetition_penalty"):
        if not math.isfinite(params.repetition_penalty) or params.repetition_penalty <= 0:
            raise invalid(
                f"sampling.repetition_penalty must be a finite number > 0, got {params.repetition_penalty}"
            )
        penalties["repetition_penalty"] = params.repetition_penalty
    bound = MAX_ABS_PRESENCE_FREQUENCY_PENALTY
    for name in ("presence_penalty", "frequency_penalty"):
        if params.HasField(name):
            value = getattr(params, name)
            if not -bound <= value <= bound:  # NaN fails too
                raise invalid(f"sampling.{name} must be in [-{bound:g}, {bound:g}], got {value}")
            penalties[name] = value
    if params.HasField("min_new_tokens"):
        if params.min_new_tokens > max_new_tokens:
            raise invalid(
                f"sampling.min_new_tokens ({params.min_new_tokens}) must not exceed max_new_tokens "
                f"({max_new_tokens})"
            )
        penalties["min_new_tokens"] = params.min_new_tokens
    return penalties


def _logit_bias(params: types_pb2.SamplingParams, limits: ModelLimits) -> dict[int, float]:
    if len(params.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise invalid(
            f"sampling.logit_bias: at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(params.logit_bias)}"
        )
    bound = MAX_ABS_LOGIT_BIAS
    for token, bias in sorted(params.logit_bias.items()):
        if token >= limits.vocab_size:
            raise invalid(
                f"sampling.logit_bias: token id {token} is not below the vocab size {limits.vocab_size}"
            )
        if not -bound <= bias <= bound:  # NaN fails too
            raise invalid(f"sampling.logit_bias[{token}] must be in [-{bound:g}, {bound:g}], got {bias}")
    return dict(params.logit_bias)


def _stop_strings(params: types_pb2.SamplingParams, tokenizer: Any | None) -> list[str]:
    stop_strings = list(params.stop)
    if not stop_strings:
        return []
    if tokenizer is None:
        raise invalid(
            "sampling.stop: the served model has no tokenizer to decode text with; use eos_token_ids"
        )
    if len(stop_strings) > MAX_STOP_STRINGS:
        raise invalid(f"sampling.stop: at most {MAX_STOP_STRINGS} strings, got {len(stop_strings)}")
    for index, stop in enumerate(stop_strings):
        if not 1 <= len(stop) <= MAX_STOP_STRING_CHARS:
            raise invalid(
                f"sampling.stop[{index}] must be 1 to {MAX_STOP_STRING_CHARS} characters, got {len(stop)}"
            )
    return stop_strings


def _sampling(params: types_pb2.SamplingParams, max_new_tokens: int, limits: ModelLimits) -> dict[str, Any]:
    """Only the fields the caller set, so the engine applies the model's defaults to the rest."""
    sampling: dict[str, Any] = _penalties(params, max_new_tokens)
    if params.logit_bias:
        sampling["logit_bias"] = _logit_bias(params, limits)
    if params.HasField("temperature"):
        if not math.isfinite(params.temperature) or params.temperature < 0:
            raise invalid(f"sampling.temperature must be a finite number >= 0, got {params.temperature}")
        sampling["temperature"] = params.temperature
    if params.HasField("top_p"):
        if not math.isfinite(params.top_p) or not 0 < params.top_p <= 1:
            raise invalid(f"sampling.top_p must be in (0, 1], got {params.top_p}")
        sampling["top_p"] = params.top_p
    if params.HasField("top_k"):
        sampling["top_k"] = params.top_k
    if params.HasField("seed"):
        sampling["seed"] = params.seed
    top_logprobs = params.top_logprobs if params.HasField("top_logprobs") else 0
    if top_logprobs > MAX_TOP_LOGPROBS:
        raise invalid(f"sampling.top_logprobs must be at most {MAX_TOP_LOGPROBS}, got {top_logprobs}")
    if top_logprobs:
        sampling["top_logprobs"] = top_logprobs
    if params.logprobs or top_logprobs:
        sampling["logprobs"] = True
    return sampling
