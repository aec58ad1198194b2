"""Per-request logits processing: logit bias, penalties and `min_new_tokens`.

Applied, as in transformers' `generate`, to the raw logits before temperature, top-k and top-p, and
before the argmax of greedy rows, in this order:

- `logit_bias`: a fixed amount added to the logits of given token ids (transformers' `sequence_bias`
  with sequences of one token, OpenAI's `logit_bias`).
- `repetition_penalty` (transformers' semantics): the logit of every token already in the prompt or
  the output is divided by the penalty when positive, multiplied by it when negative.
- `presence_penalty` and `frequency_penalty` (OpenAI's semantics): the logit of a token generated c > 0
  times so far drops by `presence_penalty + c * frequency_penalty`. The prompt does not count.
- `min_new_tokens`: the request's EOS ids cannot be sampled before it has generated that many tokens.

The work is proportional to the tokens a request has seen, not to the vocabulary: each request's
tokens are kept on the device (`TokenHistory`), and the penalties gather the logits at those tokens and
scatter the penalised values back. A step's sampled tokens are written into the history on the device
before they reach the host, so a step launched before the previous one's tokens are known (async
batching) finds them there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.request import Request
from engine.system.device_copies import to_device


@dataclass
class PenalizedRows:
    """The rows of one step's logits that were processed, and where their sampled tokens go."""

    logit_rows: torch.Tensor  # rows of the step's logits
    history_rows: torch.Tensor  # the same requests' rows of TokenHistory
    positions: torch.Tensor  # each sampled token's position in its request (prompt first)


class TokenHistory:
    """Every request's prompt and generated tokens, on the device, one row per request.

    Invariant: for a live request, positions [0, n) of its row hold its first n tokens, where n counts
    the tokens sampled by steps still running (they are written there by the step that samples them).
    Rows are taken on a request's first processed step and given back once it has ended (checked at
    every step, so no caller has to report the end); rows and columns grow by doubling.
    """

    def __init__(self, device: torch.device, initial_rows: int = 8, initial_columns: int = 256) -> None:
        self.device = device
        self.tokens = torch.zeros(initial_rows, initial_columns, dtype=torch.long, device=device)
        self._rows: dict[str, tuple[Request, int]] = {}
        self._free_rows = list(range(initial_rows - 1, -1, -1))

    def rows_for(self, requests: list[Request]) -> list[int]:
        self._release_ended()
        rows = []
        for request in requests:
            held = self._rows.get(request.request_id)
            if held is not None and held[0] is not request:  # an ended request's id, reused
                self._free_rows.append(held[1])
                held = None
            if held is None:
                row = self._take_row(request.num_prompt_tokens + request.sampling.max_new_tokens)
                # What the host knows; a token still being sampled is written by the step sampling it.
                known = to_device(request.all_token_ids, torch.long, self.device)
                self.tokens[row, : known.shape[0]] = known
                self._rows[request.request_id] = (request, row)
            else:
                row = held[1]
            rows.append(row)
        return rows

    def write(self, rows: torch.Tensor, positions: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Records one sampled token per row, on the device (no wait for the host)."""
        self.tokens.index_put_((rows, positions), token_ids)

    def _release_ended(self) -> None:
        ended = [request_id for request_id, (request, _) in self._rows.items() if request.is_finished]
        for request_id in ended:
            _, row = self._rows.pop(request_id)
            self._free_rows.append(row)

    def _take_row(self, max_tokens: int) -> int:
        rows, columns = self.tokens.shape
        if not self._free_rows or max_tokens > columns:
            grown_rows = rows if self._free_rows else 2 * rows
            grown_columns = max(columns, 1 << (max_tokens - 1).bit_length())
            tokens = torch.zeros(grown_rows, grown_columns, dtype=torch.long, device=self.device)
            tokens[:rows, :columns] = self.tokens
            self.tokens = tokens
            self._free_rows.extend(range(grown_rows - 1, rows - 1, -1))
        return self._free_rows.pop()


class LogitsPenalties:
    """Applies the penalties and `min_new_tokens` of the rows that set them, in one pass over those rows."""

    def __init__(self, device: torch.device) -> None:
        self.history = TokenHistory(device)

    def apply(self, logits: torch.Tensor, requests: list[Request]) -> PenalizedRows | None:
        """Processes, in place, the rows of `logits` [R, V] whose requests ask for it, and returns them
        (their sampled tokens must then be `record`ed), or None when no row asks for anything."""
        rows = [row for row, request in enumerate(requests) if request.sampling.processes_logits]
        if not rows:
            return None
        selected = [requests[row] for row in rows]
        device = logits.device
        logit_rows = to_device(rows, torch.long, device)
        history_rows = to_device(self.history.rows_for(selected), torch.long, device)
        # The token sampled now is each request's (num_tokens - 1)th: its placeholder is counted.
        num_before = [request.num_tokens - 1 for request in selected]
        self._add_bias(logits, rows, selected)
        self._penalize(logits, logit_rows, history_rows, selected, num_before)
        self._hold_eos_back(logits, rows, selected, num_before)
        return PenalizedRows(logit_rows, history_rows, to_device(num_before, torch.long, device))

    def record(self, penalized: PenalizedRows, token_ids: torch.Tensor) -> None:
        sampled = token_ids.index_select(0, penalized.logit_rows)
        self.history.write(penalized.history_rows, penalized.positions, sampled)

    def _penalize(
        self,
        logits: torch.Tensor,
        logit_rows: torch.Tensor,
        history_rows: torch.Tensor,
        requests: list[Request],
        num_before: list[int],
    ) -> None:
        """Penalises `logits` in place at the tokens each request has seen, through flat indices
        (row * V + token) so that only those entries are read and written.

        A token seen several times is gathered and scattered once per occurrence: every copy computes the
        same value, so the order in which duplicates land does not matter. Positions past a request's
        tokens are padding and point at a token whose written value they repeat.
        """
        params = [request.sampling for request in requests]
        repetition = [p.repetition_penalty or 1.0 for p in params]
        presence = [p.presence_penalty or 0.0 for p in params]
        frequency = [p.frequency_penalty or 0.0 for p in params]
        if all(value == 1.0 for value in repetition) and not any(presence) and not any(frequency):
            return  # min_new_tokens only
        device, dtype = logits.device, logits.dtype
        flat = logits.view(-1)
        row_offsets = (logit_rows * logits.shape[1]).unsqueeze(1)
        width = max(num_before)
        seen = self.history.tokens[:, :width].index_select(0, history_rows)
        positions = torch.arange(width, device=device).unsqueeze(0)
        prompt_lens = to_device([request.num_prompt_tokens for request in requests], torch.long, device)
        lengths = to_device(num_before, torch.long, device).unsqueeze(1)
        if any(value != 1.0 for value in repetition):
            # Padding repeats the first prompt token, which every request has seen.
            at = row_offsets + torch.where(positions < lengths, seen, seen[:, :1])
            penalty = to_device(repetition, dtype, device).unsqueeze(1)
            values = flat[at]
            flat[at] = torch.where(values > 0, values / penalty, values * penalty)
        if not any(presence) and not any(frequency):
            return
        is_output = (positions >= prompt_lens.unsqueeze(1)) & (positions < lengths)
        has_output = lengths.squeeze(1) > prompt_lens
        if any(presence):
            # Padding repeats the request's first generated token (or, with none yet, writes nothing new).
            first_output = seen.gather(1, prompt_lens.clamp(max=width - 1).unsqueeze(1))
            at = row_offsets + torch.where(is_output, seen, first_output)
            penalty = (to_device(presence, dtype, device) * has_output).unsqueeze(1)
            flat[at] = flat[at] - penalty
        if any(frequency):
            penalty = to_device(frequency, dtype, device).unsqueeze(1)
            flat.index_add_(0, (row_offsets + seen).flatten(), (-penalty * is_output).flatten())

    @staticmethod
    def _add_bias(logits: torch.Tensor, rows: list[int], requests: list[Request]) -> None:
        vocab_size = logits.shape[1]
        pairs = [
            (row * vocab_size + token, bias)
            for row, request in zip(rows, requests, strict=True)
            for token, bias in request.sampling.logit_bias
        ]
        if pairs:
            at, biases = zip(*pairs, strict=True)
            device = logits.device
            logits.view(-1).index_add_(
                0, to_device(at, torch.long, device), to_device(biases, logits.dtype, device)
            )

    @staticmethod
    def _hold_eos_back(
        logits: torch.Tensor, rows: list[int], requests: list[Request], num_before: list[int]
    ) -> None:
        vocab_size = logits.shape[1]
        at = [
            row * vocab_size + token
            for row, request, before in zip(rows, requests, num_before, strict=True)
            if before - request.num_prompt_tokens < request.sampling.min_new_tokens
            for token in request.sampling.eos_token_ids | request.sampling.stop_token_ids
            if token < vocab_size
        ]
        if at:
            logits.view(-1).index_fill_(0, to_device(at, torch.long, logits.device), float("-inf"))
