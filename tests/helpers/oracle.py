"""The generation oracle: transformers' own `model.generate` (greedy, fp32), and the parity assertion
that holds the engine's tokens to it."""

from __future__ import annotations

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
