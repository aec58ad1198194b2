"""Per-request sampling, vectorised over the batch.

Temperature, top-k and top-p are applied to all sampled rows in one pass. The random draw uses the
exponential race (`argmax(p / E)`, E ~ Exp(1)), which samples from `p` without a cumulative sum; each
seeded request draws its noise from its own generator, so its tokens depend on its seed alone, never
on which requests share its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.request import SamplingParams


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float] | None  # log_softmax of the model's logits at the chosen token
    top_logprobs: list[dict[int, float]] | None


class Sampler:
    def __init__(self, device: torch.device, seed: int | None = None) -> None:
        self._default_generator = torch.Generator(device=device)
        if seed is not None:
            self._default_generator.manual_seed(seed)
        else:
            self._default_generator.seed()

    def __call__(
        self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
    ) -> SamplerOutput:
        """logits [R, V] (any float dtype) for the R rows that sample a token this step."""
        logits = logits.float()
        token_ids = logits.argmax(dim=-1)
        sampled_rows = [row for row, p in enumerate(params) if not p.is_greedy]
        if sampled_rows:
            rows = torch.tensor(sampled_rows, dtype=torch.long, device=logits.device)
            chosen = self._sample(
                logits.index_select(0, rows),
                [params[r] for r in sampled_rows],
                [generators[r] for r in sampled_rows],
            )
            token_ids.index_copy_(0, rows, chosen)

        want_logprobs = any(p.logprobs or p.top_logprobs for p in params)
        logprobs: list[float] | None = None
        top_logprobs: list[dict[int, float]] | None = None
        if want_logprobs:
            log_probs = torch.log_softmax(logits, dim=-1)
            logprobs = log_probs.gather(1, token_ids.unsqueeze(1)).squeeze(1).tolist()
            max_top = max(p.top_logprobs for p in params)
            if max_top:
                values, indices = log_probs.topk(max_top, dim=-1)
                top_logprobs = [
                    dict(
                        zip(
                            indices[row, : p.top_logprobs].tolist(),
                            values[row, : p.top_logprobs].tolist(),
                            strict=True,
                        )
                    )
                    for row, p in enumerate(params)
                ]
        return SamplerOutput(token_ids.tolist(), logprobs, top_logprobs)

    def _sample(
        self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
    ) -> torch.Tensor:
        temperatures = torch.tensor([p.temperature or 1.0 for p in params], dtype=logits.dtype)
        logits = logits / temperatures.unsqueeze(1)
        vocab_size = logits.shape[1]
        top_ks = [p.top_k if p.top_k else vocab_size for p in params]
        top_ps = [p.top_p if p.top_p is not None else 1.0 for p in params]
        if min(top_ks) < vocab_size or min(top_ps) < 1.0:
            logits = _apply_top_k_top_p(logits, top_ks, top_ps)
        probs = torch.softmax(logits, dim=-1)
        noise = torch.empty_like(probs)
        for row, generator in enumerate(generators):
            noise[row].exponential_(generator=generator or self._default_generator)
        return probs.div_(noise).argmax(dim=-1)


def _apply_top_k_top_p(logits: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
    sorted_logits, sorted_indices = logits.sort(dim=-1, descending=True)
    vocab_size = logits.shape[1]
    ranks = torch.arange(vocab_size, device=logits.device).unsqueeze(0)
    remove = ranks >= torch.tensor(top_ks, device=logits.device).unsqueeze(1)
    # Top-p keeps the smallest prefix whose mass reaches p: drop a token when the mass before it does.
    sorted_probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    remove |= mass_before >= torch.tensor(top_ps, device=logits.device).unsqueeze(1)
    remove[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_indices, sorted_logits)


def request_generator(seed: int, device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator
