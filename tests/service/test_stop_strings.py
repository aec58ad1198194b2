"""The stop-string matcher: the text it lets out never depends on how the stream was cut into deltas."""

from __future__ import annotations

import itertools

import pytest
from cbserve_client.proto import types_pb2
from hypothesis import given
from hypothesis import strategies as st

from service.stop_strings import StopStringMatcher
from service.validation import ModelLimits, RequestRejected, prepare


def _run(stop_strings: list[str], deltas: list[str]) -> tuple[list[str], bool]:
    matcher = StopStringMatcher(stop_strings)
    released = []
    for delta in deltas:
        check = matcher.feed(delta)
        released.append(check.text)
        if check.stopped:
            return released, True
    released.append(matcher.flush())
    return released, False


def _cut_before_first_completed(text: str, stop_strings: list[str]) -> tuple[str, bool]:
    """The text before the stop string that ends first (then starts first), found in the whole text."""
    ends = [
        (end, end - len(stop))
        for end in range(1, len(text) + 1)
        for stop in stop_strings
        if text[:end].endswith(stop)
    ]
    return (text[: min(ends)[1]], True) if ends else (text, False)


# A small alphabet makes matches, and near misses, frequent.
_text = st.text(alphabet="ab\nc", max_size=40)
_stop_strings = st.lists(st.text(alphabet="ab\nc", min_size=1, max_size=4), min_size=1, max_size=3)


@given(text=_text, stop_strings=_stop_strings, cuts=st.lists(st.integers(0, 40), max_size=12))
def test_released_text_is_cut_before_the_first_completed_stop_string_however_it_is_split(
    text: str, stop_strings: list[str], cuts: list[int]
) -> None:
    bounds = sorted({0, len(text), *(min(cut, len(text)) for cut in cuts)})
    deltas = [text[start:end] for start, end in itertools.pairwise(bounds)]
    released, stopped = _run(stop_strings, deltas)
    expected, expected_stopped = _cut_before_first_completed(text, stop_strings)
    assert ("".join(released), stopped) == (expected, expected_stopped), (deltas, released)


@given(text=_text, stop_strings=_stop_strings)
def test_only_text_that_may_begin_a_stop_string_is_held_back(text: str, stop_strings: list[str]) -> None:
    matcher = StopStringMatcher(stop_strings)
    released = ""
    for seen in range(1, len(text) + 1):
        check = matcher.feed(text[seen - 1])
        released += check.text
        if check.stopped:
            break
        held = text[len(released) : seen]
        assert text[: len(released)] == released
        assert not held or any(len(held) < len(stop) and stop.startswith(held) for stop in stop_strings)


def test_held_text_is_released_once_the_match_is_ruled_out() -> None:
    matcher = StopStringMatcher(["\n\nUser:"])
    assert matcher.feed("Paris.\n").text == "Paris."  # "\n" may begin the stop string
    assert matcher.feed("\nUs").text == ""  # "\n\nUs" may still become the stop string
    assert matcher.feed("ually").text == "\n\nUsually"
    assert matcher.feed(" \n\nUser: hi").text == " "
    assert matcher.stopped and matcher.feed("more").text == "" and matcher.flush() == ""


def test_the_stop_string_completed_first_wins() -> None:
    # "lo w" starts later than "hello" but is complete first.
    check = StopStringMatcher(["hello world", "lo w"]).feed("hello world")
    assert (check.text, check.stopped) == ("hel", True)
    # Both complete at the same character: the cut is at the earlier start.
    check = StopStringMatcher(["c", "ac"]).feed("bacb")
    assert (check.text, check.stopped) == ("b", True)


def test_an_empty_stop_string_is_refused() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        StopStringMatcher(["ok", ""])


def test_stop_strings_need_a_tokenizer() -> None:
    request = types_pb2.GenerationRequest(
        token_ids=types_pb2.TokenIds(ids=[1, 2]), sampling=types_pb2.SamplingParams(stop=["\n"])
    )
    limits = ModelLimits(vocab_size=256, max_context_length=64, default_max_new_tokens=8)
    with pytest.raises(RequestRejected, match=r"sampling\.stop: the served model has no tokenizer"):
        prepare(request, limits, tokenizer=None)
