"""Turns a wire GenerationRequest into the engine's typed request, refusing a bad field with
INVALID_ARGUMENT naming it; the checks both protocols share (service.vllm_requests is the other door).

The sampling rules and their bounds are the engine's (engine.sampling.params); a refusal of the engine's
names the protocol's field through that protocol's `WireNames`. This module adds only what the wire has
and the engine does not: request ids, the prompt's forms, the room the model's context leaves, stop
strings, and a cap on logit_bias entries.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc
from cbserve_client.proto import types_pb2

from engine import (
    InvalidParameterError,
    LogprobsMode,
    SamplingParams,
    StructuredOutput,
    build_sampling_params,
    check_token_ids,
)

MAX_REQUEST_ID_BYTES = 128
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_LOGIT_BIAS_ENTRIES = 300
# GenerationRequest.priority is an int32 on the wire; the in-process API takes the same range.
MIN_PRIORITY = -(2**31)
MAX_PRIORITY = 2**31 - 1


class RequestRejected(Exception):
    """A request refused before it reached the engine, with the status code the caller gets."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def invalid(message: str) -> RequestRejected:
    return RequestRejected(grpc.StatusCode.INVALID_ARGUMENT, message)


@dataclass(frozen=True)
class WireNames:
    """How one protocol names the engine's sampling parameters (generate's keyword arguments) in its
    errors: `prefix` and the engine's name, unless `renamed` gives the whole field name. A parameter's
    part (`logit_bias[5]`, `structured_output.spec`) keeps its suffix after the renamed parameter."""

    prefix: str
    renamed: Mapping[str, str] = field(default_factory=dict)

    def __call__(self, parameter: str) -> str:
        whole = self.renamed.get(parameter)
        if whole is not None:
            return whole
        cut = min((index for index in (parameter.find("["), parameter.find(".")) if index >= 0), default=None)
        base, suffix = (parameter, "") if cut is None else (parameter[:cut], parameter[cut:])
        return self.renamed.get(base, self.prefix + base) + suffix

    def rejected(self, error: InvalidParameterError) -> RequestRejected:
        """The engine's refusal of a parameter, naming the protocol's field (the engine's message starts
        with its own name of the parameter)."""
        return invalid(self(error.field) + str(error)[len(error.field) :])


# cbserve's GenerationRequest.sampling names the engine's parameters after generate's keyword arguments.
CBSERVE_NAMES = WireNames("sampling.", {"eos_token_id": "sampling.eos_token_ids"})


@dataclass(frozen=True)
class ModelLimits:
    vocab_size: int
    max_context_length: int
    # engine.sampling.params.default_max_new_tokens of the model's generation config.
    default_max_new_tokens: int
    # Supplies the defaults of the sampling fields a request leaves unset, as in `generate`.
    generation_config: Any = None
    # The logprobs_mode of a request that leaves it unset (`cbserve serve --logprobs-mode`).
    default_logprobs_mode: str = LogprobsMode.RAW


@dataclass
class PreparedRequest:
    """Everything `ContinuousBatchingManager.add_request` needs, already validated."""

    request_id: str
    input_ids: list[int]
    sampling: SamplingParams
    record_timestamps: bool
    # Matched by the service on the decoded text (the engine sees only tokens).
    stop_strings: list[str] = field(default_factory=list)
    # Whether the text leaves special tokens out (the detokenizer's business, not the engine's).
    skip_special_tokens: bool = True
    priority: int = 0
    kv_on_weight_update: str = "keep"


# GenerationRequest.kv_on_weight_update, as the engine names it (engine.request.KVOnWeightUpdate).
KV_ON_WEIGHT_UPDATE = {
    types_pb2.KV_ON_WEIGHT_UPDATE_UNSPECIFIED: "keep",
    types_pb2.KV_ON_WEIGHT_UPDATE_KEEP: "keep",
    types_pb2.KV_ON_WEIGHT_UPDATE_RECOMPUTE: "recompute",
}


def prepare(
    request: types_pb2.GenerationRequest, limits: ModelLimits, tokenizer: Any | None
) -> PreparedRequest:
    """Validates every field (INVALID_ARGUMENT naming the first bad one) and fills the defaults."""
    request_id = checked_request_id(request.request_id)
    input_ids = checked_prompt(*_prompt_ids(request, tokenizer), limits)
    params = request.sampling
    requested = params.max_new_tokens if params.HasField("max_new_tokens") else None
    max_new_tokens = checked_max_new_tokens(requested, len(input_ids), limits, CBSERVE_NAMES)
    stop_strings = checked_stop_strings(list(params.stop), tokenizer, CBSERVE_NAMES)
    settings = _sampling_settings(params, max_new_tokens, limits)
    return PreparedRequest(
        request_id=request_id,
        input_ids=input_ids,
        sampling=sampling_params(settings, limits, _cbserve_names(settings)),
        record_timestamps=request.record_timestamps,
        stop_strings=stop_strings,
        skip_special_tokens=params.skip_special_tokens if params.HasField("skip_special_tokens") else True,
        priority=request.priority,
        kv_on_weight_update=_kv_on_weight_update(request.kv_on_weight_update),
    )


def _kv_on_weight_update(value: int) -> str:
    if value not in KV_ON_WEIGHT_UPDATE:
        raise invalid(f"kv_on_weight_update must be one of {sorted(KV_ON_WEIGHT_UPDATE)}, got {value}")
    return KV_ON_WEIGHT_UPDATE[value]


def _cbserve_names(settings: Mapping[str, Any]) -> WireNames:
    """CBSERVE_NAMES for one request: the engine names a constraint's text `structured_output.spec`, which
    on the wire is the member of StructuredOutput's oneof the request set (`sampling.structured_output.regex`
    for a regex)."""
    constraint = settings.get("structured_output")
    if constraint is None:
        return CBSERVE_NAMES
    spec_field = f"sampling.structured_output.{constraint.kind}"
    return WireNames(CBSERVE_NAMES.prefix, {**CBSERVE_NAMES.renamed, "structured_output.spec": spec_field})


def checked_request_id(request_id: str) -> str:
    """The caller's id, or a fresh one when it left it empty."""
    if not request_id:
        return uuid.uuid4().hex
    if len(request_id.encode()) > MAX_REQUEST_ID_BYTES or not all(" " < c <= "~" for c in request_id):
        raise invalid(f"request_id must be at most {MAX_REQUEST_ID_BYTES} bytes of printable ASCII")
    return request_id


def checked_prompt(field_name: str, ids: list[int], limits: ModelLimits) -> list[int]:
    """The prompt `field_name` carried, every id in the vocabulary and room left to generate."""
    ids = _checked_token_ids(field_name, ids, limits)
    if len(ids) >= limits.max_context_length:
        raise invalid(
            f"prompt: {len(ids)} tokens leave no room to generate within the model's context of "
            f"{limits.max_context_length} tokens"
        )
    return ids


def checked_max_new_tokens(
    requested: int | None, prompt_len: int, limits: ModelLimits, names: WireNames
) -> int:
    """`requested` if the context has room for it; unset, the model's default within that room."""
    room = limits.max_context_length - prompt_len
    if requested is None:
        return min(limits.default_max_new_tokens, room)
    if requested > room:
        raise invalid(
            f"{names('max_new_tokens')}: {prompt_len} prompt tokens + {requested} exceed "
            f"the model's context of {limits.max_context_length} tokens"
        )
    return requested


def sampling_params(settings: dict[str, Any], limits: ModelLimits, names: WireNames) -> SamplingParams:
    """The engine's SamplingParams of `settings` (generate's keyword arguments), the model's generation
    config supplying the rest; a refusal names the protocol's field."""
    try:
        return build_sampling_params(
            settings,
            limits.generation_config,
            limits.vocab_size,
            default_logprobs_mode=limits.default_logprobs_mode,
        )
    except InvalidParameterError as exc:
        raise names.rejected(exc) from exc


def checked_logit_bias(logit_bias: Mapping[int, float], names: WireNames) -> dict[int, float]:
    """At most MAX_LOGIT_BIAS_ENTRIES entries (the engine checks each id and bias)."""
    if len(logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise invalid(
            f"{names('logit_bias')}: at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(logit_bias)}"
        )
    return dict(logit_bias)


def checked_stop_strings(stop_strings: list[str], tokenizer: Any | None, names: WireNames) -> list[str]:
    """Stop strings the service can match: the model has a tokenizer to decode text with, and each is
    within the bounds."""
    if not stop_strings:
        return []
    field_name = names("stop")
    if tokenizer is None:
        raise invalid(
            f"{field_name}: the served model has no tokenizer to decode text with; end the output with "
            f"{names('stop_token_ids')} instead"
        )
    if len(stop_strings) > MAX_STOP_STRINGS:
        raise invalid(f"{field_name}: at most {MAX_STOP_STRINGS} strings, got {len(stop_strings)}")
    for index, stop in enumerate(stop_strings):
        if not 1 <= len(stop) <= MAX_STOP_STRING_CHARS:
            raise invalid(
                f"{field_name}[{index}] must be 1 to {MAX_STOP_STRING_CHARS} characters, got {len(stop)}"
            )
    return stop_strings


def _prompt_ids(request: types_pb2.GenerationRequest, tokenizer: Any | None) -> tuple[str, list[int]]:
    """The prompt's field and its token ids (not yet checked against the vocabulary)."""
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
    return kind, ids


def _checked_token_ids(field_name: str, ids: list[int], limits: ModelLimits) -> list[int]:
    try:
        return check_token_ids(field_name, ids, limits.vocab_size)
    except ValueError as exc:
        raise invalid(str(exc)) from exc


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


def _sampling_settings(
    params: types_pb2.SamplingParams, max_new_tokens: int, limits: ModelLimits
) -> dict[str, Any]:
    """The sampling fields the caller set, named as generate's keyword arguments, so that the engine's
    rules check them and the model's generation config supplies the rest."""
    settings: dict[str, Any] = {"max_new_tokens": max_new_tokens}
    if params.ignore_eos:
        settings["eos_token_id"] = []  # no EOS id: the request runs to max_new_tokens
    elif params.eos_token_ids:
        settings["eos_token_id"] = _checked_token_ids(
            "sampling.eos_token_ids", list(params.eos_token_ids), limits
        )
    for name in _OPTIONAL_SAMPLING_FIELDS:
        if params.HasField(name):
            settings[name] = getattr(params, name)
    if params.logprobs:
        settings["logprobs"] = True
    if params.return_kept_mass:
        settings["return_kept_mass"] = True
    if params.logprobs_mode != types_pb2.LOGPROBS_MODE_UNSPECIFIED:
        mode = _LOGPROBS_MODES.get(params.logprobs_mode)
        if mode is None:
            raise invalid(
                f"sampling.logprobs_mode: unknown value {params.logprobs_mode}; expected LOGPROBS_MODE_RAW "
                "or LOGPROBS_MODE_PROCESSED (or unset for the server's default)"
            )
        settings["logprobs_mode"] = mode
    if params.logit_bias:
        settings["logit_bias"] = checked_logit_bias(params.logit_bias, CBSERVE_NAMES)
    if params.stop_token_ids:
        settings["stop_token_ids"] = list(params.stop_token_ids)
    if params.HasField("structured_output"):
        settings["structured_output"] = _structured_output(params.structured_output)
    return settings


def _structured_output(message: types_pb2.StructuredOutput) -> StructuredOutput:
    kind = message.WhichOneof("constraint")
    if kind is None:
        raise invalid(
            "sampling.structured_output: one of json_schema, json_object, regex or grammar must be set"
        )
    if kind == "json_object":
        if not message.json_object:
            raise invalid("sampling.structured_output.json_object must be true when it is the one set")
        return StructuredOutput("json_object")
    spec = getattr(message, kind)
    if not spec:  # checked here, where the wire field it is missing from has a name
        raise invalid(f"sampling.structured_output.{kind} must not be empty")
    return StructuredOutput(kind, spec)


_LOGPROBS_MODES = {
    types_pb2.LOGPROBS_MODE_RAW: LogprobsMode.RAW,
    types_pb2.LOGPROBS_MODE_PROCESSED: LogprobsMode.PROCESSED,
}

# Wire fields with presence whose name and meaning are generate's keyword argument of the same name.
_OPTIONAL_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "top_logprobs",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "min_new_tokens",
    "min_p",
    "prompt_logprobs",
    "n",
)
