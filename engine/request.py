"""A request's state inside the engine, its status and finish reason, and the output users receive."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import IntEnum, StrEnum
from typing import TYPE_CHECKING, NamedTuple, Protocol

from engine.sampling.params import SamplingParams

if TYPE_CHECKING:
    from engine.kv.offload import OffloadedKV


class RequestStatus(IntEnum):
    """Ordered so that a request is over exactly when `status >= RequestStatus.FINISHED`."""

    PENDING = 0
    PREFILLING = 1
    DECODING = 2
    FINISHED = 3
    CANCELLED = 4
    FAILED = 5


class FinishReason(StrEnum):
    """Why a request ended. The values are the wire's and the metrics' labels: "stop" is one of the
    request's stop token ids (the engine) or stop strings (matched by the service on the decoded text);
    `stop_reason` says which."""

    EOS = "eos"
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    ERROR = "error"


# The weight version of the weights a model is loaded with; each update adds one.
FIRST_WEIGHT_VERSION = 1


class KVOnWeightUpdate(StrEnum):
    """What becomes of a live request's KV when the weights change under it (an update during a KEEP
    pause or between steps): KEEP goes on from it, so the tokens before the update were made by the old
    weights and their KV stays the old weights' (each chunk's `weight_version` says which made it);
    RECOMPUTE drops it and computes prompt and generated tokens again under the new weights, so every
    token after the update is exactly what the new weights give that text."""

    KEEP = "keep"
    RECOMPUTE = "recompute"


class Grammar(Protocol):
    """What the stop check needs of a request's grammar (`Request.structured_state`; engine.sampling.
    structured_output implements it)."""

    def accept_token(self, token_id: int) -> str | None:
        """Feeds a sampled token; why the request must fail when the grammar refuses it, else None."""
        ...

    def is_complete(self) -> bool:
        """Whether the grammar has ended, so the request ends too."""
        ...


class Stop(NamedTuple):
    """How a request ends (`check_stop`): the arguments of `Request.finish`."""

    status: RequestStatus
    reason: FinishReason
    error: str | None = None
    stop_reason: int | None = None


@dataclass
class GenerationOutput:
    """What a user receives for a request: one per step when streaming, else one at the end.

    `generated_tokens` and `logprobs` are cumulative. Every request ends with exactly one output whose
    status is FINISHED, CANCELLED or FAILED.
    """

    request_id: str
    prompt_ids: list[int]
    generated_tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    # With SamplingParams.return_kept_mass: per generated token, the log of the probability mass top-k,
    # top-p and min-p kept of the distribution it was drawn from (engine.sampling.sampler.log_kept_mass).
    log_kept_masses: list[float] = field(default_factory=list)
    status: RequestStatus = RequestStatus.PENDING
    finish_reason: FinishReason | None = None
    error: str | None = None
    created_time: float = 0.0
    # Wall-clock times (time.time()) the request was first scheduled and produced its first token.
    scheduled_time: float | None = None
    first_token_time: float | None = None
    # Wall-clock time (time.time()) of each generated token, when the request records timestamps.
    timestamps: list[float] | None = None
    # Prompt tokens whose KV came from the prefix cache instead of being computed.
    num_cached_tokens: int = 0
    # The weight version (manager.weight_version) that produced the latest token; 0 before any.
    weight_version: int = 0
    # With FinishReason.STOP: the stop token id (or, in the service, the stop string) that ended it.
    stop_reason: int | str | None = None
    # With SamplingParams.prompt_logprobs: per prompt token after the first, (its logprob, the top
    # alternatives {token id: logprob}); the first prompt token has no logprob (nothing precedes it).
    prompt_logprobs: list[tuple[float, dict[int, float]]] | None = None
    # Which of the request's n sequences this is (SamplingParams.n); 0 for the first, whose id is the
    # request's (`sequence_request_id`).
    index: int = 0

    def is_finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED


def sequence_request_id(request_id: str, index: int) -> str:
    """The id of sequence `index` of a request with n > 1 (SamplingParams.n): the request's own id for the
    first, `{request_id}__child#{index - 1}` for the others, as transformers names them."""
    return request_id if index == 0 else f"{request_id}__child#{index - 1}"


class Request:
    """Engine-side state of one request.

    Progress is tracked as in vLLM: `all_token_ids` holds prompt + generated tokens and
    `num_computed_tokens` counts those whose KV is in the cache or being written by a scheduled step.
    A step that samples leaves a placeholder until its token is known (`num_output_placeholders`).
    Every step the scheduler gives a
    request some tokens so that computed catches up with `num_tokens`; prefill, chunked prefill,
    prefix-cache hits and recompute after preemption are all that one rule, with no phase flags.

    A request with n > 1 (SamplingParams.n) is n `Request`s, one per sequence: the first computes the
    prompt and holds the others in `pending_forks` until the scheduler forks them from its KV blocks
    (engine.scheduling.scheduler); each then samples on its own.
    """

    __slots__ = (
        "all_token_ids",
        "arrival_index",
        "block_hashes",
        "block_hashes_weight_version",
        "created_time",
        "error",
        "finish_reason",
        "first_token_time",
        "fork_source",
        "generator",
        "index",
        "kv_on_weight_update",
        "log_kept_masses",
        "logprobs",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_output_placeholders",
        "num_preemptions",
        "num_prompt_tokens",
        "num_tokens_to_recompute",
        "offloaded",
        "pending_forks",
        "priority",
        "prompt_logprobs",
        "record_timestamps",
        "request_id",
        "sampling",
        "scheduled_time",
        "status",
        "stop_reason",
        "streaming",
        "structured_state",
        "timestamps",
        "top_logprobs",
        "weight_version",
    )

    def __init__(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling: SamplingParams,
        streaming: bool = False,
        record_timestamps: bool = False,
        priority: int = 0,
        index: int = 0,
        kv_on_weight_update: KVOnWeightUpdate = KVOnWeightUpdate.KEEP,
    ) -> None:
        self.request_id = request_id
        self.index = index
        self.all_token_ids = list(prompt_ids)
        self.num_prompt_tokens = len(prompt_ids)
        self.sampling = sampling
        self.streaming = streaming
        self.record_timestamps = record_timestamps
        self.num_computed_tokens = 0
        # Tokens sampled by scheduled steps whose results are not back yet (engine.scheduling.scheduler).
        self.num_output_placeholders = 0
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        # Tokens whose KV was computed before the last preemption: recomputing them is counted.
        self.num_tokens_to_recompute = 0
        # Set while the request waits with its KV parked in host memory (engine.kv.offload).
        self.offloaded: OffloadedKV | None = None
        self.status = RequestStatus.PENDING
        self.finish_reason: FinishReason | None = None
        self.error: str | None = None
        # The prefix-cache keys of the request's full blocks, a chain under one weight version
        # (engine.kv.prefix_hash); the KV manager starts it again when the version moves on.
        self.block_hashes: list[bytes] = []
        self.block_hashes_weight_version = FIRST_WEIGHT_VERSION
        self.kv_on_weight_update = kv_on_weight_update
        self.logprobs: list[float] = []
        self.top_logprobs: list[dict[int, float]] = []
        self.log_kept_masses: list[float] = []
        self.timestamps: list[float] = []
        self.created_time = time.time()
        self.scheduled_time: float | None = None
        self.first_token_time: float | None = None
        # A torch.Generator, created on first sampled step, when the request carries a seed.
        self.generator: object | None = None
        # The weight version that produced the latest generated token (0 before the first).
        self.weight_version = 0
        # The "priority" scheduling policy admits smaller values first, and preempts larger ones first.
        self.priority = priority
        # Order of arrival at the scheduler (set by it): ties of priority go first-come.
        self.arrival_index = 0
        self.stop_reason: int | str | None = None
        # Filled while the prompt is computed, when SamplingParams.prompt_logprobs is set.
        self.prompt_logprobs: list[tuple[float, dict[int, float]]] | None = (
            [] if sampling.prompt_logprobs is not None else None
        )
        # The grammar matcher of a request with SamplingParams.structured_output
        # (engine.sampling.structured_output).
        self.structured_state: Grammar | None = None
        # n > 1: on the first sequence, the others until they are forked from its prompt's KV; on each of
        # those, the first sequence, until its own first token lands (a failure of the step that wrote
        # the shared KV fails it too: engine.engine_core).
        self.pending_forks: list[Request] = []
        self.fork_source: Request | None = None

    @property
    def parent_request_id(self) -> str:
        """The id of the request this is a sequence of (n > 1): its own for the first sequence."""
        return (
            self.request_id if self.index == 0 else self.request_id.removesuffix(f"__child#{self.index - 1}")
        )

    @property
    def num_tokens(self) -> int:
        """Prompt and generated tokens, counting those sampled by steps still running (placeholders)."""
        return len(self.all_token_ids) + self.num_output_placeholders

    @property
    def num_generated_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def prompt_ids(self) -> list[int]:
        return self.all_token_ids[: self.num_prompt_tokens]

    @property
    def generated_tokens(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED

    # Status transitions. Invariant: these methods are the only writers of `status` (and of
    # `finish_reason` / `error`), so a request's life can be read in one place:
    # PENDING -> PREFILLING (scheduled) -> DECODING (a token landed); PREFILLING/DECODING -> PENDING
    # (preempted); any live status -> FINISHED / CANCELLED / FAILED (`finish`), after which none changes it.

    def start_running(self) -> None:
        """Scheduled: from the queue (fresh, preempted or restored from host memory) or forked (n > 1)."""
        assert not self.is_finished, self
        self.status = RequestStatus.PREFILLING

    def append_token(self, token_id: int) -> None:
        """The token a step sampled landed: it replaces the request's oldest placeholder. A request
        preempted since (PENDING again) keeps waiting; one that was prefilling is decoding now."""
        self.num_output_placeholders -= 1
        self.all_token_ids.append(token_id)
        self.fork_source = None  # its own token landed: the KV it was forked from was sound
        if self.status == RequestStatus.PREFILLING:
            self.status = RequestStatus.DECODING

    def mark_preempted(self) -> None:
        """Its KV was freed (offloaded or to recompute): it waits in the queue again."""
        assert not self.is_finished, self
        self.status = RequestStatus.PENDING

    def finish(
        self,
        status: RequestStatus,
        reason: FinishReason,
        error: str | None = None,
        stop_reason: int | None = None,
    ) -> bool:
        """Ends the request with `status` (FINISHED, CANCELLED or FAILED); returns False, changing nothing,
        when it had already ended (the first ending wins). `stop_reason`: the stop token id that ended
        it (FinishReason.STOP)."""
        assert status >= RequestStatus.FINISHED, status
        if self.is_finished:
            return False
        self.status = status
        self.finish_reason = reason
        self.error = error
        if stop_reason is not None:
            self.stop_reason = stop_reason
        return True

    def to_output(self) -> GenerationOutput:
        return GenerationOutput(
            request_id=self.request_id,
            prompt_ids=self.prompt_ids,
            generated_tokens=self.generated_tokens,
            logprobs=list(self.logprobs),
            top_logprobs=list(self.top_logprobs),
            log_kept_masses=list(self.log_kept_masses),
            status=self.status,
            finish_reason=self.finish_reason,
            error=self.error,
            created_time=self.created_time,
            scheduled_time=self.scheduled_time,
            first_token_time=self.first_token_time,
            timestamps=list(self.timestamps) if self.record_timestamps else None,
            num_cached_tokens=self.num_cached_tokens,
            weight_version=self.weight_version,
            stop_reason=self.stop_reason,
            prompt_logprobs=list(self.prompt_logprobs) if self.prompt_logprobs is not None else None,
            index=self.index,
        )

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )


def check_stop(request: Request) -> Stop | None:
    """How `request` ends now that its newest token landed, or None when it goes on: the one place a
    generated token stops a request (the engine's stop strings are the service's, on decoded text).

    In order: one of its EOS ids, one of its stop token ids, `max_new_tokens` reached; then its grammar
    (structured output), which is fed the token here: a refused token fails the request, and a grammar
    that ended (on an EOS id the request does not stop on: it had none) ends it with EOS all the same.
    A request that stops on the token never feeds it to the grammar: the grammar is done with.
    """
    token_id = request.all_token_ids[-1]
    sampling = request.sampling
    if token_id in sampling.eos_token_ids:
        return Stop(RequestStatus.FINISHED, FinishReason.EOS)
    if token_id in sampling.stop_token_ids:
        return Stop(RequestStatus.FINISHED, FinishReason.STOP, stop_reason=token_id)
    if request.num_generated_tokens >= sampling.max_new_tokens:
        return Stop(RequestStatus.FINISHED, FinishReason.LENGTH)
    grammar = request.structured_state
    if grammar is None:
        return None
    error = grammar.accept_token(token_id)
    if error is not None:
        return Stop(RequestStatus.FAILED, FinishReason.ERROR, error)
    if grammar.is_complete():
        return Stop(RequestStatus.FINISHED, FinishReason.EOS)
    return None
