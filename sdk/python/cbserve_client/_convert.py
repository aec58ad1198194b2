"""Conversions between Python values and the cbserve.v1 protobuf messages."""

from __future__ import annotations

import datetime as _dt
import json
import math
import uuid
from collections.abc import AsyncIterable, Callable, Iterable, Mapping, Sequence
from typing import Any, TypeAlias

import grpc
from google.protobuf import timestamp_pb2

from cbserve_client import _bounds
from cbserve_client._buckets import WeightBucket
from cbserve_client._generated.cbserve.v1 import admin_pb2, generation_pb2, types_pb2
from cbserve_client._types import (
    Chunk,
    Completion,
    ModelInfo,
    PauseInfo,
    PrefixCacheReset,
    PromptLogprob,
    SleepResult,
    Status,
    StopResult,
    TensorChecksum,
    Timings,
    TokenLogprob,
    TopLogprob,
    Usage,
    WeightsChecksum,
    WeightsTransferReady,
    WeightsUpdate,
    WeightsUpdateGroupInfo,
)
from cbserve_client.errors import CbserveError, InvalidArgumentError, error_from_code

#: A prompt: text, token ids, or chat messages ({"role": ..., "content": ...} mappings).
Prompt: TypeAlias = str | Sequence[int] | Sequence[Mapping[str, str]]

SAMPLING_KWARGS = frozenset(
    {
        "max_new_tokens",
        "temperature",
        "top_k",
        "top_p",
        "seed",
        "eos_token_ids",
        "ignore_eos",
        "logprobs",
        "top_logprobs",
        "stop",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "min_new_tokens",
        "logit_bias",
        "min_p",
        "stop_token_ids",
        "skip_special_tokens",
        "prompt_logprobs",
        "logprobs_mode",
        "return_kept_mass",
        "n",
        "json_schema",
        "json_object",
        "regex",
        "grammar",
        "request_id",
        "record_timestamps",
        "add_generation_prompt",
        "priority",
        "kv_on_weight_update",
    }
)

#: GenerationRequest.kv_on_weight_update by the name the SDK takes.
KV_ON_WEIGHT_UPDATE = {
    "keep": types_pb2.KV_ON_WEIGHT_UPDATE_KEEP,
    "recompute": types_pb2.KV_ON_WEIGHT_UPDATE_RECOMPUTE,
}

#: The keywords that set SamplingParams.structured_output, at most one per request (its oneof).
STRUCTURED_OUTPUT_KWARGS = ("json_schema", "json_object", "regex", "grammar")

_STATUS_NAMES = {
    types_pb2.REQUEST_STATUS_UNSPECIFIED: "unspecified",
    types_pb2.REQUEST_STATUS_QUEUED: "queued",
    types_pb2.REQUEST_STATUS_PREFILLING: "prefilling",
    types_pb2.REQUEST_STATUS_DECODING: "decoding",
    types_pb2.REQUEST_STATUS_FINISHED: "finished",
    types_pb2.REQUEST_STATUS_CANCELLED: "cancelled",
    types_pb2.REQUEST_STATUS_FAILED: "failed",
}
_FINISH_NAMES = {
    types_pb2.FINISH_REASON_EOS: "eos",
    types_pb2.FINISH_REASON_LENGTH: "length",
    types_pb2.FINISH_REASON_CANCELLED: "cancelled",
    types_pb2.FINISH_REASON_ERROR: "error",
    types_pb2.FINISH_REASON_STOP: "stop",
}
#: SamplingParams.logprobs_mode by vLLM's names.
LOGPROBS_MODES = {
    "raw_logprobs": types_pb2.LOGPROBS_MODE_RAW,
    "processed_logprobs": types_pb2.LOGPROBS_MODE_PROCESSED,
}
_PAUSE_MODES = {
    "keep": admin_pb2.PAUSE_MODE_KEEP,
    "wait": admin_pb2.PAUSE_MODE_WAIT,
    "abort": admin_pb2.PAUSE_MODE_ABORT,
}

# Failures of a Generate-stream add that AddRequest would have reported as a status code: the SDK
# raises them (as it would for AddRequest) instead of returning a failed result.
REJECTION_CODES = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT.value[0],
        grpc.StatusCode.ALREADY_EXISTS.value[0],
        grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
        grpc.StatusCode.UNAVAILABLE.value[0],
        grpc.StatusCode.NOT_FOUND.value[0],
    }
)


# The wire's integer widths (token ids, counts: uint32; seed: uint64).
_UINT32_MAX = 2**32 - 1
_UINT64_MAX = 2**64 - 1


def new_request_id() -> str:
    """A fresh client-side request id (client-chosen ids make retries of AddRequest idempotent)."""
    return uuid.uuid4().hex


def with_request_id(sampling: Mapping[str, Any]) -> dict[str, Any]:
    """The sampling keywords with a fresh ``request_id`` when the caller set none (or an empty one,
    which the server would replace with an id this client could not follow)."""
    return {**sampling, "request_id": sampling.get("request_id") or new_request_id()}


def _refuse(field: str, message: str) -> InvalidArgumentError:
    """What the server would answer, before any call: the same status, field name and bound."""
    return InvalidArgumentError(grpc.StatusCode.INVALID_ARGUMENT, f"{field}{message}")


def _check_int_range(
    field: str,
    value: int,
    minimum: int,
    maximum: int | None = None,
    *,
    wire_max: int = _UINT32_MAX,
    note: str = "",
) -> None:
    """``minimum``/``maximum`` are the server's bounds, phrased as it phrases them (``note`` too);
    ``wire_max`` is the width of the wire's unsigned field."""
    if value < minimum or (maximum is not None and value > maximum):
        bounds = f" in [{minimum}, {maximum}]" if maximum is not None else f" >= {minimum}"
        raise _refuse(field, f" must be an int{bounds}{note}, got {value!r}")
    if value > wire_max:
        raise _refuse(
            field, f" must be at most {wire_max} (the wire's uint{wire_max.bit_length()}), got {value!r}"
        )


def _check_number_range(field: str, value: float, bounds: str, in_bounds: bool) -> None:
    if not math.isfinite(value) or not in_bounds:
        raise _refuse(field, f" must be a finite number {bounds}, got {value!r}")


def _check_bounds(
    values: Mapping[str, Any],
    eos_token_ids: list[int],
    stop: list[str],
    logit_bias: Mapping[int, float],
    stop_token_ids: list[int],
) -> None:
    """Refuses every value outside the server's bounds (sdk/sampling_bounds.json, and the wire's
    integer widths), with the server's message. Bounds that depend on the model (vocabulary size,
    context length) are left to the server."""
    max_new_tokens = values.get("max_new_tokens")
    if max_new_tokens is not None:
        _check_int_range("sampling.max_new_tokens", max_new_tokens, _bounds.MIN_MAX_NEW_TOKENS)
    if values.get("top_k") is not None:
        _check_int_range("sampling.top_k", values["top_k"], 0, note=" (0 disables it)")
    if values.get("min_new_tokens") is not None:
        _check_int_range("sampling.min_new_tokens", values["min_new_tokens"], 0)
    if values.get("seed") is not None:
        _check_int_range("sampling.seed", values["seed"], 0, wire_max=_UINT64_MAX)
    if values.get("top_logprobs") is not None:
        _check_int_range("sampling.top_logprobs", values["top_logprobs"], 0, _bounds.MAX_TOP_LOGPROBS)
    if values.get("prompt_logprobs") is not None:
        _check_int_range(
            "sampling.prompt_logprobs",
            values["prompt_logprobs"],
            0,
            _bounds.MAX_PROMPT_LOGPROBS,
            note=" (0: the prompt token's only)",
        )
    if values.get("n") is not None:
        _check_int_range("sampling.n", values["n"], 1, _bounds.MAX_N)
    min_new_tokens = values.get("min_new_tokens")
    if min_new_tokens is not None and max_new_tokens is not None and min_new_tokens > max_new_tokens:
        message = f" ({min_new_tokens}) must not exceed max_new_tokens ({max_new_tokens})"
        raise _refuse("sampling.min_new_tokens", message)
    for index, token in enumerate(eos_token_ids):
        _check_int_range(f"sampling.eos_token_ids[{index}]", token, 0)
    if values.get("temperature") is not None:
        temperature = values["temperature"]
        _check_number_range("sampling.temperature", temperature, ">= 0", temperature >= 0)
    if values.get("top_p") is not None:
        top_p = values["top_p"]
        _check_number_range("sampling.top_p", top_p, "in (0, 1]", 0 < top_p <= 1)
    if values.get("min_p") is not None:
        min_p, bound = values["min_p"], _bounds.MAX_MIN_P
        _check_number_range(
            "sampling.min_p", min_p, f"in [0, {bound:g}] (0 disables it)", 0 <= min_p <= bound
        )
    if values.get("repetition_penalty") is not None:
        penalty = values["repetition_penalty"]
        _check_number_range("sampling.repetition_penalty", penalty, "> 0 (1 disables it)", penalty > 0)
    bound = _bounds.MAX_ABS_PRESENCE_FREQUENCY_PENALTY
    for name in ("presence_penalty", "frequency_penalty"):
        if values.get(name) is not None:
            value = values[name]
            _check_number_range(f"sampling.{name}", value, f"in [-{bound:g}, {bound:g}]", abs(value) <= bound)
    _check_stop(stop)
    _check_logit_bias(logit_bias)
    _check_stop_token_ids(stop_token_ids)


def _check_stop_token_ids(stop_token_ids: list[int]) -> None:
    if len(stop_token_ids) > _bounds.MAX_STOP_TOKEN_IDS:
        message = f": at most {_bounds.MAX_STOP_TOKEN_IDS} token ids, got {len(stop_token_ids)}"
        raise _refuse("sampling.stop_token_ids", message)
    for index, token in enumerate(stop_token_ids):
        _check_int_range(f"sampling.stop_token_ids[{index}]", token, 0)


def _check_stop(stop: list[str]) -> None:
    if len(stop) > _bounds.MAX_STOP_STRINGS:
        raise _refuse("sampling.stop", f": at most {_bounds.MAX_STOP_STRINGS} strings, got {len(stop)}")
    for index, text in enumerate(stop):
        if not 1 <= len(text) <= _bounds.MAX_STOP_STRING_CHARS:
            raise _refuse(
                f"sampling.stop[{index}]",
                f" must be 1 to {_bounds.MAX_STOP_STRING_CHARS} characters, got {len(text)}",
            )


def _check_logit_bias(logit_bias: Mapping[int, float]) -> None:
    if len(logit_bias) > _bounds.MAX_LOGIT_BIAS_ENTRIES:
        message = f": at most {_bounds.MAX_LOGIT_BIAS_ENTRIES} entries, got {len(logit_bias)}"
        raise _refuse("sampling.logit_bias", message)
    bound = _bounds.MAX_ABS_LOGIT_BIAS
    for token, bias in sorted(logit_bias.items()):
        _check_int_range("sampling.logit_bias key", token, 0)
        _check_number_range(
            f"sampling.logit_bias[{token}]", float(bias), f"in [-{bound:g}, {bound:g}]", abs(bias) <= bound
        )


def _structured_output(
    json_schema: Mapping[str, Any] | str | None,
    json_object: bool | None,
    regex: str | None,
    grammar: str | None,
) -> types_pb2.StructuredOutput | None:
    """The StructuredOutput of at most one of the four keywords (None: unconstrained).

    ``json_schema`` is a mapping (serialized with :func:`json.dumps`) or the schema's JSON text;
    ``json_object=True`` asks for any JSON object (False is the same as leaving it unset).
    """
    if json_object is not None:
        _check_bool("json_object", json_object)
    given = {
        name: value
        for name, value in (
            ("json_schema", json_schema),
            ("json_object", json_object or None),
            ("regex", regex),
            ("grammar", grammar),
        )
        if value is not None
    }
    if len(given) > 1:
        raise ValueError(
            f"at most one of {', '.join(STRUCTURED_OUTPUT_KWARGS)} may be set (they are alternative "
            f"structured-output constraints), got {' and '.join(given)}"
        )
    if not given:
        return None
    ((kind, value),) = given.items()
    if kind == "json_object":
        return types_pb2.StructuredOutput(json_object=True)
    if kind == "json_schema" and isinstance(value, Mapping):
        try:
            value = json.dumps(value)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"json_schema must be serializable as JSON: {exc}") from exc
    if not isinstance(value, str):
        expected = "a mapping or a str (a JSON schema)" if kind == "json_schema" else "a str"
        raise TypeError(f"{kind} must be {expected}, got {type(value).__name__}")
    field = f"sampling.structured_output.{kind}"
    if not value:
        raise _refuse(field, " must not be empty")
    if len(value) > _bounds.MAX_STRUCTURED_OUTPUT_CHARS:
        message = f" must be at most {_bounds.MAX_STRUCTURED_OUTPUT_CHARS} characters, got {len(value)}"
        raise _refuse(field, message)
    constraint = types_pb2.StructuredOutput()
    setattr(constraint, kind, value)
    return constraint


def _check_request_id(request_id: str) -> None:
    limit = _bounds.MAX_REQUEST_ID_BYTES
    if len(request_id.encode()) > limit or not all(" " < c <= "~" for c in request_id):
        raise _refuse("request_id", f" must be at most {limit} bytes of printable ASCII, got {request_id!r}")


def _check_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return value


def _check_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    return float(value)


def _check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def _check_int_list(name: str, value: object) -> list[int]:
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise TypeError(f"{name} must be a sequence of ints, got {type(value).__name__}")
    return [_check_int(f"{name}[{i}]", v) for i, v in enumerate(value)]


def _check_str_list(name: str, value: object) -> list[str]:
    # A lone str is a sequence of characters: refuse it rather than stop on every letter.
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise TypeError(f"{name} must be a sequence of str, got {type(value).__name__}")
    for index, item in enumerate(value):
        if not isinstance(item, str):
            raise TypeError(f"{name}[{index}] must be a str, got {type(item).__name__}")
    return list(value)


def build_sampling(
    *,
    max_new_tokens: int | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    eos_token_ids: Sequence[int] | None = None,
    ignore_eos: bool | None = None,
    logprobs: bool | None = None,
    top_logprobs: int | None = None,
    stop: Sequence[str] | None = None,
    repetition_penalty: float | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    min_new_tokens: int | None = None,
    logit_bias: Mapping[int, float] | None = None,
    min_p: float | None = None,
    stop_token_ids: Sequence[int] | None = None,
    skip_special_tokens: bool | None = None,
    prompt_logprobs: int | None = None,
    logprobs_mode: str | None = None,
    return_kept_mass: bool | None = None,
    n: int | None = None,
    json_schema: Mapping[str, Any] | str | None = None,
    json_object: bool | None = None,
    regex: str | None = None,
    grammar: str | None = None,
) -> types_pb2.SamplingParams:
    """A SamplingParams message with only the given fields set (None leaves a field unset).

    Raises TypeError for a value of the wrong type, ValueError for more than one structured-output
    constraint, and :class:`InvalidArgumentError` (as the server would) for a value outside the
    server's bounds.
    """
    scalars: dict[str, tuple[object, Callable[[str, object], object]]] = {
        "max_new_tokens": (max_new_tokens, _check_int),
        "temperature": (temperature, _check_float),
        "top_k": (top_k, _check_int),
        "top_p": (top_p, _check_float),
        "seed": (seed, _check_int),
        "ignore_eos": (ignore_eos, _check_bool),
        "logprobs": (logprobs, _check_bool),
        "top_logprobs": (top_logprobs, _check_int),
        "repetition_penalty": (repetition_penalty, _check_float),
        "presence_penalty": (presence_penalty, _check_float),
        "frequency_penalty": (frequency_penalty, _check_float),
        "min_new_tokens": (min_new_tokens, _check_int),
        "min_p": (min_p, _check_float),
        "skip_special_tokens": (skip_special_tokens, _check_bool),
        "prompt_logprobs": (prompt_logprobs, _check_int),
        "return_kept_mass": (return_kept_mass, _check_bool),
        "n": (n, _check_int),
    }
    values: dict[str, Any] = {
        name: check(name, value) for name, (value, check) in scalars.items() if value is not None
    }
    eos_ids = _check_int_list("eos_token_ids", eos_token_ids) if eos_token_ids is not None else []
    stop_strings = _check_str_list("stop", stop) if stop is not None else []
    stop_ids = _check_int_list("stop_token_ids", stop_token_ids) if stop_token_ids is not None else []
    biases: dict[int, float] = {}
    if logit_bias is not None:
        if not isinstance(logit_bias, Mapping):
            raise TypeError(
                f"logit_bias must be a mapping of token id to bias, got {type(logit_bias).__name__}"
            )
        for token, bias in logit_bias.items():
            biases[_check_int("logit_bias key", token)] = _check_float(f"logit_bias[{token}]", bias)
    _check_bounds(values, eos_ids, stop_strings, biases, stop_ids)
    constraint = _structured_output(json_schema, json_object, regex, grammar)
    params = types_pb2.SamplingParams(
        **values, eos_token_ids=eos_ids, stop=stop_strings, stop_token_ids=stop_ids
    )
    for token, bias in biases.items():
        params.logit_bias[token] = bias
    if logprobs_mode is not None:
        params.logprobs_mode = _logprobs_mode(logprobs_mode)
    if constraint is not None:
        params.structured_output.CopyFrom(constraint)
    return params


def _logprobs_mode(mode: object) -> types_pb2.LogprobsMode.ValueType:
    if not isinstance(mode, str):
        raise TypeError(f"logprobs_mode must be a str, got {type(mode).__name__}")
    if mode not in LOGPROBS_MODES:
        raise _refuse("sampling.logprobs_mode", f" must be one of {list(LOGPROBS_MODES)}, got {mode!r}")
    return LOGPROBS_MODES[mode]


def build_request(
    prompt: Prompt,
    *,
    request_id: str | None = None,
    record_timestamps: bool | None = None,
    add_generation_prompt: bool | None = None,
    priority: int | None = None,
    kv_on_weight_update: str | None = None,
    **sampling: Any,
) -> types_pb2.GenerationRequest:
    """A GenerationRequest from a prompt and the client's sampling keyword arguments.

    ``prompt`` is a str (text), a sequence of ints (token ids) or a sequence of
    ``{"role", "content"}`` mappings (chat, rendered with the model's template on the server).
    Values outside the server's bounds raise :class:`InvalidArgumentError` here, before any call;
    what depends on the model (vocabulary, context length, tokenizer) is the server's to check.
    ``priority`` orders the request under the server's "priority" scheduler (smaller first).
    ``kv_on_weight_update`` ("keep", the server's default, or "recompute") says what a weight update
    while the request lives does to its KV.
    """
    unknown = set(sampling) - SAMPLING_KWARGS
    if unknown:
        raise TypeError(f"unexpected keyword argument(s): {', '.join(sorted(unknown))}")
    request = types_pb2.GenerationRequest(sampling=build_sampling(**sampling))
    if request_id is not None:
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
        _check_request_id(request_id)
        request.request_id = request_id
    if record_timestamps is not None:
        request.record_timestamps = _check_bool("record_timestamps", record_timestamps)
    if priority is not None:
        _check_int_range(
            "priority", _check_int("priority", priority), _bounds.MIN_PRIORITY, _bounds.MAX_PRIORITY
        )
        request.priority = priority
    if kv_on_weight_update is not None:
        if kv_on_weight_update not in KV_ON_WEIGHT_UPDATE:
            raise _refuse(
                "kv_on_weight_update",
                f" must be one of {sorted(KV_ON_WEIGHT_UPDATE)}, got {kv_on_weight_update!r}",
            )
        request.kv_on_weight_update = KV_ON_WEIGHT_UPDATE[kv_on_weight_update]
    if isinstance(prompt, str):
        if add_generation_prompt is not None:
            raise TypeError("add_generation_prompt applies to chat prompts only")
        if not prompt:
            raise _refuse("text", " must not be empty")
        request.text = prompt
    elif isinstance(prompt, bytes | bytearray) or not isinstance(prompt, Sequence):
        raise TypeError(
            "prompt must be a str, a sequence of token ids, or a sequence of chat messages, "
            f"got {type(prompt).__name__}"
        )
    elif len(prompt) > 0 and isinstance(prompt[0], Mapping):
        messages = types_pb2.ChatMessages()
        for i, message in enumerate(prompt):
            if not isinstance(message, Mapping) or set(message) - {"role", "content"}:
                raise TypeError(f"prompt[{i}] must be a mapping with keys 'role' and 'content'")
            role, content = message.get("role"), message.get("content")
            if not isinstance(role, str) or not isinstance(content, str):
                raise TypeError(f"prompt[{i}]: 'role' and 'content' must be str")
            messages.messages.add(role=role, content=content)
        if add_generation_prompt is not None:
            messages.add_generation_prompt = _check_bool("add_generation_prompt", add_generation_prompt)
        request.messages.CopyFrom(messages)
    else:
        if add_generation_prompt is not None:
            raise TypeError("add_generation_prompt applies to chat prompts only")
        ids = _check_int_list("prompt", prompt)
        if not ids:
            raise _refuse("token_ids.ids", " must not be empty")
        for index, token in enumerate(ids):
            _check_int_range(f"token_ids.ids[{index}]", token, 0)
        request.token_ids.CopyFrom(types_pb2.TokenIds(ids=ids))
    return request


def _timestamp(message: Any, name: str) -> _dt.datetime | None:
    if not message.HasField(name):
        return None
    ts: timestamp_pb2.Timestamp = getattr(message, name)
    return ts.ToDatetime(tzinfo=_dt.UTC)


def usage_from_proto(usage: types_pb2.Usage) -> Usage:
    return Usage(
        prompt_tokens=usage.prompt_tokens,
        generated_tokens=usage.generated_tokens,
        cached_tokens=usage.cached_tokens,
    )


def timings_from_proto(timings: types_pb2.Timings) -> Timings:
    return Timings(
        queued_at=_timestamp(timings, "queued_at"),
        scheduled_at=_timestamp(timings, "scheduled_at"),
        first_token_at=_timestamp(timings, "first_token_at"),
        finished_at=_timestamp(timings, "finished_at"),
        queue_time_s=timings.queue_time_s if timings.HasField("queue_time_s") else None,
        time_to_first_token_s=(
            timings.time_to_first_token_s if timings.HasField("time_to_first_token_s") else None
        ),
    )


def _top_logprobs(alternatives: Iterable[types_pb2.TopLogprob]) -> tuple[TopLogprob, ...]:
    return tuple(TopLogprob(token_id=t.token_id, logprob=t.logprob) for t in alternatives)


def _stop_reason(chunk: types_pb2.GenerationChunk) -> int | str | None:
    kind = chunk.WhichOneof("stop_reason")
    if kind == "stop_token_id":
        return int(chunk.stop_token_id)
    if kind == "stop_string":
        return str(chunk.stop_string)
    return None


def chunk_from_proto(chunk: types_pb2.GenerationChunk) -> Chunk:
    """The client-side view of a GenerationChunk."""
    token_ids = tuple(chunk.token_ids)
    logprobs = tuple(
        TokenLogprob(
            token_id=token_ids[i] if i < len(token_ids) else -1,
            logprob=lp.logprob,
            top=_top_logprobs(lp.top_logprobs),
            log_kept_mass=lp.log_kept_mass if lp.HasField("log_kept_mass") else None,
        )
        for i, lp in enumerate(chunk.logprobs)
    )
    return Chunk(
        request_id=chunk.request_id,
        index=chunk.index,
        token_index=chunk.token_index,
        token_ids=token_ids,
        text=chunk.text if chunk.HasField("text") else None,
        status=_STATUS_NAMES.get(chunk.status, "unspecified"),
        finish_reason=_FINISH_NAMES.get(chunk.finish_reason),
        error=chunk.error or None,
        error_code=chunk.error_code,
        logprobs=logprobs,
        usage=usage_from_proto(chunk.usage) if chunk.HasField("usage") else None,
        timings=timings_from_proto(chunk.timings) if chunk.HasField("timings") else None,
        weight_version=chunk.weight_version,
        token_timestamps=tuple(chunk.token_timestamps),
        stop_reason=_stop_reason(chunk),
        prompt_logprobs=tuple(
            PromptLogprob(token_id=p.token_id, logprob=p.logprob, top_logprobs=_top_logprobs(p.top_logprobs))
            for p in chunk.prompt_logprobs
        ),
    )


def rejection_error(chunk: Chunk) -> CbserveError | None:
    """The exception to raise for a FAILED chunk that reports a rejected request, else None."""
    if chunk.status == "failed" and chunk.error_code in REJECTION_CODES:
        return error_from_code(chunk.error_code, chunk.error or "")
    return None


class CompletionBuilder:
    """Assembles a request's chunks, in order, into a :class:`Completion`.

    Tokens are placed by ``token_index``: a chunk overlapping tokens already received (a resumed
    stream) only contributes the new ones; a gap raises an error.
    """

    def __init__(self, request_id: str, *, from_index: int = 0, index: int = 0) -> None:
        self.request_id = request_id
        self.index = index
        self._start = from_index
        self.token_ids: list[int] = []
        self._text: list[str] | None = None
        self._logprobs: list[TokenLogprob] = []
        self._timestamps: list[float] = []
        self.usage: Usage | None = None
        self.timings: Timings | None = None
        self.weight_versions: list[int] = []
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.stop_reason: int | str | None = None
        self.prompt_logprobs: list[PromptLogprob] = []

    def add(self, chunk: Chunk) -> None:
        have = self._start + len(self.token_ids)
        if chunk.token_index > have and chunk.token_ids:
            raise CbserveError(
                grpc.StatusCode.DATA_LOSS,
                f"request {self.request_id}: got tokens from index {chunk.token_index}, expected {have}",
            )
        skip = max(0, have - chunk.token_index)
        self.token_ids.extend(chunk.token_ids[skip:])
        self._logprobs.extend(chunk.logprobs[skip:])
        self._timestamps.extend(chunk.token_timestamps[skip:])
        if chunk.text is not None:
            if self._text is None:
                self._text = []
            self._text.append(chunk.text)
        if chunk.prompt_logprobs and not self.prompt_logprobs:
            self.prompt_logprobs = list(chunk.prompt_logprobs)
        if chunk.usage is not None:
            self.usage = chunk.usage
        if chunk.timings is not None:
            self.timings = chunk.timings
        if (
            chunk.token_ids
            and chunk.weight_version
            and (not self.weight_versions or self.weight_versions[-1] != chunk.weight_version)
        ):
            self.weight_versions.append(chunk.weight_version)
        if chunk.finished:
            fallback = {"cancelled": "cancelled", "failed": "error"}.get(chunk.status, "unknown")
            self.finish_reason = chunk.finish_reason or fallback
            self.error = chunk.error
            self.stop_reason = chunk.stop_reason

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def build(
        self,
        *,
        logprobs_requested: bool = False,
        timestamps_requested: bool = False,
        prompt_logprobs_requested: bool = False,
    ) -> Completion:
        if self.finish_reason is None:
            raise CbserveError(
                grpc.StatusCode.UNKNOWN,
                f"the stream of request {self.request_id} ended before the request finished",
            )
        return Completion(
            request_id=self.request_id,
            index=self.index,
            token_ids=list(self.token_ids),
            text="".join(self._text) if self._text is not None else None,
            finish_reason=self.finish_reason,
            usage=self.usage,
            logprobs=list(self._logprobs) if (logprobs_requested or self._logprobs) else None,
            weight_version=self.weight_versions[-1] if self.weight_versions else 0,
            weight_versions=list(self.weight_versions),
            error=self.error,
            timings=self.timings,
            token_timestamps=list(self._timestamps) if (timestamps_requested or self._timestamps) else None,
            stop_reason=self.stop_reason,
            prompt_logprobs=(
                list(self.prompt_logprobs) if (prompt_logprobs_requested or self.prompt_logprobs) else None
            ),
        )


class CompletionsBuilder:
    """Assembles the chunks of a request's ``n`` sequences into one :class:`Completion` each."""

    def __init__(self, request_id: str, num_sequences: int, sampling: Mapping[str, Any]) -> None:
        self.request_id = request_id
        self._sequences = [CompletionBuilder(request_id, index=index) for index in range(num_sequences)]
        self._sampling = sampling

    def add(self, chunk: Chunk) -> None:
        """Takes a chunk of this request's (others are ignored)."""
        if chunk.request_id == self.request_id and chunk.index < len(self._sequences):
            self._sequences[chunk.index].add(chunk)

    @property
    def done(self) -> bool:
        return all(sequence.done for sequence in self._sequences)

    def collect(self, chunks: Iterable[Chunk]) -> list[Completion]:
        """Takes ``chunks`` until every sequence is done; the completions, by index."""
        for chunk in chunks:
            self.add(chunk)
            if self.done:
                break
        return self.build()

    async def collect_async(self, chunks: AsyncIterable[Chunk]) -> list[Completion]:
        """:meth:`collect` for an async iterator of chunks."""
        async for chunk in chunks:
            self.add(chunk)
            if self.done:
                break
        return self.build()

    def build(self) -> list[Completion]:
        """The completions, by index."""
        sampling = self._sampling
        return [
            sequence.build(
                logprobs_requested=bool(
                    sampling.get("logprobs")
                    or sampling.get("top_logprobs")
                    or sampling.get("return_kept_mass")
                ),
                timestamps_requested=bool(sampling.get("record_timestamps")),
                prompt_logprobs_requested=sampling.get("prompt_logprobs") is not None,
            )
            for sequence in self._sequences
        ]


def cancel_message(request_id: str, index: int | None) -> generation_pb2.CancelRequest:
    message = generation_pb2.CancelRequest(request_id=request_id)
    if index is not None:
        _check_int_range("index", _check_int("index", index), 0, _bounds.MAX_N - 1)
        message.index = index
    return message


def num_sequences(sampling: Mapping[str, Any], *, many: bool) -> int:
    """The ``n`` of a call's sampling keywords: 1 unless set; a call that returns one completion
    (``many`` False) refuses n > 1, which would drop the others."""
    n = sampling.get("n")
    if n is None:
        return 1
    n = _check_int("n", n)
    _check_int_range("sampling.n", n, 1, _bounds.MAX_N)
    if n > 1 and not many:
        raise ValueError(f"n={n} samples {n} completions: call generate_n() for all of them")
    return n


def model_info_from_proto(info: generation_pb2.GetModelInfoResponse) -> ModelInfo:
    return ModelInfo(
        model_name=info.model_name,
        vocab_size=info.vocab_size,
        max_context_length=info.max_context_length,
        eos_token_ids=tuple(info.eos_token_ids),
        has_chat_template=info.has_chat_template,
        has_tokenizer=info.has_tokenizer,
        weight_version=info.weight_version,
    )


def status_from_proto(status: admin_pb2.GetStatusResponse) -> Status:
    return Status(
        running=status.running,
        paused=status.paused,
        pause_holders=status.pause_holders,
        queued_requests=status.queued_requests,
        active_requests=status.active_requests,
        kv_blocks_used=status.kv_blocks_used,
        kv_blocks_total=status.kv_blocks_total,
        prefix_cache_hit_rate=status.prefix_cache_hit_rate,
        weight_version=status.weight_version,
        preemptions=status.preemptions,
        offloads=status.offloads,
        restores=status.restores,
        recomputed_tokens=status.recomputed_tokens,
        prefix_cache_queries=status.prefix_cache_queries,
        prefix_cache_hits=status.prefix_cache_hits,
        finished_requests=status.finished_requests,
        prompt_tokens=status.prompt_tokens,
        generated_tokens=status.generated_tokens,
        counters=dict(status.counters),
        prefix_caching_enabled=status.prefix_caching_enabled,
        sleep_level=status.sleep_level,
        weights_incomplete=status.weights_incomplete,
        weights_update_group_ranks=tuple(status.weights_update_group_ranks),
        tensor_parallel_size=status.tensor_parallel_size,
    )


def _pause_mode(mode: str) -> admin_pb2.PauseMode.ValueType:
    try:
        return _PAUSE_MODES[mode]
    except KeyError:
        raise ValueError(f"mode must be one of {sorted(_PAUSE_MODES)}, got {mode!r}") from None


def pause_request(mode: str, lease_s: float | None) -> admin_pb2.PauseRequest:
    request = admin_pb2.PauseRequest(mode=_pause_mode(mode))
    if lease_s is not None:
        request.lease_s = _check_float("lease_s", lease_s)
    return request


def pause_info_from_proto(message: admin_pb2.PauseResponse) -> PauseInfo:
    return PauseInfo(
        paused=message.paused,
        holders=message.holders,
        lease_expires_at=_timestamp(message, "lease_expires_at"),
        weight_version=message.weight_version,
        cancelled_requests=message.cancelled_requests,
    )


def stop_result_from_proto(message: admin_pb2.StopResponse) -> StopResult:
    return StopResult(
        drained_requests=message.drained_requests,
        failed_requests=message.failed_requests,
        already_stopped=message.already_stopped,
    )


def weights_update_from_proto(
    message: admin_pb2.UpdateWeightsResponse | admin_pb2.UpdateWeightsFromIpcResponse,
) -> WeightsUpdate:
    return WeightsUpdate(
        weight_version=message.weight_version,
        tensors_updated=message.tensors_updated,
        version_label=message.version_label,
    )


def init_weights_update_group_request(
    master_address: str,
    master_port: int,
    rank_offset: int,
    world_size: int,
    backend: str,
    group_name: str,
    group_timeout_s: float | None,
) -> admin_pb2.InitWeightsUpdateGroupRequest:
    request = admin_pb2.InitWeightsUpdateGroupRequest(
        master_address=master_address,
        master_port=_check_int("master_port", master_port),
        rank_offset=_check_int("rank_offset", rank_offset),
        world_size=_check_int("world_size", world_size),
        backend=backend,
        group_name=group_name,
    )
    if group_timeout_s is not None:
        request.timeout_s = _check_float("group_timeout_s", group_timeout_s)
    return request


def weights_update_group_info_from_proto(
    message: admin_pb2.InitWeightsUpdateGroupResponse,
) -> WeightsUpdateGroupInfo:
    return WeightsUpdateGroupInfo(ranks=tuple(message.ranks), backend=message.backend)


def distributed_update_request(
    buckets: Sequence[WeightBucket], version_label: str | None, validate_only: bool
) -> admin_pb2.UpdateWeightsFromDistributedRequest:
    """The announcement of a transfer over the weight-update group: every bucket, in broadcast order,
    with the name, dtype, full shape and offset of each tensor in it."""
    return admin_pb2.UpdateWeightsFromDistributedRequest(
        buckets=[
            admin_pb2.WeightBucket(
                num_bytes=bucket.num_bytes,
                tensors=[
                    admin_pb2.BucketTensor(
                        name=tensor.name,
                        dtype=tensor.dtype,
                        shape=tensor.shape,
                        byte_offset=tensor.byte_offset,
                    )
                    for tensor in bucket.tensors
                ],
            )
            for bucket in buckets
        ],
        version_label=version_label or "",
        validate_only=_check_bool("validate_only", validate_only),
    )


def weights_transfer_ready_from_proto(message: admin_pb2.WeightTransferReady) -> WeightsTransferReady:
    return WeightsTransferReady(num_buckets=message.num_buckets, num_bytes=message.num_bytes)


def sleep_request(level: int, mode: str) -> admin_pb2.SleepRequest:
    return admin_pb2.SleepRequest(level=_check_int("level", level), mode=_pause_mode(mode))


def sleep_result_from_proto(message: admin_pb2.SleepResponse) -> SleepResult:
    return SleepResult(
        released_bytes=message.released_bytes,
        affected_requests=message.affected_requests,
        resident_bytes_released=(
            message.resident_bytes_released if message.HasField("resident_bytes_released") else None
        ),
    )


def prefix_cache_reset_from_proto(message: admin_pb2.ResetPrefixCacheResponse) -> PrefixCacheReset:
    return PrefixCacheReset(dropped_blocks=message.dropped_blocks, aborted_requests=message.aborted_requests)


def weights_checksum_from_proto(message: admin_pb2.GetWeightsChecksumResponse) -> WeightsChecksum:
    return WeightsChecksum(
        digest=message.digest,
        algorithm=message.algorithm,
        weight_version=message.weight_version,
        num_tensors=message.num_tensors,
        tensors={
            tensor.name: TensorChecksum(tensor.name, tensor.digest, tensor.dtype, tuple(tensor.shape))
            for tensor in message.tensors
        },
    )


def wake_up_request(tags: Sequence[str] | None) -> admin_pb2.WakeUpRequest:
    return admin_pb2.WakeUpRequest(tags=[] if tags is None else _check_str_list("tags", tags))
