"""Incremental detokenization that never splits a UTF-8 character, in time linear in the output."""

from __future__ import annotations

from typing import Any

REPLACEMENT_CHAR = "\ufffd"
# Tokens decoded before the new ones, so that a tokenizer's spacing rules (SentencePiece's leading
# space, clean-up around punctuation) see the same left context as in a whole-sequence decode.
CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Each step decodes only a short window, as vLLM and TGI do: `tokens[prefix_offset:]` against
    `tokens[prefix_offset:read_offset]`, both starting at the same token, and emits the difference.
    Byte-level tokenizers can end a token in the middle of a multi-byte character, which decodes to
    U+FFFD: then nothing is emitted and the window grows until a later token completes the character.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._prefix_offset = 0  # first token of the decoding window
        self._read_offset = 0  # tokens before this one are emitted as text

    def _decode(self, token_ids: list[int]) -> str:
        return str(self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens))

    def step(self, token_ids: list[int]) -> str:
        """The text that `token_ids` (all tokens so far) add to what was already emitted."""
        prefix_text = self._decode(token_ids[self._prefix_offset : self._read_offset])
        window_text = self._decode(token_ids[self._prefix_offset :])
        if len(window_text) <= len(prefix_text) or window_text.endswith(REPLACEMENT_CHAR):
            return ""
        self._prefix_offset = max(self._prefix_offset, len(token_ids) - CONTEXT_TOKENS)
        self._read_offset = len(token_ids)
        return window_text[len(prefix_text) :]

    def flush(self, token_ids: list[int]) -> str:
        """The held-back rest once no token will follow (a U+FFFD then stands for truly invalid bytes)."""
        prefix_text = self._decode(token_ids[self._prefix_offset : self._read_offset])
        window_text = self._decode(token_ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(token_ids)
        return window_text[len(prefix_text) :]
