"""Incremental detokenization that never splits a UTF-8 character."""

from __future__ import annotations

from typing import Any

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Byte-level tokenizers can end a token in the middle of a multi-byte character; decoding such a prefix
    yields U+FFFD. Each step decodes every token so far (the only decoding that is always right, since
    tokenizers may merge or clean up spaces across token boundaries) and emits the new suffix, holding
    back a trailing U+FFFD until a later token completes the character.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._emitted = 0

    def _decode(self, token_ids: list[int]) -> str:
        return str(self._tokenizer.decode(token_ids, skip_special_tokens=True))

    def step(self, token_ids: list[int]) -> str:
        """The text that `token_ids` (all tokens so far) add to what was already emitted."""
        stable = self._decode(token_ids).rstrip(REPLACEMENT_CHAR)
        if len(stable) <= self._emitted:
            return ""
        delta = stable[self._emitted :]
        self._emitted = len(stable)
        return delta

    def flush(self, token_ids: list[int]) -> str:
        """The held-back rest once no token will follow (a U+FFFD then stands for truly invalid bytes)."""
        text = self._decode(token_ids)
        delta = text[self._emitted :]
        self._emitted = len(text)
        return delta
