"""Tiny random causal LMs built from configs with a fixed seed (model hubs are unreachable in tests).

They live on the CPU unless CBSERVE_TEST_DEVICE names another device (e.g. "cuda"), which moves them
there, so the parity tests run on a GPU (bench/gpu_check.sh).

On the CPU, Triton kernels (the kernel path) run under Triton's interpreter. It must be chosen before
triton is first imported, which torch may do, hence before anything else here.
"""

from __future__ import annotations

import os

if os.environ.get("CBSERVE_TEST_DEVICE", "cpu").startswith("cpu"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import functools
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, PretrainedConfig
from transformers.models.gemma2 import Gemma2Config
from transformers.models.llama import LlamaConfig
from transformers.models.mistral import MistralConfig
from transformers.models.qwen3 import Qwen3Config

VOCAB_SIZE = 256
COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
)

FULL_ATTENTION_FAMILIES = ("llama", "qwen3")
TEST_DEVICE = torch.device(os.environ.get("CBSERVE_TEST_DEVICE", "cpu"))


def tiny_config(family: str) -> PretrainedConfig:
    if family == "llama":
        return LlamaConfig(**COMMON)
    if family == "qwen3":
        return Qwen3Config(**COMMON, head_dim=16)
    if family == "mistral":
        return MistralConfig(**COMMON, sliding_window=24)
    if family == "gemma2":
        return Gemma2Config(**COMMON, head_dim=16, sliding_window=24, attn_implementation="eager")
    raise ValueError(family)


@functools.cache
def _build(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = tiny_config(family)
    attn = "eager" if family == "gemma2" else "sdpa"
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32)
    # Built on the CPU, then moved: the same seeded weights on every device.
    return model.to(TEST_DEVICE).eval()


def tiny_model(family: str) -> torch.nn.Module:
    """A shared tiny model of `family`; engines restore its attention implementation when destroyed."""
    return _build(family)


def seeded_tiny_llama(seed: int) -> torch.nn.Module:
    """A tiny llama with other weights than `tiny_model("llama")`'s: new weights for an update."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        tiny_config("llama"), attn_implementation="sdpa", dtype=torch.float32
    )
    return model.eval()


def fresh_tiny_model(family: str) -> torch.nn.Module:
    """A model of `family` with the same weights as `tiny_model`'s but its own: an oracle that can run
    `generate` while a server holds the shared one."""
    return _build.__wrapped__(family)


@pytest.fixture(params=FULL_ATTENTION_FAMILIES)
def full_attention_model(request: pytest.FixtureRequest) -> torch.nn.Module:
    return tiny_model(request.param)


def random_prompt(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    # Ids from 3 up: 0..2 are pad, bos and eos in the tiny configs.
    return torch.randint(3, VOCAB_SIZE, (length,), generator=generator).tolist()


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


def generate_greedy(
    model: torch.nn.Module,
    config: Any,
    prompts: list[list[int]],
    new_tokens: Sequence[int],
    warmup: bool = False,
) -> tuple[list[list[int]], Any]:
    """Greedy tokens of every prompt through one started manager (EOS ignored), and the engine they ran
    on, for tests that look at which path it took."""
    from engine import init_continuous_batching

    manager = init_continuous_batching(model, continuous_batching_config=config)
    if warmup:
        manager.warmup()
    manager.start()
    try:
        generated = run_greedy(manager, prompts, new_tokens)
        engine = manager._engine
    finally:
        manager.destroy()
    return generated, engine


def run_greedy(manager: Any, prompts: list[list[int]], new_tokens: Sequence[int]) -> list[list[int]]:
    """Greedy tokens of every prompt (EOS ignored), all added at once to a started manager; asserts that
    none failed."""
    ids = [
        manager.add_request(prompt, max_new_tokens=count, eos_token_id=[])
        for prompt, count in zip(prompts, new_tokens, strict=True)
    ]
    outputs = [manager.get_result(request_id, timeout=600) for request_id in ids]
    for output in outputs:
        assert output is not None and output.error is None, output
    return [list(output.generated_tokens) for output in outputs]


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


def fail_forward_once(monkeypatch: pytest.MonkeyPatch, runner: Any, on_call: int) -> None:
    """Makes the `on_call`-th forward pass of `runner` (counting from 1) raise "injected fault"."""
    original_forward = runner.forward
    calls = {"count": 0}

    def forward(inputs: Any) -> Any:
        calls["count"] += 1
        if calls["count"] == on_call:
            raise RuntimeError("injected fault")
        return original_forward(inputs)

    monkeypatch.setattr(runner, "forward", forward)
