"""One request's outputs as the wire sees them: kept, fanned out to readers, cut into deltas."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from cbserve_client.proto import types_pb2
from google.protobuf.timestamp_pb2 import Timestamp

from engine import FinishReason, GenerationOutput, RequestStatus
from service.detokenizer import IncrementalDetokenizer
from service.stop_strings import StopStringMatcher

_STATUS = {
    RequestStatus.PENDING: types_pb2.REQUEST_STATUS_QUEUED,
    RequestStatus.PREFILLING: types_pb2.REQUEST_STATUS_PREFILLING,
    RequestStatus.DECODING: types_pb2.REQUEST_STATUS_DECODING,
    RequestStatus.FINISHED: types_pb2.REQUEST_STATUS_FINISHED,
    RequestStatus.CANCELLED: types_pb2.REQUEST_STATUS_CANCELLED,
    RequestStatus.FAILED: types_pb2.REQUEST_STATUS_FAILED,
}
_FINISH_REASON = {
    FinishReason.EOS: types_pb2.FINISH_REASON_EOS,
    FinishReason.LENGTH: types_pb2.FINISH_REASON_LENGTH,
    FinishReason.CANCELLED: types_pb2.FINISH_REASON_CANCELLED,
    FinishReason.ERROR: types_pb2.FINISH_REASON_ERROR,
    FinishReason.STOP: types_pb2.FINISH_REASON_STOP,
}
_INTERNAL = 13  # google.rpc.Code INTERNAL: an engine failure while the request ran

logger = logging.getLogger(__name__)


class RequestRecord:
    """Everything sent about one request, kept so that any reader can start from any token index; with
    n > 1 (SamplingParams.n), about one of its sequences, `index` (service.sequence_group).

    Lives on the server's event loop: `on_output` (the engine's result handler) and the readers run
    there, so no lock is needed. Readers wait on `_changed`, an event replaced after every update, which
    fans one update out to any number of readers without a queue per reader.
    """

    def __init__(
        self,
        request_id: str,
        prompt_len: int,
        tokenizer: Any | None,
        weight_version: int,
        logprobs: bool,
        record_timestamps: bool,
        stop_strings: list[str] | None = None,
        skip_special_tokens: bool = True,
        index: int = 0,
    ) -> None:
        self.request_id = request_id
        self.index = index
        self.prompt_len = prompt_len
        self.weight_version = weight_version
        # The engine's latest output of this sequence: the one source of its status (see `status`).
        self._latest_output: GenerationOutput | None = None
        self.token_ids: list[int] = []
        # The weight version that produced each token.
        self._token_versions: list[int] = []
        self.finish_reason: FinishReason | None = None
        # With FinishReason.STOP: the stop token id or the stop string that ended the output.
        self.stop_reason: int | str | None = None
        # With prompt_logprobs: one entry per prompt token after the first, once the prompt is computed,
        # and the prompt's ids (the first has no entry).
        self.prompt_logprobs: list[types_pb2.PromptLogprob] = []
        self.prompt_token_ids: list[int] = []
        self.error = ""
        self.num_cached_tokens = 0
        self.queued_at = time.time()
        self.scheduled_at: float | None = None
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self._want_logprobs = logprobs
        self._want_timestamps = record_timestamps
        self._logprobs: list[types_pb2.TokenLogprob] = []
        self._token_times: list[float] = []
        self._detokenizer = (
            IncrementalDetokenizer(tokenizer, skip_special_tokens) if tokenizer is not None else None
        )
        # Ends the request when its text shows a stop string; the engine, which sees only tokens, is
        # then told to cancel it (see `stopped_by_text`).
        self._stop_matcher = (
            StopStringMatcher(stop_strings) if stop_strings and self._detokenizer is not None else None
        )
        # Text completed by each token (often "" while a character is incomplete), plus what only the
        # end of the request releases, so a reader resuming at token k gets exactly the text after k.
        self._text_by_token: list[str] = []
        self._tail_text = ""
        self._changed = asyncio.Event()
        self._listeners: list[Callable[[RequestRecord], None]] = []

    @property
    def token_times(self) -> list[float]:
        """When each token arrived (the engine's stamp if recorded, else when its output came): read-only."""
        return self._token_times

    @property
    def status(self) -> RequestStatus:
        """The engine's status of the sequence as of its latest output (only engine.request assigns a
        status), except that a stop string matched here ends it FINISHED: the engine, which sees only
        tokens, is then told to cancel it, and its later outputs are not recorded."""
        if self.stopped_by_text:
            return RequestStatus.FINISHED
        return self._latest_output.status if self._latest_output is not None else RequestStatus.PENDING

    @property
    def finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED

    @property
    def matched_stop_string(self) -> str | None:
        """The stop string that ended the output, if one did."""
        return self._stop_matcher.matched if self._stop_matcher is not None else None

    @property
    def stopped_by_text(self) -> bool:
        """A stop string ended the request here, whatever the engine still thinks of it."""
        return self._stop_matcher is not None and self._stop_matcher.stopped

    def on_output(self, output: GenerationOutput) -> None:
        """Records one cumulative engine output (runs on the event loop, via the engine's handler)."""
        if self.finished:
            return
        now = time.time()
        new_tokens = output.generated_tokens[len(self.token_ids) :]
        # Scheduled: prefilling or decoding, or ended having run (not a request cancelled while queued).
        ran = output.status in (RequestStatus.PREFILLING, RequestStatus.DECODING, RequestStatus.FINISHED)
        if (ran or output.generated_tokens) and self.scheduled_at is None:
            self.scheduled_at = now
        if new_tokens and self.first_token_at is None:
            self.first_token_at = now
        if output.weight_version:
            self.weight_version = output.weight_version
        for token in new_tokens:
            index = len(self.token_ids)
            self.token_ids.append(token)
            self._token_versions.append(self.weight_version)
            self._text_by_token.append(
                self._released_text(self._detokenizer.step(self.token_ids)) if self._detokenizer else ""
            )
            if self._want_logprobs and index < len(output.logprobs):
                self._logprobs.append(_token_logprob(output, index))
            stamps = output.timestamps
            self._token_times.append(stamps[index] if stamps and index < len(stamps) else now)
            if self.stopped_by_text:
                break  # the tokens after the one that completed a stop string are not part of the output
        self.num_cached_tokens = output.num_cached_tokens
        if output.prompt_logprobs and not self.prompt_logprobs:
            self.prompt_logprobs = _prompt_logprobs(output)
            self.prompt_token_ids = list(output.prompt_ids)
        self._latest_output = output
        if self.finished:
            self._finish(output, now)
        self._notify()
        self._call_listeners()

    def _released_text(self, text: str) -> str:
        return self._stop_matcher.feed(text).text if self._stop_matcher is not None else text

    def _finish(self, output: GenerationOutput, now: float) -> None:
        self.finished_at = now
        if self._detokenizer is not None and not self.stopped_by_text:
            self._tail_text = self._released_text(self._detokenizer.flush(self.token_ids))
            if self._stop_matcher is not None:
                self._tail_text += self._stop_matcher.flush()
        if self.stopped_by_text:
            self.finish_reason = FinishReason.STOP
            self.stop_reason = self.matched_stop_string
            self.error = ""
        else:
            self.finish_reason = output.finish_reason
            self.stop_reason = output.stop_reason
            self.error = output.error or ""

    def add_listener(self, listener: Callable[[RequestRecord], None]) -> None:
        """`listener(record)` runs on the event loop after every update, the last time once the request
        has ended (never if it already has). Its errors are logged, never raised into the engine's handler."""
        if not self.finished:
            self._listeners.append(listener)

    def _call_listeners(self) -> None:
        listeners = self._listeners
        if self.finished:
            self._listeners = []
        for listener in listeners:
            try:
                listener(self)
            except Exception:
                logger.exception("a listener of request %s failed", self.request_id)

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def wait_finished(self) -> None:
        while not self.finished:
            await self._changed.wait()

    async def tail(self, from_index: int, send_current: bool) -> AsyncIterator[types_pb2.GenerationChunk]:
        """Chunks from token `from_index` on, until the terminal one.

        Tokens that arrive while a reader is busy are merged into its next chunk, so a slow reader never
        makes the engine wait. `send_current` sends the present status first even when nothing is new.
        """
        async for start, end, _finished in self.token_ranges(from_index, send_current):
            yield self.chunk(start, end)

    async def token_ranges(self, from_index: int, send_current: bool) -> AsyncIterator[tuple[int, int, bool]]:
        """(start, end, finished) for each update from token `from_index` on: the new tokens are
        `token_ids[start:end]` (possibly none, when only the status changed), and the last update has
        `finished` set. Updates that arrive while the reader is busy are merged into its next one."""
        cursor = from_index
        sent_status = None if send_current else self.status
        while True:
            changed = self._changed
            end = len(self.token_ids)
            if cursor < end or self.status != sent_status or self.finished:
                start, cursor, finished = cursor, max(cursor, end), self.finished
                sent_status = self.status
                yield start, end, finished
                if finished:
                    return
            await changed.wait()

    def token_logprobs(self, start: int, end: int) -> list[types_pb2.TokenLogprob]:
        """The logprobs of tokens [start, end), when the request asked for them (else empty)."""
        return self._logprobs[start:end]

    def chunk(self, start: int, end: int) -> types_pb2.GenerationChunk:
        """The delta of tokens [start, end) with the request's present status."""
        chunk = types_pb2.GenerationChunk(
            request_id=self.request_id,
            index=self.index,
            token_index=start,
            token_ids=self.token_ids[start:end],
            logprobs=self._logprobs[start:end],
            status=_STATUS[self.status],
            weight_version=self._token_versions[end - 1] if end > start else self.weight_version,
            token_timestamps=self._token_times[start:end] if self._want_timestamps else [],
        )
        if self._detokenizer is not None:
            text = "".join(self._text_by_token[start:end])
            chunk.text = text + self._tail_text if self.finished else text
        if start == 0 and end > 0:  # the chunk of the first token: the prompt was computed by then
            chunk.prompt_logprobs.extend(self.prompt_logprobs)
        if self.finished:
            chunk.finish_reason = _FINISH_REASON[self.finish_reason or FinishReason.ERROR]
            if isinstance(self.stop_reason, str):
                chunk.stop_string = self.stop_reason
            elif self.stop_reason is not None:
                chunk.stop_token_id = self.stop_reason
            chunk.error = self.error
            if self.status == RequestStatus.FAILED:
                chunk.error_code = _INTERNAL
        # Usage and timings ride on the chunks where they say something new: one without tokens (a status
        # change, or a reader's present status), the first token's and the terminal one. A chunk of later
        # tokens carries its delta only: the two would be 68 of a decoded token's 119 bytes, built, sent and
        # parsed for every token (the proto's GenerationChunk.usage and .timings say which chunks carry them).
        if end <= start or start == 0 or self.finished:
            chunk.usage.CopyFrom(
                types_pb2.Usage(
                    prompt_tokens=self.prompt_len,
                    generated_tokens=len(self.token_ids),
                    cached_tokens=self.num_cached_tokens,
                )
            )
            self._fill_timings(chunk.timings)
        return chunk

    def _fill_timings(self, timings: types_pb2.Timings) -> None:
        timings.queued_at.CopyFrom(_timestamp(self.queued_at))
        if self.scheduled_at is not None:
            timings.scheduled_at.CopyFrom(_timestamp(self.scheduled_at))
            timings.queue_time_s = self.scheduled_at - self.queued_at
        if self.first_token_at is not None:
            timings.first_token_at.CopyFrom(_timestamp(self.first_token_at))
            timings.time_to_first_token_s = self.first_token_at - self.queued_at
        if self.finished_at is not None:
            timings.finished_at.CopyFrom(_timestamp(self.finished_at))


def _token_logprob(output: GenerationOutput, index: int) -> types_pb2.TokenLogprob:
    top = output.top_logprobs[index] if index < len(output.top_logprobs) else {}
    ranked = sorted(top.items(), key=lambda item: item[1], reverse=True)
    entry = types_pb2.TokenLogprob(
        logprob=output.logprobs[index],
        top_logprobs=[types_pb2.TopLogprob(token_id=token, logprob=value) for token, value in ranked],
    )
    if index < len(output.log_kept_masses):
        entry.log_kept_mass = output.log_kept_masses[index]
    return entry


def _prompt_logprobs(output: GenerationOutput) -> list[types_pb2.PromptLogprob]:
    """The engine's prompt logprobs (positions 1.. of the prompt) as the wire carries them."""
    assert output.prompt_logprobs is not None
    entries = []
    for token, (logprob, top) in zip(output.prompt_ids[1:], output.prompt_logprobs, strict=False):
        ranked = sorted(top.items(), key=lambda item: item[1], reverse=True)
        alternatives = [types_pb2.TopLogprob(token_id=token_id, logprob=value) for token_id, value in ranked]
        entries.append(types_pb2.PromptLogprob(token_id=token, logprob=logprob, top_logprobs=alternatives))
    return entries


def _timestamp(seconds: float) -> Timestamp:
    stamp = Timestamp()
    stamp.FromNanoseconds(int(seconds * 1e9))
    return stamp
