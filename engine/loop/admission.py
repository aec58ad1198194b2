"""Whether the engine takes a request, decided in one place: `admit`, which returns None or a typed
`Rejection`; and the `AdmissionLedger` of the requests it took and has not finished.

    manager.add_request ──build_request──> Request ──GenerationLoop.submit: admit(request, limits, ledger)
                                                          None: recorded in the ledger, posted to the loop
                                                          Rejection: raised by the manager (`error()`)

A rejection names its reason, the field at fault and the bound it broke; callers raise it as the
exception they have always got: ValueError for a request that can never run here,
DuplicateRequestError (a ValueError) for one that reuses a live id, QueueFullError when
`max_queue_size` requests wait. A stopped engine refuses quietly (the manager warns and returns None).
Requests that pass are never checked again: the loop's engine and the other tensor-parallel ranks queue
them as they come.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Protocol

import torch

from engine.errors import DuplicateRequestError, QueueFullError
from engine.request import KVOnWeightUpdate, Request, sequence_request_id
from engine.sampling.params import SamplingParams, check_token_ids, sequence_seed

if TYPE_CHECKING:
    from engine.kv.cache_manager import KVCacheManager


class RejectionReason(StrEnum):
    STOPPED = "stopped"
    DUPLICATE_ID = "duplicate_id"
    QUEUE_FULL = "queue_full"
    # Prompt + max_new_tokens is more than the whole full-attention KV cache holds.
    KV_CACHE_TOO_SMALL = "kv_cache_too_small"
    # One window plus one step is more than a sliding-window cache group holds.
    SLIDING_WINDOW_CACHE_TOO_SMALL = "sliding_window_cache_too_small"
    # Prompt + max_new_tokens is more positions than the model has.
    PAST_MAX_MODEL_LEN = "past_max_model_len"


@dataclass(frozen=True)
class Rejection:
    """Why a request was refused, in words a caller can act on (`message`) and as data."""

    reason: RejectionReason
    # The request's field or the setting at fault: "max_new_tokens", "request_id", "max_queue_size"; None
    # where neither is (a stopped engine).
    field: str | None
    # The limit the request broke (tokens, blocks, positions, queued requests); None where none applies.
    bound: int | None
    message: str

    def error(self) -> Exception:
        """The exception callers get for it (the same types as before admission was one function)."""
        if self.reason == RejectionReason.QUEUE_FULL:
            return QueueFullError(self.message)
        if self.reason == RejectionReason.DUPLICATE_ID:
            return DuplicateRequestError(self.message)
        return ValueError(self.message)


class AdmissionLimits(Protocol):
    """The sizes a request must fit, fixed once the engine is built (`EngineCore` has them), so that any
    thread may read them."""

    kv_cache_manager: KVCacheManager
    max_batch_tokens: int
    max_model_len: int | None


class AdmissionLedger:
    """The requests admitted and not yet finished: what makes an id a duplicate and the queue full.

    Not locked itself: the generation loop calls it with its lock held. Invariants: `live_ids` holds the
    id of every admitted sequence until it finishes (a request with n > 1 has n); `sequence_ids` maps an
    n > 1 request's id to its sequences' ids while any of them is live; `num_queued` counts the admitted
    sequences not yet scheduled (nor finished), which `max_queue_size` bounds (0: unbounded).
    """

    def __init__(self, max_queue_size: int) -> None:
        self.max_queue_size = max_queue_size
        self.accepting = True
        self.live_ids: set[str] = set()
        self.sequence_ids: dict[str, tuple[str, ...]] = {}
        self.num_queued = 0

    def rejection(self, ids: tuple[str, ...]) -> Rejection | None:
        """Why sequences with `ids` cannot be taken now, or None."""
        if not self.accepting:
            return Rejection(RejectionReason.STOPPED, None, None, "the manager is stopped")
        for request_id in ids:
            if request_id in self.live_ids or request_id in self.sequence_ids:
                return Rejection(
                    RejectionReason.DUPLICATE_ID,
                    "request_id",
                    None,
                    f"request_id {request_id!r} is already in flight",
                )
        if self.max_queue_size and self.num_queued >= self.max_queue_size:
            return Rejection(
                RejectionReason.QUEUE_FULL,
                "max_queue_size",
                self.max_queue_size,
                f"the request queue is full ({self.num_queued} waiting, max_queue_size="
                f"{self.max_queue_size}); retry later",
            )
        return None

    def record(self, request: Request) -> None:
        """Takes in an admitted request and its `pending_forks` (n > 1), each counted as one queued."""
        ids = sequence_ids_of(request)
        self.live_ids.update(ids)
        if len(ids) > 1:
            self.sequence_ids[request.request_id] = ids
        self.num_queued += len(ids)

    def ids_of(self, request_id: str) -> tuple[str, ...]:
        """The live sequences of a request (itself, unless n > 1)."""
        return self.sequence_ids.get(request_id, (request_id,))

    def scheduled(self, num_sequences: int) -> None:
        """`num_sequences` queued sequences were scheduled for the first time."""
        self.num_queued -= num_sequences

    def finished(self, request: Request) -> None:
        """A sequence ended (or was refused by the engine before it was ever scheduled)."""
        self.live_ids.discard(request.request_id)
        if request.scheduled_time is None:
            self.num_queued -= 1
        parent_id = request.parent_request_id
        sequence_ids = self.sequence_ids.get(parent_id, ())
        if sequence_ids and self.live_ids.isdisjoint(sequence_ids):
            del self.sequence_ids[parent_id]


def sequence_ids_of(request: Request) -> tuple[str, ...]:
    return tuple(sequence.request_id for sequence in (request, *request.pending_forks))


def admit(request: Request, limits: AdmissionLimits, ledger: AdmissionLedger) -> Rejection | None:
    """The engine's one admission decision for `request` and its `pending_forks`: None when it may be
    queued, else why not. With the ledger's lock held (engine.loop.generation_loop.GenerationLoop.submit)."""
    return size_rejection(request, limits) or ledger.rejection(sequence_ids_of(request))


def size_rejection(request: Request, limits: AdmissionLimits) -> Rejection | None:
    """Why `request` can never run with these limits, or None: the full-attention cache cannot hold all
    its tokens, a sliding-window group cannot hold one window plus one step of it, or the model has too
    few positions."""
    manager = limits.kv_cache_manager
    max_new_tokens = request.sampling.max_new_tokens
    max_tokens = request.num_prompt_tokens + max_new_tokens
    tokens = f"{request.num_prompt_tokens} prompt + {max_new_tokens} max_new_tokens"
    capacity = manager.capacity_tokens
    if capacity is not None and max_tokens > capacity:
        return Rejection(
            RejectionReason.KV_CACHE_TOO_SMALL,
            "max_new_tokens",
            capacity,
            f"request {request.request_id!r} needs up to {max_tokens} tokens of KV cache ({tokens}) "
            f"but the whole cache holds {capacity} tokens ({manager.block_pool.num_usable_blocks} blocks "
            f"of {manager.page_size}); raise num_blocks or lower max_new_tokens",
        )
    step = min(limits.max_batch_tokens, max_tokens)
    for group in manager.sliding_window_groups:
        needed = group.max_blocks_per_step(step)
        available = group.block_pool.num_usable_blocks
        if needed > available:
            return Rejection(
                RejectionReason.SLIDING_WINDOW_CACHE_TOO_SMALL,
                "max_batch_tokens",
                available,
                f"request {request.request_id!r} needs {needed} sliding-window KV blocks (a window of "
                f"{group.sliding_window} tokens plus a step of {step}, in blocks of {manager.page_size}) "
                f"but the sliding-window cache holds {available}; raise num_blocks or lower max_batch_tokens",
            )
    if limits.max_model_len is not None and max_tokens > limits.max_model_len:
        return Rejection(
            RejectionReason.PAST_MAX_MODEL_LEN,
            "max_new_tokens",
            limits.max_model_len,
            f"request {request.request_id!r} needs {max_tokens} positions ({tokens}) but the engine serves "
            f"this model at most {limits.max_model_len} (max_model_len: its max_position_embeddings, or the "
            "shorter length the engine computes it exactly up to, as logged at load)",
        )
    return None


def build_request(
    request_id: Any,
    input_ids: Any,
    sampling_params: SamplingParams,
    vocab_size: int,
    *,
    streaming: bool,
    record_timestamps: bool,
    priority: Any,
    kv_on_weight_update: Any = KVOnWeightUpdate.KEEP,
) -> Request:
    """The request `add_request`'s arguments describe, its other sequences (n > 1) in `pending_forks`;
    ValueError naming a malformed id, prompt, priority or kv_on_weight_update."""
    if not isinstance(request_id, str) or not request_id:
        raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
    prompt_ids = _prompt_ids(input_ids, vocab_size)
    if isinstance(priority, bool) or not isinstance(priority, int) or not -(2**31) <= priority < 2**31:
        raise ValueError(f"priority must be an int in [-2**31, 2**31), got {priority!r}")
    policies = [policy.value for policy in KVOnWeightUpdate]
    if kv_on_weight_update not in policies:
        raise ValueError(f"kv_on_weight_update must be one of {policies}, got {kv_on_weight_update!r}")
    sequences = [
        Request(
            sequence_request_id(request_id, index),
            prompt_ids,
            dataclasses.replace(sampling_params, seed=sequence_seed(sampling_params.seed, index)),
            streaming=streaming,
            record_timestamps=record_timestamps,
            priority=priority,
            index=index,
            kv_on_weight_update=KVOnWeightUpdate(kv_on_weight_update),
        )
        for index in range(sampling_params.n)
    ]
    request = sequences[0]
    request.pending_forks = sequences[1:]
    for sequence in request.pending_forks:
        sequence.prompt_logprobs = request.prompt_logprobs  # one prompt: its logprobs are shared
    return request


def _prompt_ids(input_ids: Any, vocab_size: int) -> list[int]:
    if isinstance(input_ids, torch.Tensor):
        input_ids = input_ids.flatten().tolist()
    if not isinstance(input_ids, (list, tuple)) or not input_ids:
        raise ValueError("input_ids must be a non-empty list of token ids")
    return check_token_ids("input_ids", input_ids, vocab_size)
