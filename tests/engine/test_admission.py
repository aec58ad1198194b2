"""The engine's one admission decision (engine.loop.admission.admit): each refusal names its reason, the
field at fault and the bound it broke, and is raised as the exception callers have always got."""

from __future__ import annotations

import pytest

from engine.errors import QueueFullError
from engine.kv.cache_manager import KVCacheManager
from engine.loop.admission import AdmissionLedger, Rejection, RejectionReason, admit, build_request
from engine.request import Request
from engine.sampling.params import SamplingParams
from engine.scheduling.scheduler import Scheduler


def make_scheduler(num_blocks: int = 64, page_size: int = 4, max_model_len: int | None = None) -> Scheduler:
    manager = KVCacheManager(num_blocks, page_size, enable_prefix_caching=True)
    return Scheduler(manager, 64, 8, 0.0, "fifo", max_model_len=max_model_len)


def make_request(request_id: str, num_prompt_tokens: int = 4, max_new_tokens: int = 4, n: int = 1) -> Request:
    sampling = SamplingParams(max_new_tokens=max_new_tokens, n=n)
    return build_request(
        request_id,
        list(range(num_prompt_tokens)),
        sampling,
        vocab_size=100,
        streaming=False,
        record_timestamps=False,
        priority=0,
    )


def test_a_request_larger_than_the_whole_cache_is_refused_naming_max_new_tokens_and_the_capacity() -> None:
    scheduler = make_scheduler(num_blocks=5, page_size=4)  # 4 usable blocks of 4: 16 tokens
    rejection = admit(make_request("big", 10, max_new_tokens=7), scheduler, AdmissionLedger(0))
    assert rejection is not None
    assert (rejection.reason, rejection.field, rejection.bound) == (
        RejectionReason.KV_CACHE_TOO_SMALL,
        "max_new_tokens",
        16,
    )
    fragments = ("'big'", "17 tokens", "10 prompt + 7 max_new_tokens", "holds 16 tokens", "4 blocks of 4")
    for fragment in fragments:
        assert fragment in rejection.message, f"{fragment!r} missing from {rejection.message!r}"
    assert admit(make_request("fits", 10, max_new_tokens=6), scheduler, AdmissionLedger(0)) is None


def test_a_request_past_the_models_positions_is_refused_naming_max_model_len() -> None:
    scheduler = make_scheduler(max_model_len=12)
    rejection = admit(make_request("long", 10, max_new_tokens=3), scheduler, AdmissionLedger(0))
    assert rejection is not None
    assert (rejection.reason, rejection.field, rejection.bound) == (
        RejectionReason.PAST_MAX_MODEL_LEN,
        "max_new_tokens",
        12,
    )
    for fragment in ("'long'", "13 positions", "10 prompt + 3 max_new_tokens", "at most 12"):
        assert fragment in rejection.message, f"{fragment!r} missing from {rejection.message!r}"
    assert isinstance(rejection.error(), ValueError)
    assert admit(make_request("ok", 10, max_new_tokens=2), scheduler, AdmissionLedger(0)) is None


def test_an_id_is_a_duplicate_while_any_sequence_of_its_request_lives_and_free_once_all_ended() -> None:
    scheduler, ledger = make_scheduler(), AdmissionLedger(0)
    request = make_request("twins", n=2)
    assert admit(request, scheduler, ledger) is None
    ledger.record(request)
    for duplicate in (make_request("twins"), make_request("twins__child#0")):
        rejection = admit(duplicate, scheduler, ledger)
        assert rejection is not None and rejection.reason == RejectionReason.DUPLICATE_ID, rejection
        assert rejection.field == "request_id" and "already in flight" in rejection.message
    ledger.finished(request)
    assert admit(make_request("twins"), scheduler, ledger) is not None, "its second sequence still lives"
    ledger.finished(request.pending_forks[0])
    assert admit(make_request("twins"), scheduler, ledger) is None


def test_a_full_queue_refuses_with_queue_full_error_naming_max_queue_size() -> None:
    scheduler, ledger = make_scheduler(), AdmissionLedger(max_queue_size=2)
    ledger.record(make_request("pair", n=2))  # each sequence counts as one queued request
    rejection = admit(make_request("third"), scheduler, ledger)
    assert rejection is not None
    assert (rejection.reason, rejection.field, rejection.bound) == (
        RejectionReason.QUEUE_FULL,
        "max_queue_size",
        2,
    )
    error = rejection.error()
    assert isinstance(error, QueueFullError) and "max_queue_size=2" in str(error)
    ledger.scheduled(1)
    assert admit(make_request("third"), scheduler, ledger) is None


def test_a_stopped_engine_refuses_quietly() -> None:
    ledger = AdmissionLedger(0)
    ledger.accepting = False
    rejection = admit(make_request("late"), make_scheduler(), ledger)
    assert isinstance(rejection, Rejection) and rejection.reason == RejectionReason.STOPPED
    assert rejection.field is None and rejection.bound is None


@pytest.mark.parametrize(
    ("request_id", "input_ids", "priority", "message"),
    [
        ("", [1, 2], 0, "request_id must be a non-empty string"),
        ("r", [], 0, "input_ids must be a non-empty list"),
        ("r", [1, 200], 0, "token id 200 is not in"),
        ("r", [1, 2], 2**31, "priority must be an int"),
    ],
)
def test_a_malformed_request_is_refused_before_admission(
    request_id: str, input_ids: list[int], priority: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        build_request(
            request_id,
            input_ids,
            SamplingParams(max_new_tokens=4),
            vocab_size=100,
            streaming=False,
            record_timestamps=False,
            priority=priority,
        )
