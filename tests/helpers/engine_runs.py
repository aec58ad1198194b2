"""Greedy runs through a `ContinuousBatchingManager`, injected forward faults, and `engine_core`: the one
place that knows where a manager keeps its `EngineCore`, for white-box tests of the engine core."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch

from engine import ContinuousBatchingManager, init_continuous_batching
from engine.engine_core import EngineCore


def engine_core(manager: ContinuousBatchingManager) -> EngineCore:
    """The manager's engine core, built (not started) if it was not yet: for tests that look at which
    path the engine took, or step it themselves."""
    return manager._ensure_engine()


def generate_greedy(
    model: torch.nn.Module,
    config: Any,
    prompts: list[list[int]],
    new_tokens: Sequence[int],
    warmup: bool = False,
) -> tuple[list[list[int]], EngineCore]:
    """Greedy tokens of every prompt through one started manager (EOS ignored), and the engine they ran
    on, for tests that look at which path it took."""
    manager = init_continuous_batching(model, continuous_batching_config=config)
    if warmup:
        manager.warmup()
    manager.start()
    try:
        generated = run_greedy(manager, prompts, new_tokens)
        engine = engine_core(manager)
    finally:
        manager.destroy()
    return generated, engine


def run_greedy(
    manager: ContinuousBatchingManager, prompts: list[list[int]], new_tokens: Sequence[int]
) -> list[list[int]]:
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


def assert_exact_kernel_greedy_parity(
    served: torch.nn.Module, reference: torch.nn.Module, quantization: str, label: str
) -> None:
    """The engine serving `served` (quantized layers, `quantization` for the rest) with float inputs, the
    quantized kernel's exact path, gives `model.generate`'s greedy tokens on `reference`, a float model
    holding the weights `served` serves."""
    from engine import ContinuousBatchingConfig
    from tests.helpers.models import random_prompt
    from tests.helpers.oracle import assert_greedy_parity

    prompts = [random_prompt(length, seed=length) for length in (3, 30)]
    new_tokens = [16, 9]
    config = ContinuousBatchingConfig(
        page_size=16, num_blocks=32, quantization=quantization, quantize_activations=False
    )
    generated, _ = generate_greedy(served, config, prompts, new_tokens)
    assert_greedy_parity(reference, prompts, new_tokens, generated, label)


def dequantized_copy(quantized: torch.nn.Module, blank: torch.nn.Module) -> torch.nn.Module:
    """`blank`, a full-precision model of `quantized`'s architecture, made to hold exactly what `quantized`
    serves (its quantized layers dequantized, the rest copied): the oracle's weights."""
    from engine.quantization.model import quantized_layers

    blank.load_state_dict(
        {name: value for name, value in quantized.state_dict().items() if name in blank.state_dict()},
        strict=False,
    )
    for name, layer in quantized_layers(quantized).items():
        # A new parameter, not a copy into the old one: an output layer tied to the input embedding is
        # quantized while the embedding keeps its full-precision table, so the copy unties them.
        dequantized = layer.quantized_weight.dequantize()
        blank.get_submodule(name).weight = torch.nn.Parameter(dequantized, requires_grad=False)
    return blank
