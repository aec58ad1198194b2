"""Prompt logprobs (SamplingParams.prompt_logprobs) equal log_softmax of one plain forward over the prompt.

Every prompt position p >= 1 gets the logprob of its token and the top-k alternatives from the raw logits
at position p - 1, whatever the steps the prompt was computed in: chunked prefill, async batching, a
prefix already in the prefix cache, a preemption with recompute, padded decode steps. Requests that do
not ask keep their outputs (greedy parity with `model.generate`).
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from engine import ContinuousBatchingConfig, GenerationOutput, init_continuous_batching
from engine.request import Request, sequence_request_id
from engine.runner.model_runner import PromptLogprobs
from engine.sampling.params import SamplingParams
from tests.helpers.engine_runs import engine_core
from tests.helpers.models import random_prompt, tiny_model
from tests.helpers.oracle import assert_greedy_parity

TIMEOUT = 120
ATOL = 1e-5


def _run(
    model: torch.nn.Module,
    config: ContinuousBatchingConfig,
    prompts: list[list[int]],
    ks: list[int | None],
    new_tokens: list[int],
    streaming: bool = False,
    configure: Any = None,
) -> tuple[list[list[GenerationOutput]], Any, Any]:
    """Every output of each request (one when not streaming) through one started manager, the final
    stats and the engine. `ks[i]` is request i's prompt_logprobs (None: it does not ask)."""
    manager = init_continuous_batching(model, continuous_batching_config=config)
    try:
        engine = engine_core(manager)
        if configure is not None:
            configure(engine)
        manager.start()
        ids = []
        for prompt, k, count in zip(prompts, ks, new_tokens, strict=True):
            extra = {} if k is None else {"prompt_logprobs": k}
            ids.append(
                manager.add_request(
                    prompt, max_new_tokens=count, eos_token_id=[], streaming=streaming, **extra
                )
            )
        outputs: list[list[GenerationOutput]] = []
        for request_id in ids:
            received = []
            while not received or not received[-1].is_finished():
                output = manager.get_result(request_id, timeout=TIMEOUT)
                assert output is not None, f"{request_id}: no output in {TIMEOUT} s"
                received.append(output)
            outputs.append(received)
        stats = manager.stats()
    finally:
        manager.destroy()
    for received in outputs:
        assert received[-1].error is None, received[-1].error
    return outputs, stats, engine


def _reference(model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    """log_softmax (fp32) of one plain forward over the prompt: row p - 1 scores prompt token p."""
    device = next(model.parameters()).device
    with torch.no_grad():
        logits = model(torch.tensor([prompt], device=device)).logits[0]
    return torch.log_softmax(logits.float(), dim=-1).cpu()


def _assert_prompt_logprobs(
    model: torch.nn.Module,
    prompt: list[int],
    k: int,
    got: list[tuple[float, dict[int, float]]] | None,
    label: str,
) -> None:
    """`got` equals the reference for the chosen tokens and the top-k ids and values; prints both sides on
    failure. Ids may differ only between alternatives whose reference logprobs tie (within ATOL)."""
    assert got is not None, f"{label}: no prompt_logprobs"
    assert len(got) == len(prompt) - 1, (
        f"{label}: {len(got)} prompt logprobs for a prompt of {len(prompt)} tokens"
    )
    if len(prompt) == 1:
        return
    log_probs = _reference(model, prompt)[:-1]  # [P - 1, V]
    expected = log_probs.gather(1, torch.tensor(prompt[1:]).unsqueeze(1)).squeeze(1)
    chosen = torch.tensor([logprob for logprob, _ in got])
    assert torch.allclose(chosen, expected, atol=ATOL), (
        f"{label}: prompt token logprobs differ (max |diff| {(chosen - expected).abs().max():.3g})\n"
        f"  engine:    {chosen.tolist()}\n  reference: {expected.tolist()}"
    )
    assert all(len(top) == k for _, top in got), f"{label}: not {k} alternatives: {[len(t) for _, t in got]}"
    if k == 0:
        return
    ids = torch.tensor([list(top) for _, top in got])
    values = torch.tensor([list(top.values()) for _, top in got])
    expected_values, expected_ids = log_probs.topk(k + 1, dim=-1)
    assert torch.allclose(values, expected_values[:, :k], atol=ATOL), (
        f"{label}: top-{k} values differ\n  engine:    {values.tolist()}\n"
        f"  reference: {expected_values[:, :k].tolist()}"
    )
    # Every alternative carries its own logprob, and they are the k best up to ties.
    assert torch.allclose(log_probs.gather(1, ids), values, atol=ATOL), f"{label}: ids and values disagree"
    gaps = expected_values[:, :-1] - expected_values[:, 1:]  # [P - 1, k]
    tied = gaps < ATOL
    tied[:, 1:] |= gaps[:, :-1] < ATOL
    untied = ~tied
    mismatched = (ids != expected_ids[:, :k]) & untied
    assert not mismatched.any(), (
        f"{label}: top-{k} ids differ at positions {mismatched.any(dim=1).nonzero().flatten().tolist()}\n"
        f"  engine:    {ids.tolist()}\n  reference: {expected_ids[:, :k].tolist()}"
    )


def _check(model, prompts, ks, new_tokens, outputs, label) -> None:
    generated = [list(received[-1].generated_tokens) for received in outputs]
    assert_greedy_parity(model, prompts, new_tokens, generated, label)
    for index, (prompt, k, received) in enumerate(zip(prompts, ks, outputs, strict=True)):
        for output in received:
            if k is None:
                assert output.prompt_logprobs is None, f"{label}: request {index} did not ask"
            else:
                _assert_prompt_logprobs(
                    model, prompt, k, output.prompt_logprobs, f"{label}, request {index} (k={k})"
                )


@pytest.mark.parametrize("async_batching", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_prompt_logprobs_equal_a_plain_forward_across_chunks(family, async_batching):
    """A 150-token prompt over >= 5 steps of 32 tokens, mixed with requests that do not ask, k from 0 to
    the most, one-token prompts (nothing to score) and streamed outputs."""
    model = tiny_model(family)
    lengths = (150, 40, 1, 2, 70, 9, 33)
    prompts = [random_prompt(length, seed=7000 + length) for length in lengths]
    ks: list[int | None] = [5, 0, 3, 20, None, None, 1]
    new_tokens = [8, 12, 6, 4, 10, 16, 5]
    config = ContinuousBatchingConfig(
        page_size=16, num_blocks=128, max_batch_tokens=32, use_async_batching=async_batching
    )
    outputs, _, engine = _run(model, config, prompts, ks, new_tokens, streaming=True)
    if async_batching:
        assert engine.runner.num_placeholder_inputs > 0, "no step was prepared ahead of its predecessor"
    _check(model, prompts, ks, new_tokens, outputs, f"{family}, {'async' if async_batching else 'sync'}")


def test_prompt_logprobs_of_a_prompt_whose_prefix_is_cached():
    """The prefix is cached by an earlier request, yet every position is computed and scored; the blocks a
    request with prompt logprobs computes first are shared with later requests."""
    model = tiny_model("llama")
    shared = random_prompt(64, seed=7100)
    fresh = random_prompt(50, seed=7103)
    prompts = [shared + random_prompt(20, seed=7101), shared + random_prompt(30, seed=7102), fresh, fresh]
    ks: list[int | None] = [None, 4, 1, None]
    new_tokens = [6, 6, 6, 6]
    config = ContinuousBatchingConfig(
        page_size=8, num_blocks=96, max_batch_tokens=256, allow_block_sharing=True
    )
    manager = init_continuous_batching(model, continuous_batching_config=config)
    manager.start()
    outputs = []
    try:
        for prompt, k, count in zip(prompts, ks, new_tokens, strict=True):  # one after the other
            extra = {} if k is None else {"prompt_logprobs": k}
            request_id = manager.add_request(prompt, max_new_tokens=count, eos_token_id=[], **extra)
            outputs.append([manager.get_result(request_id, timeout=TIMEOUT)])
    finally:
        manager.destroy()
    cached = [received[0].num_cached_tokens for received in outputs]
    # The second request bypasses the 64 cached tokens; the last one takes 48 of its twin's 50.
    assert cached == [0, 0, 0, 48], f"prompt tokens served from the prefix cache: {cached}"
    _check(model, prompts, ks, new_tokens, outputs, "prefix cached")


@pytest.mark.parametrize("async_batching", [False, True], ids=["sync", "async"])
def test_prompt_logprobs_across_preemption_prefix_caching_and_chunking(async_batching):
    """Requests preempted with recompute, some in the middle of their prompt, keep exactly one entry per
    prompt token: readmitted, they take only the cached blocks their collected logprobs cover."""
    model = tiny_model("llama")
    shared = random_prompt(64, seed=7200)
    prompts = [shared + random_prompt(20 + 9 * index, seed=7201 + index) for index in range(6)]
    ks: list[int | None] = [2, 2, None, 2, 0, 2]
    new_tokens = [36] * len(prompts)
    config = ContinuousBatchingConfig(
        page_size=8,
        num_blocks=40,
        max_batch_tokens=48,
        allow_block_sharing=True,
        use_async_batching=async_batching,
    )
    outputs, stats, _ = _run(model, config, prompts, ks, new_tokens)
    assert stats.preemptions > 0 and stats.prefix_cache_hit_tokens > 0, stats
    _check(model, prompts, ks, new_tokens, outputs, f"preemption, {'async' if async_batching else 'sync'}")


def test_prompt_logprobs_with_a_sliding_window():
    model = tiny_model("mistral")  # a window of 24 tokens
    prompts = [random_prompt(length, seed=7300 + length) for length in (90, 30)]
    ks: list[int | None] = [3, None]
    new_tokens = [10, 10]
    config = ContinuousBatchingConfig(page_size=8, num_blocks=64, max_batch_tokens=32)
    outputs, _, _ = _run(model, config, prompts, ks, new_tokens)
    _check(model, prompts, ks, new_tokens, outputs, "mistral")


def test_prompt_logprobs_in_padded_decode_steps():
    """Decode-only steps padded to a row count (as CUDA graphs need) whose one-token prompt chunks are
    scored from the logits every padded row gets."""
    from engine.runner.padding import Padding

    model = tiny_model("llama")
    prompts = [random_prompt(1, seed=7400 + index) for index in range(6)] + [random_prompt(12, seed=7410)]
    ks: list[int | None] = [None] * 6 + [3]
    new_tokens = [20] * 6 + [4]
    steps: list[tuple[bool, bool, bool]] = []

    def configure(engine: Any) -> None:
        runner = engine.runner
        runner.forward_paths.padding = Padding(4, 16, 16, decode=True)
        original_forward = runner.forward

        def forward(inputs):
            steps.append((inputs.is_decode_only, inputs.is_padded, inputs.prompt_logits is not None))
            return original_forward(inputs)

        runner.forward = forward

    # Six decoding requests leave one token of each step to the long prompt: 7 rows, padded to 8.
    config = ContinuousBatchingConfig(page_size=8, num_blocks=64, max_batch_tokens=7)
    outputs, _, _ = _run(model, config, prompts, ks, new_tokens, configure=configure)
    assert (True, True, True) in steps, f"no padded decode step had prompt rows: {steps}"
    _check(model, prompts, ks, new_tokens, outputs, "padded decode steps")


def test_prompt_logprobs_unpadded_on_the_varlen_kernel_path():
    """With padded varlen steps (the kernel path), a step with prompt rows runs unpadded; others pad."""
    pytest.importorskip("triton")
    from engine.runner.padding import Padding

    model = tiny_model("llama")
    prompts = [random_prompt(length, seed=7500 + length) for length in (30, 12)]
    ks: list[int | None] = [2, None]
    new_tokens = [6, 6]
    steps: list[tuple[bool, bool]] = []

    def configure(engine: Any) -> None:
        runner = engine.runner
        runner.forward_paths.padding = Padding(4, 16, 16, decode=False, varlen=True, varlen_max_tokens=64)
        original_forward = runner.forward

        def forward(inputs):
            if not inputs.is_decode_only:
                steps.append((inputs.is_padded, inputs.prompt_logits is not None))
            return original_forward(inputs)

        runner.forward = forward

    config = ContinuousBatchingConfig(
        page_size=8, num_blocks=64, max_batch_tokens=16, max_blocks_per_request=16
    )
    outputs, _, engine = _run(model, config, prompts, ks, new_tokens, configure=configure)
    assert engine.runner.forward_paths.attention_kernel is not None
    assert (False, True) in steps and (True, False) in steps, steps
    assert (True, True) not in steps, steps
    _check(model, prompts, ks, new_tokens, outputs, "varlen kernel path")


def test_chunks_already_collected_are_dropped_and_a_gap_is_refused(caplog):
    request = Request("r", list(range(3, 13)), SamplingParams(max_new_tokens=1, prompt_logprobs=0))
    assert request.prompt_logprobs is not None
    PromptLogprobs(0, [(-1.0, {}), (-2.0, {}), (-3.0, {})]).add_to(request)
    # A recompute after preemption computes positions 1 and 2 again.
    PromptLogprobs(1, [(-9.0, {}), (-9.0, {}), (-4.0, {})]).add_to(request)
    assert [logprob for logprob, _ in request.prompt_logprobs] == [-1.0, -2.0, -3.0, -4.0]
    with caplog.at_level(logging.ERROR, logger="engine.runner.model_runner"):
        PromptLogprobs(6, [(-7.0, {})]).add_to(request)
    assert len(request.prompt_logprobs) == 4 and "dropped" in caplog.text


@pytest.mark.parametrize("async_batching", [False, True], ids=["sync", "async"])
def test_every_sequence_of_an_n_request_carries_the_prompt_logprobs(async_batching):
    """n > 1: the prompt is computed once, and each sequence's outputs carry its logprobs."""
    model = tiny_model("llama")
    prompt = random_prompt(37, seed=37)
    config = ContinuousBatchingConfig(
        page_size=8, num_blocks=128, max_batch_tokens=16, use_async_batching=async_batching
    )
    manager = init_continuous_batching(model, continuous_batching_config=config)
    manager.start()
    try:
        request_id = manager.add_request(prompt, max_new_tokens=5, eos_token_id=[], prompt_logprobs=2, n=3)
        outputs = [
            manager.get_result(sequence_request_id(request_id, index), timeout=TIMEOUT) for index in range(3)
        ]
        stats = manager.stats()
    finally:
        manager.destroy()
    assert stats.forked_sequences == 2
    for index, output in enumerate(outputs):
        assert output is not None and output.index == index
        _assert_prompt_logprobs(model, prompt, 2, output.prompt_logprobs, f"sequence {index}")
