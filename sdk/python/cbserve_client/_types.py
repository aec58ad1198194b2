"""Plain Python values returned by the client (no protobuf objects leak out)."""

from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass, field

__all__ = [
    "Chunk",
    "Completion",
    "ModelInfo",
    "PauseInfo",
    "PrefixCacheReset",
    "PromptLogprob",
    "SleepResult",
    "Status",
    "StopResult",
    "TensorChecksum",
    "Timings",
    "TokenLogprob",
    "TopLogprob",
    "Usage",
    "WeightsChecksum",
    "WeightsTransferReady",
    "WeightsUpdate",
    "WeightsUpdateGroupInfo",
]


@dataclass(frozen=True, slots=True)
class TopLogprob:
    """One of the most likely alternatives at a generation step."""

    token_id: int
    logprob: float


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """Log-probability of one generated token, with the top-n alternatives when requested.

    ``log_kept_mass`` (with ``return_kept_mass=True``): the natural log of the probability mass top-k,
    top-p and min-p kept of the distribution they truncated (after penalties, bias and temperature); 0.0
    when they removed nothing. A ``processed_logprobs`` logprob plus it is the token's logprob before
    truncation. None when not asked for.
    """

    token_id: int
    logprob: float
    top: tuple[TopLogprob, ...] = ()
    log_kept_mass: float | None = None


@dataclass(frozen=True, slots=True)
class PromptLogprob:
    """Log-probability of one prompt token given the tokens before it, with the ``prompt_logprobs``
    most likely tokens at its position (most likely first)."""

    token_id: int
    logprob: float
    top_logprobs: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts of one request."""

    prompt_tokens: int
    generated_tokens: int
    cached_tokens: int


@dataclass(frozen=True, slots=True)
class Timings:
    """When a request went through its stages (server wall clock, UTC); None when not reached."""

    queued_at: _dt.datetime | None
    scheduled_at: _dt.datetime | None
    first_token_at: _dt.datetime | None
    finished_at: _dt.datetime | None
    queue_time_s: float | None
    time_to_first_token_s: float | None


@dataclass(frozen=True, slots=True)
class Chunk:
    """A piece of one request's output (a delta).

    ``token_index`` is the index, among the request's generated tokens, of ``token_ids[0]``.
    ``text`` is the decoded text delta (never a split UTF-8 character), or None when the server has
    no tokenizer. ``status`` is one of "queued", "prefilling", "decoding", "finished", "cancelled",
    "failed"; ``finish_reason`` is None until the request ends, then "eos", "stop" (a stop
    string or stop token id), "length", "cancelled" or "error". With "stop", ``stop_reason`` is what
    stopped it: the stop token id (an int) or the stop string (a str). ``prompt_logprobs`` (with the
    ``prompt_logprobs`` keyword) has one entry per prompt token after the first, on the chunk that
    carries the first generated token. With ``n`` > 1, ``index`` says which of the request's
    sequences the chunk belongs to (0 to n - 1), and ``finished`` ends that sequence only. ``usage``
    and ``timings`` are set on the chunk of the first token, on chunks without tokens and on the
    last chunk; None on the chunks of later tokens.
    """

    request_id: str
    token_index: int
    token_ids: tuple[int, ...]
    text: str | None
    status: str
    finish_reason: str | None = None
    error: str | None = None
    error_code: int = 0
    logprobs: tuple[TokenLogprob, ...] = ()
    usage: Usage | None = None
    timings: Timings | None = None
    weight_version: int = 0
    token_timestamps: tuple[float, ...] = ()
    stop_reason: int | str | None = None
    prompt_logprobs: tuple[PromptLogprob, ...] = ()
    index: int = 0

    @property
    def finished(self) -> bool:
        """True when this chunk ends its request, or its sequence of it (``index``) with ``n`` > 1
        (finished, cancelled or failed)."""
        return self.status in ("finished", "cancelled", "failed")


@dataclass(slots=True)
class Completion:
    """The whole output of one request.

    ``text`` is None when the server has no tokenizer. ``finish_reason`` is "eos", "stop" (a stop
    string, ``text`` ending before it, or a stop token id, included), "length", "cancelled" or
    "error" (then ``error`` says why); with "stop", ``stop_reason`` is the stop token id (int) or
    the stop string (str), else None. ``logprobs`` is None unless logprobs were requested, and
    ``prompt_logprobs`` (one entry per prompt token after the first) unless prompt logprobs were.
    ``weight_version`` is the version of the weights that produced the last token
    (``weight_versions`` lists every version seen, when a weight update happened mid-request).
    ``index`` is the sequence's among the request's ``n`` (0 for n = 1).
    """

    request_id: str
    token_ids: list[int]
    text: str | None
    finish_reason: str
    usage: Usage | None = None
    logprobs: list[TokenLogprob] | None = None
    weight_version: int = 0
    weight_versions: list[int] = field(default_factory=list)
    error: str | None = None
    timings: Timings | None = None
    token_timestamps: list[float] | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[PromptLogprob] | None = None
    index: int = 0


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """The served model (GenerationService.GetModelInfo)."""

    model_name: str
    vocab_size: int
    max_context_length: int
    eos_token_ids: tuple[int, ...]
    has_chat_template: bool
    has_tokenizer: bool
    weight_version: int


@dataclass(frozen=True, slots=True)
class Status:
    """The engine's state and counters (AdminService.GetStatus)."""

    running: bool
    paused: bool
    pause_holders: int
    queued_requests: int
    active_requests: int
    kv_blocks_used: int
    kv_blocks_total: int
    prefix_cache_hit_rate: float
    weight_version: int
    preemptions: int
    offloads: int
    restores: int
    recomputed_tokens: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    finished_requests: int
    prompt_tokens: int
    generated_tokens: int
    counters: dict[str, float] = field(default_factory=dict)
    prefix_caching_enabled: bool = False
    #: 0 when awake, else the level of the last sleep (1: KV cache freed; 2: weights on the host too).
    sleep_level: int = 0
    #: Why the weights are a mix of two versions after a failed transfer; "" when they are whole.
    weights_incomplete: str = ""
    #: The ranks this server holds in a weight-update group; empty when it is in none.
    weights_update_group_ranks: tuple[int, ...] = ()
    #: Tensor-parallel ranks serving the model: the ranks the server takes in a weight-update group.
    tensor_parallel_size: int = 1


@dataclass(frozen=True, slots=True)
class PauseInfo:
    """A message of the Pause stream: the engine is paused while the call is held."""

    paused: bool
    holders: int
    lease_expires_at: _dt.datetime | None
    weight_version: int
    cancelled_requests: int


@dataclass(frozen=True, slots=True)
class StopResult:
    """What AdminService.Stop did."""

    drained_requests: int
    failed_requests: int
    already_stopped: bool


@dataclass(frozen=True, slots=True)
class WeightsUpdate:
    """What AdminService.UpdateWeights did."""

    weight_version: int
    tensors_updated: int
    version_label: str


@dataclass(frozen=True, slots=True)
class WeightsUpdateGroupInfo:
    """What AdminService.InitWeightsUpdateGroup did: the group ranks the server's tensor-parallel ranks
    took, in tensor-parallel order, and the backend in use ("gloo" or "nccl")."""

    ranks: tuple[int, ...]
    backend: str


@dataclass(frozen=True, slots=True)
class WeightsTransferReady:
    """The server waits for the buckets of an UpdateWeightsFromDistributed transfer: the trainer
    broadcasts them now. How many buckets and bytes the server expects."""

    num_buckets: int
    num_bytes: int


@dataclass(frozen=True, slots=True)
class SleepResult:
    """What AdminService.Sleep did.

    ``released_bytes`` is the size of what was released, allocated or not (the KV cache, and the weights
    at level 2 on a GPU); ``resident_bytes_released`` how much the memory in use fell, as the system
    counts it (on a GPU the device memory torch reserves, on the CPU the server process's RSS): lower
    where part of the cache was never written, None where the server cannot measure it.
    ``affected_requests``: the in-flight requests put back in the queue (mode "keep") or cancelled (mode
    "abort")."""

    released_bytes: int
    affected_requests: int
    resident_bytes_released: int | None = None


@dataclass(frozen=True, slots=True)
class PrefixCacheReset:
    """What AdminService.ResetPrefixCache did: the reusable prefix blocks dropped, and the requests
    cancelled first (with ``abort``)."""

    dropped_blocks: int
    aborted_requests: int


@dataclass(frozen=True, slots=True)
class TensorChecksum:
    """The digest of one tensor: its name in the model's state dict, the dtype it is held in (as
    safetensors names it: "F32", "BF16", ...) and its (whole) shape."""

    name: str
    digest: str
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class WeightsChecksum:
    """A digest of a model's weights: of them all (``digest``), and of each tensor by name when asked for
    (``tensors``, empty otherwise). ``algorithm`` names how it is computed ("xxh3-128");
    ``weight_version`` is the server's version of the weights it is of (0 for a digest computed by
    :func:`~cbserve_client.weights_checksum`)."""

    digest: str
    algorithm: str
    weight_version: int
    num_tensors: int
    tensors: dict[str, TensorChecksum] = field(default_factory=dict)
