"""Stop strings: find the first one in a stream of text deltas, holding back what may begin one."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StopCheck:
    """What one delta of text lets the caller emit, and whether a stop string ended the output."""

    text: str
    stopped: bool


class StopStringMatcher:
    """Cuts a stream of text before the first stop string to be completed.

    "First" is by where a stop string ends, then by where it starts: with "c" and "ac", the text "acb"
    ends before "ac". Counting in characters, not deltas, makes the cut the same however the text was
    split (a stream's deltas follow its tokens, which a caller does not choose).

    Invariant: `_held` never contains a whole stop string, and is the longest tail of the text seen so
    far that is a proper prefix of one. Held text is emitted as soon as a later delta rules the match out,
    so a stream never emits text it has to take back, and waits for at most the longest stop string
    less one character.
    """

    def __init__(self, stop_strings: list[str]) -> None:
        if not stop_strings or not all(stop_strings):
            raise ValueError("stop strings must be a non-empty list of non-empty strings")
        self._stop_strings = stop_strings
        self._held = ""
        self.stopped = False
        # The stop string that ended the output, once one has.
        self.matched: str | None = None

    def feed(self, text: str) -> StopCheck:
        """Checks the next delta; after a match, every later delta is dropped."""
        if self.stopped:
            return StopCheck("", True)
        window = self._held + text
        # Any match ends inside `text`, since `_held` holds none: searching the window finds them all,
        # and a string's first occurrence is also the first to end.
        matches = [
            (at + len(stop), at, stop) for stop in self._stop_strings if (at := window.find(stop)) >= 0
        ]
        if matches:
            self._held = ""
            self.stopped = True
            _, start, self.matched = min(matches)
            return StopCheck(window[:start], True)
        held_len = self._longest_tail_that_begins_a_stop_string(window)
        self._held = window[len(window) - held_len :]
        return StopCheck(window[: len(window) - held_len], False)

    def flush(self) -> str:
        """The held text, once the stream has ended without completing a stop string."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _longest_tail_that_begins_a_stop_string(self, window: str) -> int:
        longest = 0
        for stop in self._stop_strings:
            for length in range(min(len(stop) - 1, len(window)), longest, -1):
                if stop.startswith(window[len(window) - length :]):
                    longest = length
                    break
        return longest
