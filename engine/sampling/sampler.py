"""Per-request sampling, vectorised over the batch.

Penalties and `min_new_tokens` (engine.sampling.penalties) come first, for the rows that set them, then the
grammar masks of structured output (engine.sampling.structured_output); then temperature, top-k, top-p
and min-p are applied to all sampled rows in one pass. The random draw uses the exponential race
(`argmax(p / E)`, E ~ Exp(1)), which samples from `p` without a cumulative sum; each seeded request draws its
noise from its own generator, so its tokens depend on its seed alone, never on which requests share its batch.

Logprobs are of the raw logits, or, for a request in `processed_logprobs` mode
(engine.sampling.params.LogprobsMode), of the very logits its token was drawn from. A request with
`return_kept_mass` also gets the log of the mass the truncation kept (`log_kept_mass`): a processed logprob
plus it is the token's log-probability before top-k, top-p and min-p.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.request import Request, SamplingParams
from engine.sampling.penalties import LogitsPenalties
from engine.sampling.structured_output import apply_grammar_masks, constrained_rows
from engine.system.device_copies import HostCopies, to_device

# Columns per block in the CPU's two-stage greedy pick (greedy_tokens).
GREEDY_BLOCK_COLUMNS = 128


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The column of each row's maximum, the first of tied maxima: argmax's tokens.

    On the CPU, `max(dim).indices` (itself 1.5x faster than argmax) walks a row one element at a time:
    1.5-1.8 ms for 64 rows of 32,000 logits, where the maximum alone (`amax`) is vectorised and takes
    0.2 ms. So there the pick takes two stages: the first block of columns that holds the row's maximum,
    then the first column inside it that does (0.4 ms). The first block holding the maximum holds its
    first occurrence, so ties resolve as argmax resolves them.
    """
    num_rows, vocab_size = logits.shape
    if logits.device.type != "cpu" or vocab_size % GREEDY_BLOCK_COLUMNS or not logits.is_contiguous():
        return logits.max(dim=-1).indices
    blocks = logits.view(num_rows, vocab_size // GREEDY_BLOCK_COLUMNS, GREEDY_BLOCK_COLUMNS)
    best_blocks = blocks.amax(dim=-1).max(dim=-1).indices
    rows = torch.arange(num_rows, device=logits.device)
    return best_blocks * GREEDY_BLOCK_COLUMNS + blocks[rows, best_blocks].max(dim=-1).indices


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float] | None  # the chosen token's, as its request's logprobs_mode says
    top_logprobs: list[dict[int, float]] | None
    # Per row, `log_kept_mass` of its distribution for the rows that asked (SamplingParams.return_kept_mass),
    # 0.0 for the others; None when no row asked.
    log_kept_masses: list[float] | None = None


class SampledTokens:
    """One step's sampled tokens (and log-probabilities), on the device and on their way to the host.

    `token_ids` stays on the device: the next step reads a decoding request's input from it before the
    host knows the token (async batching). `to_output()` waits for the host copies.
    """

    def __init__(
        self,
        token_ids: torch.Tensor,
        logprobs: torch.Tensor | None,
        top_logprobs: tuple[torch.Tensor, torch.Tensor] | None,
        top_logprob_counts: list[int],
        log_kept_masses: torch.Tensor | None = None,
    ) -> None:
        self.token_ids = token_ids
        self._has_logprobs = logprobs is not None
        self._has_top = top_logprobs is not None
        self._has_kept_masses = log_kept_masses is not None
        tensors = [token_ids]
        if logprobs is not None:
            tensors.append(logprobs)
        if log_kept_masses is not None:
            tensors.append(log_kept_masses)
        if top_logprobs is not None:
            tensors.extend(top_logprobs)
        self._copies = HostCopies(tensors)
        self._top_logprob_counts = top_logprob_counts

    def to_output(self) -> SamplerOutput:
        token_ids, *rest = self._copies.wait()
        logprobs = rest.pop(0).tolist() if self._has_logprobs else None
        log_kept_masses = rest.pop(0).tolist() if self._has_kept_masses else None
        top_logprobs = None
        if self._has_top:
            values, indices = rest
            # Processed logprobs are -inf for the tokens the sampling filters removed: those are left out.
            top_logprobs = [
                {
                    token: value
                    for token, value in zip(
                        indices[row, :count].tolist(), values[row, :count].tolist(), strict=True
                    )
                    if value != -math.inf
                }
                for row, count in enumerate(self._top_logprob_counts)
            ]
        return SamplerOutput(token_ids.tolist(), logprobs, top_logprobs, log_kept_masses)


class Sampler:
    def __init__(self, device: torch.device, seed: int | None = None) -> None:
        self._default_generator = torch.Generator(device=device)
        if seed is not None:
            self._default_generator.manual_seed(seed)
        else:
            self._default_generator.seed()
        self.penalties = LogitsPenalties(device)

    # Under inference mode like the forward pass, whose logits it may process in place.
    @torch.inference_mode()
    def sample(
        self, logits: torch.Tensor, requests: list[Request], generators: list[torch.Generator | None]
    ) -> SampledTokens:
        """logits [R, V] (any float dtype) for the R requests that sample a token this step, in order.
        Queues the work and the copies back to the host; never waits for the device.

        Log-probabilities follow each request's `logprobs_mode` (engine.sampling.params.LogprobsMode):
        of the raw logits, or of the logits its token was drawn from.
        """
        logits = logits.float()
        params = [request.sampling for request in requests]
        want_logprobs = any(p.logprobs or p.top_logprobs for p in params)
        want_raw = any((p.logprobs or p.top_logprobs) and not p.wants_processed_logprobs for p in params)
        # Penalties work in place, through flat indices: a step that has them works on a contiguous copy
        # when the raw logits are still needed for logprobs or are not contiguous. Others copy nothing.
        # Rows a grammar constrains (engine.sampling.structured_output) are masked after the penalties.
        grammar_rows = constrained_rows(requests)
        processed = logits
        if (any(p.processes_logits for p in params) or grammar_rows) and (
            want_raw or not logits.is_contiguous()
        ):
            processed = logits.clone(memory_format=torch.contiguous_format)
        penalized = self.penalties.apply(processed, requests)
        apply_grammar_masks(processed, requests, grammar_rows)
        token_ids = greedy_tokens(processed)
        # Rows drawn at a temperature, and greedy ones at a temperature (top_k=1) whose processed logprobs
        # or kept mass come from the same filtered logits.
        scaled_rows = [
            row
            for row, p in enumerate(params)
            if not p.is_greedy or (p.samples and (p.wants_processed_logprobs or p.return_kept_mass))
        ]
        scaled: torch.Tensor | None = None
        log_kept_masses: torch.Tensor | None = None
        if scaled_rows:
            rows = to_device(scaled_rows, torch.long, logits.device)
            scaled_params = [params[r] for r in scaled_rows]
            tempered = tempered_logits(processed.index_select(0, rows), scaled_params)
            scaled = truncated_logits(tempered, scaled_params)
            log_kept_masses = _log_kept_masses(tempered, scaled, scaled_rows, params)
            drawn = [index for index, row in enumerate(scaled_rows) if not params[row].is_greedy]
            if len(drawn) == len(scaled_rows):
                token_ids.index_copy_(0, rows, self._draw(scaled, [generators[row] for row in scaled_rows]))
            elif drawn:
                picks = to_device(drawn, torch.long, logits.device)
                chosen = self._draw(
                    scaled.index_select(0, picks), [generators[scaled_rows[index]] for index in drawn]
                )
                token_ids.index_copy_(0, rows.index_select(0, picks), chosen)
        if penalized is not None:
            self.penalties.record(penalized, token_ids)

        logprobs: torch.Tensor | None = None
        top_logprobs: tuple[torch.Tensor, torch.Tensor] | None = None
        if want_logprobs:
            source = _logprobs_source(logits, processed, scaled, scaled_rows, params)
            log_probs = torch.log_softmax(source, dim=-1)
            logprobs = log_probs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
            max_top = max(p.top_logprobs for p in params)
            if max_top:
                top_logprobs = log_probs.topk(max_top, dim=-1)
        return SampledTokens(
            token_ids, logprobs, top_logprobs, [p.top_logprobs for p in params], log_kept_masses
        )

    def _draw(self, logits: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
        """One token per row of the (temperature-scaled, filtered) `logits`, by the exponential race."""
        probs = torch.softmax(logits, dim=-1)
        noise = torch.empty_like(probs)
        for row, generator in enumerate(generators):
            noise[row].exponential_(generator=generator or self._default_generator)
        return probs.div_(noise).max(dim=-1).indices


def _logprobs_source(
    raw: torch.Tensor,
    processed: torch.Tensor,
    scaled: torch.Tensor | None,
    scaled_rows: list[int],
    params: list[SamplingParams],
) -> torch.Tensor:
    """The logits each row's logprobs are taken from: the raw ones, or for a request in processed mode
    those its token was drawn from (`scaled` for the rows in `scaled_rows`, else the penalised ones)."""
    processed_rows = [row for row, p in enumerate(params) if p.wants_processed_logprobs]
    if not processed_rows:
        return raw
    source = processed
    if len(processed_rows) < len(params) and processed is not raw:
        source = raw.clone()
        rows = to_device(processed_rows, torch.long, raw.device)
        source.index_copy_(0, rows, processed.index_select(0, rows))
    wanted = [index for index, row in enumerate(scaled_rows) if params[row].wants_processed_logprobs]
    if scaled is not None and wanted:
        rows = to_device([scaled_rows[index] for index in wanted], torch.long, raw.device)
        source = source.index_copy(0, rows, scaled.index_select(0, to_device(wanted, torch.long, raw.device)))
    return source


def _log_kept_masses(
    tempered: torch.Tensor, truncated: torch.Tensor, scaled_rows: list[int], params: list[SamplingParams]
) -> torch.Tensor | None:
    """`log_kept_mass` of the rows of `scaled_rows` that asked for it, in a tensor with one entry per row of
    the step (0.0 for the others); None, computing nothing, when none asked."""
    wanted = [index for index, row in enumerate(scaled_rows) if params[row].return_kept_mass]
    if not wanted:
        return None
    if len(wanted) < len(scaled_rows):
        picks = to_device(wanted, torch.long, tempered.device)
        tempered, truncated = tempered.index_select(0, picks), truncated.index_select(0, picks)
    masses = torch.zeros(len(params), dtype=tempered.dtype, device=tempered.device)
    rows = to_device([scaled_rows[index] for index in wanted], torch.long, tempered.device)
    return masses.index_copy_(0, rows, log_kept_mass(tempered, truncated))


def log_kept_mass(tempered: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """Per row, the log of the probability mass under softmax(`tempered`) of the tokens `truncated` (the
    same logits after top-k, top-p and min-p, the removed ones at -inf) still has: log S, with the
    token's processed logprob log(p / S). 0.0 exactly for a row nothing was removed from.

    log S = logsumexp(truncated) - logsumexp(tempered), taken as the difference of the rows' largest
    log_softmax: the most likely token is never removed, so both are its logit minus its row's logsumexp.
    log_softmax reduces each row on its own in a fixed order on both devices (a plain sum reduction splits
    a row by the batch's shape on CUDA), so the value has the same bits whatever else is in the batch; and
    a sum of the same terms in the same order with some of them zero is never larger, so it is never
    above 0.
    """
    most_likely_of_all = torch.log_softmax(tempered, dim=-1).amax(dim=-1)
    most_likely_of_kept = torch.log_softmax(truncated, dim=-1).amax(dim=-1)
    return most_likely_of_all - most_likely_of_kept


def tempered_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """`logits` (one row per request, penalised) divided by each request's temperature: the distribution
    top-k, top-p and min-p then act on."""
    temperatures = to_device([p.temperature or 1.0 for p in params], logits.dtype, logits.device)
    return logits / temperatures.unsqueeze(1)


def truncated_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Tempered `logits` with each request's top-k, top-p and min-p applied: the tokens they remove are
    at -inf. Softmax of the result is what a token is drawn from."""
    vocab_size = logits.shape[1]
    top_ks = [p.top_k if p.top_k else vocab_size for p in params]
    top_ps = [p.top_p if p.top_p is not None else 1.0 for p in params]
    if min(top_ks) < vocab_size or min(top_ps) < 1.0:
        logits = _apply_top_k_top_p(logits, top_ks, top_ps)
    min_ps = [p.min_p or 0.0 for p in params]
    if max(min_ps) > 0.0:
        logits = _apply_min_p(logits, min_ps)
    return logits


def _apply_top_k_top_p(logits: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
    sorted_logits, sorted_indices = logits.sort(dim=-1, descending=True)
    vocab_size = logits.shape[1]
    ranks = torch.arange(vocab_size, device=logits.device).unsqueeze(0)
    remove = ranks >= to_device(top_ks, torch.long, logits.device).unsqueeze(1)
    # Top-p keeps the smallest prefix whose mass reaches p: drop a token when the mass before it does.
    sorted_probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    remove |= mass_before >= to_device(top_ps, logits.dtype, logits.device).unsqueeze(1)
    remove[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_indices, sorted_logits)


def _apply_min_p(logits: torch.Tensor, min_ps: list[float]) -> torch.Tensor:
    """Drops the tokens whose probability (after temperature, top-k and top-p) is below min_p times the
    most likely token's; that token always stays."""
    probs = torch.softmax(logits, dim=-1)
    thresholds = probs.amax(dim=-1, keepdim=True) * to_device(min_ps, probs.dtype, probs.device).unsqueeze(1)
    return logits.masked_fill(probs < thresholds, float("-inf"))


def request_generator(seed: int, device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator
