"""Logits processing that depends on a request's own tokens: penalties and `min_new_tokens`.

Applied, as in transformers' `generate`, to the raw logits before temperature, top-k and top-p, and
before the argmax of greedy rows:

- `repetition_penalty` (transformers' semantics): the logit of every token already in the prompt or
  the output is divided by the penalty when positive, multiplied by it when negative.
- `presence_penalty` and `frequency_penalty` (OpenAI's semantics): the logit of a token generated c > 0
  times so far drops by `presence_penalty + c * frequency_penalty`. The prompt does not count.
- `min_new_tokens`: the request's EOS ids cannot be sampled before it has generated that many tokens.

What each request has generated is counted on the device, in one row per request of a pooled tensor,
incremented with the step's sampled tokens before they reach the host. A step launched before the
previous one's tokens are known (async batching) therefore sees them already counted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.request import Request
from engine.runner.device_copies import to_device


@dataclass
class PenalizedRows:
    """The rows of one step's logits that were processed, and their rows in the counts pool."""

    logit_rows: torch.Tensor  # rows of the step's logits (device)
    count_rows: torch.Tensor  # rows of TokenCounts for the same requests (device)


class TokenCounts:
    """Per request: how often each token was generated, and which tokens the prompt holds.

    Invariant: the row of a live request counts exactly the tokens sampled for it so far, including
    those of a step still running. Rows are taken on a request's first processed step and given back
    once it has ended (checked at every step, so no caller has to report the end).
    """

    def __init__(self, vocab_size: int, device: torch.device, initial_rows: int = 8) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.generated = torch.zeros(initial_rows, vocab_size, dtype=torch.int32, device=device)
        self.in_prompt = torch.zeros(initial_rows, vocab_size, dtype=torch.bool, device=device)
        self._rows: dict[str, tuple[Request, int]] = {}
        self._free_rows = list(range(initial_rows - 1, -1, -1))

    @property
    def num_rows_in_use(self) -> int:
        return len(self._rows)

    def rows_for(self, requests: list[Request]) -> list[int]:
        self._release_ended()
        rows = []
        for request in requests:
            held = self._rows.get(request.request_id)
            if held is not None and held[0] is not request:  # an ended request's id, reused
                self._free_rows.append(held[1])
                held = None
            if held is None:
                row = self._take_row()
                self._fill(row, request)
                self._rows[request.request_id] = (request, row)
            else:
                row = held[1]
            rows.append(row)
        return rows

    def add(self, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Counts one sampled token per row, on the device (no wait for the host)."""
        ones = torch.ones_like(rows, dtype=torch.int32)
        self.generated.index_put_((rows, token_ids), ones, accumulate=True)

    def _release_ended(self) -> None:
        ended = [request_id for request_id, (request, _) in self._rows.items() if request.is_finished]
        for request_id in ended:
            _, row = self._rows.pop(request_id)
            self._free_rows.append(row)

    def _take_row(self) -> int:
        if not self._free_rows:
            self._grow()
        return self._free_rows.pop()

    def _grow(self) -> None:
        old_rows = self.generated.shape[0]
        generated = torch.zeros(2 * old_rows, self.vocab_size, dtype=torch.int32, device=self.device)
        in_prompt = torch.zeros(2 * old_rows, self.vocab_size, dtype=torch.bool, device=self.device)
        generated[:old_rows] = self.generated
        in_prompt[:old_rows] = self.in_prompt
        self.generated, self.in_prompt = generated, in_prompt
        self._free_rows.extend(range(2 * old_rows - 1, old_rows - 1, -1))

    def _fill(self, row: int, request: Request) -> None:
        # Tokens the host already knows; a token still being sampled is counted by `add` when it is.
        self.generated[row].zero_()
        self.in_prompt[row].zero_()
        prompt = to_device(request.prompt_ids, torch.long, self.device)
        self.in_prompt[row].index_fill_(0, prompt, True)
        generated = request.generated_tokens
        if generated:
            tokens = to_device(generated, torch.long, self.device)
            self.generated[row].index_put_(
                (tokens,), torch.ones_like(tokens, dtype=torch.int32), accumulate=True
            )


class LogitsPenalties:
    """Applies the penalties and `min_new_tokens` of the rows that set them, in one pass over those rows."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.counts: TokenCounts | None = None

    def apply(
        self, logits: torch.Tensor, requests: list[Request]
    ) -> tuple[torch.Tensor, PenalizedRows | None]:
        """Processed logits (a new tensor, or `logits` itself when no row asks for anything) and the
        processed rows, whose sampled tokens `count` must then record."""
        rows = [row for row, request in enumerate(requests) if request.sampling.processes_logits]
        if not rows:
            return logits, None
        if self.counts is None:
            self.counts = TokenCounts(logits.shape[1], self.device)
        selected = [requests[row] for row in rows]
        logit_rows = to_device(rows, torch.long, logits.device)
        count_rows = to_device(self.counts.rows_for(selected), torch.long, logits.device)
        processed = self._process(logits.index_select(0, logit_rows), count_rows, selected)
        return logits.index_copy(0, logit_rows, processed), PenalizedRows(logit_rows, count_rows)

    def count(self, penalized: PenalizedRows, token_ids: torch.Tensor) -> None:
        assert self.counts is not None
        self.counts.add(penalized.count_rows, token_ids.index_select(0, penalized.logit_rows))

    def _process(
        self, logits: torch.Tensor, count_rows: torch.Tensor, requests: list[Request]
    ) -> torch.Tensor:
        assert self.counts is not None
        params = [request.sampling for request in requests]
        generated = self.counts.generated.index_select(0, count_rows)
        was_generated = generated > 0
        repetition = [p.repetition_penalty or 1.0 for p in params]
        if any(value != 1.0 for value in repetition):
            seen = was_generated | self.counts.in_prompt.index_select(0, count_rows)
            penalty = to_device(repetition, logits.dtype, logits.device).unsqueeze(1)
            logits = torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)
        frequency = [p.frequency_penalty or 0.0 for p in params]
        presence = [p.presence_penalty or 0.0 for p in params]
        if any(frequency) or any(presence):
            frequency_t = to_device(frequency, logits.dtype, logits.device).unsqueeze(1)
            presence_t = to_device(presence, logits.dtype, logits.device).unsqueeze(1)
            logits = logits - frequency_t * generated - presence_t * was_generated
        for row, request in enumerate(requests):
            # The token sampled now is the request's (num_tokens - 1)th: its placeholder is counted.
            num_generated_before = request.num_tokens - 1 - request.num_prompt_tokens
            eos_ids = [token for token in sorted(request.sampling.eos_token_ids) if token < logits.shape[1]]
            if num_generated_before < request.sampling.min_new_tokens and eos_ids:
                logits[row].index_fill_(0, to_device(eos_ids, torch.long, logits.device), float("-inf"))
        return logits
