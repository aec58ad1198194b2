"""The generation oracle: transformers' own `model.generate` (greedy, fp32), and the parity assertion
that holds the engine's tokens to it; the renormalising constant of a truncated sampler's distribution."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch


def reference_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The oracle: transformers' own `model.generate`, greedy, EOS ignored, no padding."""
    return reference_generate(model, prompt, max_new_tokens, min_new_tokens=max_new_tokens)


def reference_generate(
    model: torch.nn.Module, prompt: list[int], max_new_tokens: int, eos: int | None = None, **processing: Any
) -> list[int]:
    """`model.generate`, greedy, with `processing` (its own logits-processing arguments); the tokens end
    at the first `eos`, as the engine's do."""
    device = next(model.parameters()).device
    with torch.no_grad():
        output = model.generate(
            torch.tensor([prompt], device=device),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=0,
            **processing,
        )
    tokens = output[0, len(prompt) :].tolist()
    return tokens[: tokens.index(eos) + 1] if eos is not None and eos in tokens else tokens


def assert_greedy_parity(
    model: torch.nn.Module,
    prompts: list[list[int]],
    new_tokens: Sequence[int],
    generated: list[list[int]],
    label: str,
) -> None:
    """Each request's tokens equal `model.generate`'s; prints both sides on failure."""
    for prompt, count, tokens in zip(prompts, new_tokens, generated, strict=True):
        expected = reference_greedy(model, prompt, count)
        assert tokens == expected, (
            f"{label}: prompt of {len(prompt)} tokens, {count} new tokens, differs from model.generate\n"
            f"  engine:   {tokens}\n  generate: {expected}"
        )


def reference_kept_mass(
    logits: torch.Tensor,
    temperature: float,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
) -> float:
    """The mass of the tokens top-k, then top-p on what top-k kept, then min-p on what both kept, keep of
    softmax(logits / temperature): the constant the sampler's distribution is renormalised by."""
    probs, _ = torch.softmax(logits.double() / temperature, dim=-1).sort(descending=True)
    kept = torch.ones_like(probs, dtype=torch.bool)
    if top_k:
        kept[top_k:] = False
    if top_p is not None:
        renormalised = probs * kept / (probs * kept).sum()
        kept &= renormalised.cumsum(0) - renormalised < top_p
    if min_p:
        renormalised = probs * kept / (probs * kept).sum()
        kept &= renormalised >= min_p * renormalised[0]
    return float(probs[kept].sum())


def reference_kept_masses(
    model: torch.nn.Module, prompt: list[int], generated: list[int], temperature: float, **truncation: Any
) -> list[float]:
    """log `reference_kept_mass` at each generated token's position, from a plain forward of the model
    over prompt and output."""
    device = next(model.parameters()).device
    with torch.no_grad():
        logits = model(torch.tensor([prompt + generated], device=device)).logits[0, len(prompt) - 1 : -1]
    return [math.log(reference_kept_mass(row.float().cpu(), temperature, **truncation)) for row in logits]
