"""The n sequences of one request (SamplingParams.n), as the wire sees them: one `RequestRecord` each,
read together.

Each sequence keeps its own record (tokens, text, stop strings, logprobs, status) and streams its own
chunks, marked with its index; the request is over once every sequence is. A request with n = 1 is a
group of one, so every caller handles both alike.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import TypeVar

from cbserve_client.proto import types_pb2

from engine import RequestStatus
from service.request_record import RequestRecord

T = TypeVar("T")


class SequenceGroup:
    def __init__(self, records: list[RequestRecord]) -> None:
        assert records and [record.index for record in records] == list(range(len(records)))
        self.records = records

    @property
    def request_id(self) -> str:
        return self.records[0].request_id

    @property
    def prompt_len(self) -> int:
        return self.records[0].prompt_len

    @property
    def queued_at(self) -> float:
        return self.records[0].queued_at

    @property
    def finished(self) -> bool:
        return all(record.finished for record in self.records)

    @property
    def failed(self) -> bool:
        return any(record.status == RequestStatus.FAILED for record in self.records)

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(record.token_ids) for record in self.records)

    def add_listener(self, listener: Callable[[SequenceGroup], None]) -> None:
        """`listener(group)` runs on the event loop after every update of any sequence; the group is
        `finished` at the last call."""
        for record in self.records:
            record.add_listener(lambda _record: listener(self))

    async def wait_finished(self) -> None:
        for record in self.records:
            await record.wait_finished()

    def current_chunks(self) -> list[types_pb2.GenerationChunk]:
        """Each sequence's present status, without tokens."""
        return [record.chunk(0, 0) for record in self.records]

    async def tail(self, from_index: int, send_current: bool) -> AsyncIterator[types_pb2.GenerationChunk]:
        """Every sequence's chunks from its token `from_index` on (RequestRecord.tail), interleaved as they
        come, until each has sent its terminal one."""
        async for _index, chunk in merged([record.tail(from_index, send_current) for record in self.records]):
            yield chunk


async def merged(iterators: list[AsyncIterator[T]]) -> AsyncGenerator[tuple[int, T], None]:
    """(position of the iterator, item) for the items of every iterator, in the order they come, until
    all are exhausted; an iterator's error is raised. One iterator is read in place; several are each
    pumped by a task, which end with the caller's iteration however it ends."""
    if len(iterators) == 1:
        async for item in iterators[0]:
            yield 0, item
        return
    queue: asyncio.Queue[tuple[int, T] | _Ended] = asyncio.Queue()

    async def pump(position: int, iterator: AsyncIterator[T]) -> None:
        try:
            async for item in iterator:
                queue.put_nowait((position, item))
        except Exception as exc:
            queue.put_nowait(_Ended(exc))
        else:
            queue.put_nowait(_Ended(None))

    tasks = [asyncio.create_task(pump(position, iterator)) for position, iterator in enumerate(iterators)]
    try:
        remaining = len(tasks)
        while remaining:
            entry = await queue.get()
            if isinstance(entry, _Ended):
                if entry.error is not None:
                    raise entry.error
                remaining -= 1
                continue
            yield entry
    finally:
        for task in tasks:
            task.cancel()


class _Ended:
    """An iterator of `merged` is exhausted, or failed with `error`."""

    def __init__(self, error: Exception | None) -> None:
        self.error = error
