"""`SamplingParams` and the one function that builds and validates it, for the in-process API and the service.

Every bound and default of a per-request generation parameter is defined here once. A bad value raises
`InvalidParameterError` (a ValueError) whose message starts with the parameter's name, prefixed by the
caller's `field_prefix` (the service passes "sampling." so the error names the wire field).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch

# transformers' GenerationConfig default (max_length=20) read as a number of new tokens.
DEFAULT_MAX_NEW_TOKENS = 20
MAX_TOP_LOGPROBS = 20
# OpenAI's bounds on presence_penalty and frequency_penalty, and on logit_bias values.
MAX_ABS_PRESENCE_FREQUENCY_PENALTY = 2.0
MAX_ABS_LOGIT_BIAS = 100.0
MAX_STOP_TOKEN_IDS = 64
# OpenAI's bound on `n`: completions sampled from one prompt.
MAX_SEQUENCES_PER_REQUEST = 128
# torch.Generator.manual_seed's range.
MIN_SEED, MAX_SEED = -(2**63), 2**64 - 1
# A JSON schema, regex or grammar longer than this is refused before it reaches the grammar compiler.
MAX_STRUCTURED_OUTPUT_CHARS = 65536
STRUCTURED_OUTPUT_KINDS = ("json_schema", "json_object", "regex", "grammar")
# What transformers' continuous batching writes into a GenerationConfig without an EOS ("Setting to -1
# (disabled)"), in place, so the config a user hands both engines in turn carries it: it means no EOS.
DISABLED_EOS_TOKEN_ID = -1
# The generate() keyword arguments a request may carry besides max_new_tokens and eos_token_id.
SAMPLING_KWARGS = (
    "temperature",
    "top_k",
    "top_p",
    "seed",
    "do_sample",
    "logprobs",
    "top_logprobs",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "min_new_tokens",
    "logit_bias",
    "min_p",
    "stop_token_ids",
    "prompt_logprobs",
    "structured_output",
    "num_return_sequences",
    "n",
    "logprobs_mode",
    "return_kept_mass",
)


class LogprobsMode(StrEnum):
    """Which distribution a generated token's logprobs (and top logprobs) are taken from; the names are
    vLLM's `logprobs_mode` values.

    RAW: log_softmax of the model's logits, before anything else touches them.
    PROCESSED: log_softmax of the logits the token was drawn from: after logit bias, penalties,
    `min_new_tokens` and grammar masks, then, for a request that samples (temperature > 0), temperature,
    top-k, top-p and min-p. A greedy request's are after the penalties only (temperature is not applied).
    Tokens the filters removed have logprob -inf and are left out of the top logprobs. This is the
    sampler's own probability of each token, what an importance ratio between trainer and sampler needs.
    """

    RAW = "raw_logprobs"
    PROCESSED = "processed_logprobs"


def check_logprobs_mode(value: Any, field: str = "logprobs_mode") -> LogprobsMode:
    """`value` ("raw_logprobs" or "processed_logprobs") as a LogprobsMode; InvalidParameterError
    naming `field` otherwise."""
    try:
        return LogprobsMode(value)
    except ValueError:
        raise InvalidParameterError(
            field, f" must be one of {[str(mode) for mode in LogprobsMode]}, got {value!r}"
        ) from None


class InvalidParameterError(ValueError):
    """A request parameter out of its bounds; `field` names it as the caller spelled it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}{message}")
        self.field = field


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the output (engine.sampling.structured_output): `kind` is "json_schema" (`spec`, a JSON
    schema), "json_object" (any JSON object; `spec` empty), "regex" (`spec`, a regular expression) or
    "grammar" (`spec`, an EBNF grammar in GBNF style: rules `name ::= ...`, starting at `root`)."""

    kind: str
    spec: str = ""


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding parameters. `temperature` None or 0 means greedy decoding."""

    max_new_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    # engine.sampling.penalties: None (or 1.0 / 0.0) leaves the logits alone.
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    min_new_tokens: int = 0
    # (token id, bias) pairs added to the logits first, as transformers' sequence_bias of one token.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Tokens whose probability is below min_p times the most likely token's are never sampled.
    min_p: float | None = None
    # Tokens that end the output besides `eos_token_ids` (FinishReason.STOP, with the token as stop_reason).
    stop_token_ids: frozenset[int] = frozenset()
    # Per prompt token, its logprob and this many alternatives (vLLM's prompt_logprobs); None: off.
    prompt_logprobs: int | None = None
    structured_output: StructuredOutput | None = None
    # Completions sampled from the prompt (generate's num_return_sequences, vLLM's n); see
    # `sequence_seed` for the seed of each.
    n: int = 1
    # What `logprobs` and `top_logprobs` are the logprobs of (prompt logprobs are always raw).
    logprobs_mode: LogprobsMode = LogprobsMode.RAW
    # Each generated token also reports the log of the probability mass top-k, top-p and min-p kept
    # (engine.sampling.sampler.log_kept_mass); implies `logprobs`, needs a request that samples.
    return_kept_mass: bool = False

    @property
    def is_greedy(self) -> bool:
        return self.temperature is None or self.temperature == 0.0 or self.top_k == 1

    @property
    def processes_logits(self) -> bool:
        """Whether the engine processes this request's logits before sampling (engine.sampling.penalties)."""
        return (
            self.repetition_penalty not in (None, 1.0)
            or bool(self.presence_penalty)
            or bool(self.frequency_penalty)
            or self.min_new_tokens > 0
            or bool(self.logit_bias)
        )

    @property
    def samples(self) -> bool:
        """Whether tokens are drawn at a temperature (top_k=1 draws from a single token, like greedy)."""
        return self.temperature is not None and self.temperature > 0.0

    @property
    def wants_processed_logprobs(self) -> bool:
        return (self.logprobs or self.top_logprobs > 0) and self.logprobs_mode == LogprobsMode.PROCESSED


def sequence_seed(seed: int | None, index: int) -> int | None:
    """The seed of sequence `index` of a request with `seed` and n > 1: `seed + index`, wrapped into
    torch's seed range, so sequence i of n equals a single request seeded with `sequence_seed(seed, i)`."""
    if seed is None or index == 0:
        return seed
    derived = seed + index
    return derived - 2**64 if derived > MAX_SEED else derived


def default_max_new_tokens(generation_config: Any) -> int:
    """The model's `max_new_tokens`, or transformers' default of 20."""
    return int(getattr(generation_config, "max_new_tokens", None) or DEFAULT_MAX_NEW_TOKENS)


def check_token_ids(field: str, token_ids: Iterable[Any], vocab_size: int) -> list[int]:
    """`token_ids` as a list; raises InvalidParameterError naming `field` at the first id outside the
    vocabulary (or not an int)."""
    ids = list(token_ids)
    for token in ids:
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
            raise InvalidParameterError(
                field, f": token id {token!r} is not in [0, {vocab_size}) (the model's vocabulary)"
            )
    return ids


def build_sampling_params(
    settings: Mapping[str, Any],
    generation_config: Any,
    vocab_size: int,
    *,
    return_logprobs: bool = False,
    drop_unsupported: bool = False,
    field_prefix: str = "",
    default_logprobs_mode: LogprobsMode | str = LogprobsMode.RAW,
) -> SamplingParams:
    """The `SamplingParams` of one request from the parameters its caller set (generate's keyword
    arguments: `max_new_tokens`, `eos_token_id` and `SAMPLING_KWARGS`), with the model's generation
    config supplying the rest as `generate` does, and `default_logprobs_mode` (the server's) the
    `logprobs_mode` of a request that sets none.

    Unknown parameters raise, or are dropped with a warning when `drop_unsupported`.
    """
    fields = _Fields(field_prefix)
    unknown = sorted(set(settings) - {"max_new_tokens", "eos_token_id", *SAMPLING_KWARGS})
    if unknown:
        message = f"unsupported generation parameters {unknown}; supported: {list(SAMPLING_KWARGS)}"
        if not drop_unsupported:
            raise ValueError(message)
        warnings.warn(f"{message}; dropped (drop_unsupported_processors=True)", stacklevel=4)
    max_new_tokens = settings.get("max_new_tokens")
    if max_new_tokens is None:
        max_new_tokens = default_max_new_tokens(generation_config)
    fields.check_int("max_new_tokens", max_new_tokens, minimum=1)
    eos_token_id = settings.get("eos_token_id")
    if eos_token_id is None:
        eos_token_id = getattr(generation_config, "eos_token_id", None)
    eos_ids = frozenset(check_token_ids(fields.name("eos_token_id"), _eos_ids(eos_token_id), vocab_size))
    top_logprobs = settings.get("top_logprobs") or 0
    fields.check_int("top_logprobs", top_logprobs, minimum=0, maximum=MAX_TOP_LOGPROBS)
    sampler_settings = _sampler_settings(settings, generation_config, fields)
    return_kept_mass = _return_kept_mass(settings.get("return_kept_mass"), sampler_settings, fields)
    return SamplingParams(
        max_new_tokens=max_new_tokens,
        eos_token_ids=eos_ids,
        **sampler_settings,
        logprobs=bool(settings.get("logprobs") or top_logprobs or return_logprobs or return_kept_mass),
        top_logprobs=top_logprobs,
        **_penalties(settings, generation_config, max_new_tokens, fields),
        logit_bias=_logit_bias(settings.get("logit_bias"), vocab_size, fields),
        stop_token_ids=_stop_token_ids(settings.get("stop_token_ids"), vocab_size, fields),
        prompt_logprobs=_prompt_logprobs(settings.get("prompt_logprobs"), fields),
        structured_output=_structured_output(settings.get("structured_output"), fields),
        n=_num_sequences(settings, generation_config, fields),
        logprobs_mode=_logprobs_mode(settings.get("logprobs_mode"), default_logprobs_mode, fields),
        return_kept_mass=return_kept_mass,
    )


def _return_kept_mass(value: Any, sampler_settings: Mapping[str, Any], fields: _Fields) -> bool:
    """Refused for a greedy request: its token is the argmax, drawn from no distribution, so there is no
    truncated mass to correct an importance ratio by."""
    if value is None or value is False:
        return False
    if value is not True:
        raise InvalidParameterError(fields.name("return_kept_mass"), f" must be a bool, got {value!r}")
    temperature = sampler_settings["temperature"]
    if temperature is None or temperature == 0.0:
        raise InvalidParameterError(
            fields.name("return_kept_mass"),
            f" needs a request that samples (temperature > 0), got temperature {temperature}: a greedy "
            "token is drawn from no distribution, so no mass is truncated",
        )
    return True


def _logprobs_mode(value: Any, default: LogprobsMode | str, fields: _Fields) -> LogprobsMode:
    return check_logprobs_mode(default if value is None else value, fields.name("logprobs_mode"))


def _num_sequences(settings: Mapping[str, Any], generation_config: Any, fields: _Fields) -> int:
    """generate's `num_return_sequences` or vLLM's `n` (not both); the model's generation config supplies
    the default."""
    given = [name for name in ("n", "num_return_sequences") if settings.get(name) is not None]
    if len(given) > 1:
        raise InvalidParameterError(
            fields.name("n"), " and num_return_sequences name the same setting: pass one"
        )
    name = given[0] if given else "num_return_sequences"
    value = settings[name] if given else getattr(generation_config, "num_return_sequences", None) or 1
    fields.check_int(name, value, minimum=1, maximum=MAX_SEQUENCES_PER_REQUEST)
    return int(value)


def _stop_token_ids(stop_token_ids: Any, vocab_size: int, fields: _Fields) -> frozenset[int]:
    if stop_token_ids is None:
        return frozenset()
    ids = check_token_ids(fields.name("stop_token_ids"), _as_ids(stop_token_ids), vocab_size)
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidParameterError(
            fields.name("stop_token_ids"), f": at most {MAX_STOP_TOKEN_IDS} token ids, got {len(ids)}"
        )
    return frozenset(ids)


def _prompt_logprobs(prompt_logprobs: Any, fields: _Fields) -> int | None:
    if prompt_logprobs is None:
        return None
    fields.check_int(
        "prompt_logprobs",
        prompt_logprobs,
        minimum=0,
        maximum=MAX_TOP_LOGPROBS,
        note=" (0: the prompt token's only)",
    )
    return int(prompt_logprobs)


def _structured_output(structured_output: Any, fields: _Fields) -> StructuredOutput | None:
    if structured_output is None:
        return None
    field = fields.name("structured_output")
    if not isinstance(structured_output, StructuredOutput):
        raise InvalidParameterError(
            field, f" must be a StructuredOutput, got {type(structured_output).__name__}"
        )
    if structured_output.kind not in STRUCTURED_OUTPUT_KINDS:
        raise InvalidParameterError(
            f"{field}.kind",
            f" must be one of {list(STRUCTURED_OUTPUT_KINDS)}, got {structured_output.kind!r}",
        )
    needs_spec = structured_output.kind != "json_object"
    if needs_spec and not structured_output.spec:
        raise InvalidParameterError(
            f"{field}.spec", f" must not be empty for kind {structured_output.kind!r}"
        )
    if len(structured_output.spec) > MAX_STRUCTURED_OUTPUT_CHARS:
        raise InvalidParameterError(
            f"{field}.spec",
            f" must be at most {MAX_STRUCTURED_OUTPUT_CHARS} characters, got {len(structured_output.spec)}",
        )
    return structured_output


def _sampler_settings(settings: Mapping[str, Any], generation_config: Any, fields: _Fields) -> dict[str, Any]:
    """temperature, top_k, top_p, min_p and seed. The model's sampling defaults apply only when sampling: a
    greedy model config stays greedy unless the request sets a temperature."""
    do_sample = settings.get("do_sample", getattr(generation_config, "do_sample", False))
    defaults = {
        name: getattr(generation_config, name, None) if do_sample else None
        for name in ("temperature", "top_k", "top_p")
    }
    defaults["min_p"] = getattr(generation_config, "min_p", None) if do_sample else None
    temperature = settings.get("temperature", defaults["temperature"])
    top_k = settings.get("top_k", defaults["top_k"])
    top_p = settings.get("top_p", defaults["top_p"])
    min_p = settings.get("min_p", defaults["min_p"])
    seed = settings.get("seed")
    if min_p is not None:
        fields.check_number("min_p", min_p, "in [0, 1] (0 disables it)", lambda value: 0 <= value <= 1)
    if temperature is not None:
        fields.check_number("temperature", temperature, ">= 0", lambda value: value >= 0)
    if top_k is not None:
        fields.check_int("top_k", top_k, minimum=0, note=" (0 disables it)")
    if top_p is not None:
        fields.check_number("top_p", top_p, "in (0, 1]", lambda value: 0 < value <= 1)
    if seed is not None:
        fields.check_int("seed", seed, minimum=MIN_SEED, maximum=MAX_SEED)
    if do_sample and temperature is None:
        temperature = 1.0
    if not do_sample and "temperature" not in settings:
        temperature = None
    return {
        "temperature": float(temperature) if temperature is not None else None,
        "top_k": top_k or None,
        "top_p": float(top_p) if top_p is not None else None,
        "min_p": float(min_p) if min_p else None,
        "seed": seed,
    }


def _penalties(
    settings: Mapping[str, Any], generation_config: Any, max_new_tokens: int, fields: _Fields
) -> dict[str, Any]:
    """engine.sampling.penalties' parameters; as in `generate`, the model's generation config supplies
    `repetition_penalty` and `min_new_tokens` when the call does not."""
    repetition_penalty = settings.get(
        "repetition_penalty", getattr(generation_config, "repetition_penalty", None)
    )
    if repetition_penalty is not None:
        fields.check_number(
            "repetition_penalty", repetition_penalty, "> 0 (1 disables it)", lambda value: value > 0
        )
    penalties: dict[str, Any] = {
        "repetition_penalty": float(repetition_penalty) if repetition_penalty is not None else None
    }
    bound = MAX_ABS_PRESENCE_FREQUENCY_PENALTY
    for name in ("presence_penalty", "frequency_penalty"):
        value = settings.get(name)
        if value is not None:
            fields.check_number(name, value, f"in [-{bound:g}, {bound:g}]", lambda value: abs(value) <= bound)
        penalties[name] = float(value) if value is not None else None
    min_new_tokens = settings.get("min_new_tokens", getattr(generation_config, "min_new_tokens", None)) or 0
    fields.check_int("min_new_tokens", min_new_tokens, minimum=0)
    if min_new_tokens > max_new_tokens and "min_new_tokens" not in settings:
        min_new_tokens = max_new_tokens  # the model's default yields to this request's own limit
    elif min_new_tokens > max_new_tokens:
        raise InvalidParameterError(
            fields.name("min_new_tokens"),
            f" ({min_new_tokens}) must not exceed max_new_tokens ({max_new_tokens})",
        )
    penalties["min_new_tokens"] = min_new_tokens
    return penalties


def _logit_bias(logit_bias: Any, vocab_size: int, fields: _Fields) -> tuple[tuple[int, float], ...]:
    if logit_bias is None:
        return ()
    field = fields.name("logit_bias")
    if not isinstance(logit_bias, Mapping):
        raise InvalidParameterError(
            field, f" must be a mapping of token id to bias, got {type(logit_bias).__name__}"
        )
    check_token_ids(field, logit_bias, vocab_size)
    bound = MAX_ABS_LOGIT_BIAS
    for token, bias in sorted(logit_bias.items()):
        fields.check_number(
            f"logit_bias[{token}]", bias, f"in [-{bound:g}, {bound:g}]", lambda value: abs(value) <= bound
        )
    return tuple(sorted((token, float(bias)) for token, bias in logit_bias.items()))


class _Fields:
    """Names parameters as the caller spells them and checks their kind and bounds."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def name(self, parameter: str) -> str:
        return f"{self.prefix}{parameter}"

    def check_int(
        self,
        parameter: str,
        value: Any,
        minimum: int | None = None,
        maximum: int | None = None,
        note: str = "",
    ) -> None:
        is_int = isinstance(value, int) and not isinstance(value, bool)
        if (
            not is_int
            or not (minimum is None or value >= minimum)
            or not (maximum is None or value <= maximum)
        ):
            if minimum is not None and maximum is not None:
                bounds = f" in [{minimum}, {maximum}]"
            elif minimum is not None:
                bounds = f" >= {minimum}"
            else:
                bounds = ""
            raise InvalidParameterError(self.name(parameter), f" must be an int{bounds}{note}, got {value!r}")

    def check_number(
        self, parameter: str, value: Any, bounds: str, in_bounds: Callable[[float], bool]
    ) -> None:
        """NaN and infinities are refused for every parameter: none has a meaning for them."""
        is_number = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
        if not is_number or not in_bounds(value):
            raise InvalidParameterError(
                self.name(parameter), f" must be a finite number {bounds}, got {value!r}"
            )


def _as_ids(eos_token_id: Any) -> list[Any]:
    if eos_token_id is None:
        return []
    if isinstance(eos_token_id, torch.Tensor):
        return list(eos_token_id.flatten().tolist())
    if isinstance(eos_token_id, int):
        return [eos_token_id]
    return list(eos_token_id)


def _eos_ids(eos_token_id: Any) -> list[Any]:
    """EOS ids as a list, without transformers' "disabled" marker: an empty list is no EOS too."""
    return [
        token
        for token in _as_ids(eos_token_id)
        if not (type(token) is int and token == DISABLED_EOS_TOKEN_ID)
    ]
