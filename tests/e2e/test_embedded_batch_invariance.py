"""Batch-invariant mode on the embedded SmolLM2-135M-Instruct (fp32): a chat question alone and among
six other questions gives the same tokens and logprobs bit for bit, and the trainer's forward of
prompt + answer through `engine.sequence_logprobs` gives the engine's logprobs bit for bit, with a
backward pass (issue 33). The tiny models cover the other variants (tests/engine/test_batch_invariance.py).
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from engine import ContinuousBatchingConfig, generate_batch, sequence_logprobs
from service.model_loading import load_pretrained

QUESTIONS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "What does a compiler do?",
    "Explain photosynthesis in two sentences.",
    "How do I boil an egg?",
    "What is a prime number?",
    "Who wrote Pride and Prejudice?",
)
NEW_TOKENS = 16
pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="batch-invariant mode on the CPU needs oneDNN"
)


@functools.cache
def _load(model_dir: str) -> tuple[Any, list[list[int]]]:
    model, tokenizer = load_pretrained(model_dir, "cpu", "float32")
    prompts = [
        [
            int(token)
            for token in tokenizer.apply_chat_template(
                [{"role": "user", "content": question}], add_generation_prompt=True, return_dict=False
            )
        ]
        for question in QUESTIONS
    ]
    return model, prompts


def _generate(model: Any, prompts: list[list[int]], batch_invariant: bool) -> list[Any]:
    config = ContinuousBatchingConfig(page_size=16, max_batch_tokens=128, batch_invariant=batch_invariant)
    outputs = generate_batch(
        model,
        prompts,
        continuous_batching_config=config,
        warmup=False,
        max_new_tokens=NEW_TOKENS,
        eos_token_id=[],
        logprobs=True,
    )
    return list(outputs.values())


def test_smollm2_needle_and_trainer_forward_have_the_engine_bits(model_dir: str) -> None:
    model, prompts = _load(model_dir)
    needle = prompts[0]
    alone = _generate(model, [needle], batch_invariant=True)[0]
    batch = [*prompts[1:4], needle, *prompts[4:]]
    batched = _generate(model, batch, batch_invariant=True)[3]
    assert batched.generated_tokens == alone.generated_tokens
    served = torch.tensor(alone.logprobs)
    assert torch.equal(torch.tensor(batched.logprobs), served), (
        "logprobs differ by up to "
        f"{(torch.tensor(batched.logprobs) - served).abs().max().item():.3g} between alone and batched"
    )
    computed = sequence_logprobs(model, [needle + alone.generated_tokens], [len(needle)])[0]
    difference = (computed.detach() - served).abs().max().item()
    assert torch.equal(computed.detach(), served), f"the trainer's logprobs differ by up to {difference:.3g}"
    computed.sum().backward()
    assert model.lm_head.weight.grad is not None and torch.isfinite(model.lm_head.weight.grad).all()
    model.zero_grad(set_to_none=True)
