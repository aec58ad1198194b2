"""`WaitingQueue`: the requests waiting to be admitted, in the order the scheduler admits them.

Invariant: it holds exactly the PENDING requests, never a finished one. Under "fifo" and "prefill_first",
preempted requests (pushed to the head) are ahead of every request never admitted (appended at the tail);
under "priority", all are in `priority_key` order.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterator

from engine.request import Request


def priority_key(request: Request) -> tuple[int, int]:
    """The "priority" policy's order: smaller priority first, ties first-come."""
    return (request.priority, request.arrival_index)


class WaitingQueue:
    def __init__(self, by_priority: bool) -> None:
        self.by_priority = by_priority
        self._requests: deque[Request] = deque()

    def __len__(self) -> int:
        return len(self._requests)

    def __bool__(self) -> bool:
        return bool(self._requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._requests)

    def push(self, request: Request, preempted: bool) -> None:
        if self.by_priority:
            bisect.insort(self._requests, request, key=priority_key)
        elif preempted:
            self._requests.appendleft(request)
        else:
            self._requests.append(request)

    def push_released_fork(self, sequence: Request) -> None:
        """A sequence of an n > 1 request that will not be forked waits as a request of its own: behind the
        preempted requests at the head, ahead of every request never admitted (it arrived before them)."""
        if self.by_priority:
            self.push(sequence, preempted=False)
            return
        position = next(
            (index for index, request in enumerate(self._requests) if request.num_preemptions == 0),
            len(self._requests),
        )
        self._requests.insert(position, sequence)

    def remove(self, request: Request) -> None:
        """O(queue): admissions take the head, and cancelling a queued request is rare."""
        self._requests.remove(request)

    def has_preempted(self) -> bool:
        """Whether a preempted request waits to run again (it is still in flight)."""
        if self.by_priority:
            return any(request.num_preemptions > 0 for request in self._requests)
        return bool(self._requests) and self._requests[0].num_preemptions > 0

    def next_to_admit(self, hold_new_admissions: bool) -> Request | None:
        """The head, or while new admissions are held (a WAIT pause) the first preempted request."""
        if not self._requests:
            return None
        if not hold_new_admissions:
            return self._requests[0]
        if self.by_priority:
            return next((request for request in self._requests if request.num_preemptions > 0), None)
        return self._requests[0] if self._requests[0].num_preemptions > 0 else None
