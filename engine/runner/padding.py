"""Which steps are padded, to what shapes, and the padding tokens and logits rows that fill them.

Padding rounds a step up to a bounded set of shapes, so CUDA graphs captured ahead of use (and
static-shape compilation) cover every padded step with few distinct shapes.

- A decode-only step: the number of rows to `padded_size(rows, rows_interval)` and the key width to a
  multiple of the KV interval. Padding rows are fake requests at position 0 whose block table is the
  null block alone, so they write their keys to the null block's first slot and attend to it.
- A step with prefill chunks of at most `varlen_max_tokens` tokens, on the kernel path only (varlen CUDA
  graphs): the packed tokens to `padded_size(tokens, tokens_interval)`, the requests to
  `padded_size(requests, rows_interval)` and the block tables to `max_blocks_per_request` columns.
  Padding tokens belong to no request (no kernel tile reads them; their attention output is zero) and
  write their keys to the null block's first slot; padding requests own no tokens.

Padded logits rows are never sampled. The null block therefore holds finite values that only masked
columns and padding rows ever read.

Prompt logprobs (SamplingParams.prompt_logprobs) need the logits of prompt rows that do not sample. A
padded decode step computes every row's logits anyway, so they are read from there; a step with prefill
chunks that has such rows runs unpadded (its logits count follows its prompt rows, which no captured
shape covers), as do steps too large to pad.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def padded_size(size: int, interval: int) -> int:
    """`size` rounded up to a power of two below `interval`, to a multiple of `interval` from there on:
    small decode batches waste little, large ones need few distinct shapes."""
    if size >= interval:
        return round_up(size, interval)
    return 1 << max(size - 1, 0).bit_length()


def padded_sizes(max_size: int, interval: int) -> list[int]:
    """Every distinct `padded_size` of 1 .. max_size, ascending."""
    sizes = []
    size = 1
    while size <= max_size:
        sizes.append(padded_size(size, interval))
        size = sizes[-1] + 1
    return sizes


class VarlenShape(NamedTuple):
    """The packed tokens and requests a step with prefill chunks is padded to (kernel path only)."""

    num_tokens: int
    num_requests: int

    def num_tiles(self, queries_per_tile: int) -> int:
        """The most kernel tiles a step of this shape can need."""
        # Each request's tiles cover its queries with less than one tile to spare.
        return self.num_tokens // queries_per_tile + self.num_requests


@dataclass(frozen=True)
class Padding:
    """Which steps are padded, and the granularity of their shapes in tokens: rows (requests), key width,
    and packed tokens of steps with prefill chunks."""

    rows_interval: int
    keys_interval: int
    tokens_interval: int
    decode: bool = True
    varlen: bool = False
    # Steps with prefill chunks are padded only up to this many packed tokens (larger ones run unpadded).
    varlen_max_tokens: int = 0

    def decode_rows(self, num_rows: int, min_rows: int) -> int:
        """The rows a decode-only step of `num_rows` rows is padded to: at least `min_rows`."""
        return padded_size(max(num_rows, min_rows), self.rows_interval)

    def varlen_shape(self, num_tokens: int, num_requests: int) -> VarlenShape | None:
        """The shape a step with prefill chunks is padded to on the kernel path; None when it runs
        unpadded."""
        if not self.varlen or num_tokens > self.varlen_max_tokens:
            return None
        return VarlenShape(
            padded_size(num_tokens, self.tokens_interval), padded_size(num_requests, self.rows_interval)
        )


@dataclass
class PackedTokens:
    """One step's tokens packed on the host in packed-row order, which padding extends."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    # Packed rows whose logits the model computes.
    logits_rows: list[int] = field(default_factory=list)
    # Which of those logits rows are sampled, in scheduling order; None when all of them are.
    sampled_logits: list[int] | None = None
    # Packed rows whose logits give prompt logprobs, and (after `add_prompt_logits`) which logits rows
    # hold them.
    prompt_rows: list[int] = field(default_factory=list)
    prompt_logits: list[int] | None = None
    num_padding_rows: int = 0
    is_padded: bool = False

    def pad_decode_rows(self, num_rows: int) -> None:
        """Pads a decode-only step (one token per row) to `num_rows` rows."""
        # Logits of every row, so their count depends on the padded shape alone.
        self.sampled_logits = self.logits_rows
        self.logits_rows = list(range(num_rows))
        self._pad_tokens(num_rows)

    def pad_varlen(self, shape: VarlenShape) -> None:
        """Pads a step with prefill chunks to `shape`."""
        # Logits of one row per request, so their count depends on the padded shape alone.
        self.sampled_logits = list(range(len(self.logits_rows)))
        self.logits_rows.extend([0] * (shape.num_requests - len(self.logits_rows)))
        self._pad_tokens(shape.num_tokens)

    def add_prompt_logits(self) -> None:
        """Adds the logits of `prompt_rows`, once the step is padded (or not): a padded decode step already
        computes every row's, other steps compute them after the sampled rows'."""
        if not self.prompt_rows:
            return
        if self.is_padded:
            # Only decode steps are padded when they have prompt rows: their logits rows are the packed rows.
            assert self.logits_rows == list(range(len(self.input_ids))), "a padded varlen step"
            self.prompt_logits = list(self.prompt_rows)
            return
        num_sampled = len(self.logits_rows)
        self.sampled_logits = list(range(num_sampled))
        self.prompt_logits = list(range(num_sampled, num_sampled + len(self.prompt_rows)))
        self.logits_rows.extend(self.prompt_rows)

    def _pad_tokens(self, num_tokens: int) -> None:
        self.num_padding_rows = num_tokens - len(self.input_ids)
        self.input_ids.extend([0] * self.num_padding_rows)
        self.positions.extend([0] * self.num_padding_rows)
        self.is_padded = True
