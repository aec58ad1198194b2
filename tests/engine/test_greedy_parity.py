"""Greedy outputs of the engine equal `model.generate` token for token (fp32, tiny random models)."""

from __future__ import annotations

import pytest
import torch

from engine import ContinuousBatchingConfig, generate_batch, init_continuous_batching
from tests.helpers.models import random_prompt
from tests.helpers.oracle import reference_greedy

PROMPT_LENGTHS = (1, 2, 3, 7, 16, 17, 31, 64, 100, 129, 200, 300)
NEW_TOKENS = (1, 64, 5, 16, 64, 2, 33, 64, 8, 64, 24, 40)


def _run(
    model: torch.nn.Module, prompts: list[list[int]], new_tokens: list[int], config: ContinuousBatchingConfig
):
    """Runs every prompt through one manager; returns generated tokens in order and the final stats."""
    manager = init_continuous_batching(model, continuous_batching_config=config)
    manager.start()
    try:
        ids = [
            manager.add_request(prompt, max_new_tokens=count, eos_token_id=[])
            for prompt, count in zip(prompts, new_tokens, strict=True)
        ]
        outputs = {request_id: manager.get_result(request_id, timeout=120) for request_id in ids}
        stats = manager.stats()
    finally:
        manager.destroy()
    generated = []
    for request_id in ids:
        output = outputs[request_id]
        assert output is not None, f"{request_id} produced no output"
        assert output.error is None, output.error
        generated.append(output.generated_tokens)
    return generated, stats


def _assert_parity(model, prompts, new_tokens, generated):
    for index, (prompt, count, tokens) in enumerate(zip(prompts, new_tokens, generated, strict=True)):
        expected = reference_greedy(model, prompt, count)
        assert tokens == expected, (
            f"request {index} (prompt length {len(prompt)}, {count} new tokens) differs from model.generate\n"
            f"  engine:   {tokens}\n  generate: {expected}"
        )


# The device's default attention (on the CPU, its C kernel reading pages in place) and the gather path.
ATTENTION_PATHS = pytest.mark.parametrize("max_blocks_per_request", [None, 0], ids=["default", "gather"])


@ATTENTION_PATHS
@pytest.mark.parametrize("page_size", [4, 16, 256])
def test_greedy_parity_across_prompt_lengths_and_page_sizes(
    full_attention_model, page_size, max_blocks_per_request
):
    prompts = [random_prompt(length, seed=length) for length in PROMPT_LENGTHS]
    config = ContinuousBatchingConfig(
        page_size=page_size,
        num_blocks=4096 // page_size + 8,
        max_batch_tokens=512,
        max_blocks_per_request=max_blocks_per_request,
    )
    generated, _ = _run(full_attention_model, prompts, list(NEW_TOKENS), config)
    _assert_parity(full_attention_model, prompts, NEW_TOKENS, generated)


@ATTENTION_PATHS
def test_greedy_parity_with_chunked_prefill(full_attention_model, max_blocks_per_request):
    prompts = [random_prompt(length, seed=1000 + length) for length in (300, 97, 45, 250)]
    new_tokens = [12, 20, 30, 9]
    # A 32-token budget splits every long prompt over many steps, interleaved with decodes.
    config = ContinuousBatchingConfig(
        page_size=16, num_blocks=128, max_batch_tokens=32, max_blocks_per_request=max_blocks_per_request
    )
    generated, _ = _run(full_attention_model, prompts, new_tokens, config)
    _assert_parity(full_attention_model, prompts, new_tokens, generated)


@pytest.mark.parametrize("scheduler_type", ["fifo", "prefill_first"])
def test_greedy_parity_under_preemption(full_attention_model, scheduler_type):
    prompts = [random_prompt(length, seed=2000 + length) for length in (60, 75, 90, 50, 66, 81)]
    new_tokens = [40] * len(prompts)
    # 33 usable blocks of 8 tokens hold about two of these requests at full length: growth must preempt.
    config = ContinuousBatchingConfig(
        page_size=8,
        num_blocks=34,
        max_batch_tokens=256,
        scheduler_type=scheduler_type,
        allow_block_sharing=False,
    )
    generated, stats = _run(full_attention_model, prompts, new_tokens, config)
    assert stats.preemptions > 0, "the cache was meant to be too small to avoid preemption"
    assert stats.num_blocks_used == 0, f"{stats.num_blocks_used} blocks still used after every request ended"
    _assert_parity(full_attention_model, prompts, new_tokens, generated)


def test_greedy_parity_with_prefix_caching(full_attention_model):
    shared = random_prompt(150, seed=3000)
    prompts = [shared + random_prompt(tail, seed=3001 + tail) for tail in (1, 10, 37, 64)] + [shared]
    new_tokens = [20, 16, 24, 8, 30]
    config = ContinuousBatchingConfig(
        page_size=16, num_blocks=256, max_batch_tokens=512, allow_block_sharing=True
    )
    generated, stats = _run(full_attention_model, prompts, new_tokens, config)
    assert stats.prefix_cache_hit_tokens >= 4 * 144, (
        "expected the 150-token shared prefix to be served from the cache, got "
        f"{stats.prefix_cache_hit_tokens} hit tokens of {stats.prefix_cache_queried_tokens}"
    )
    _assert_parity(full_attention_model, prompts, new_tokens, generated)


def test_greedy_parity_with_prefix_caching_preemption_and_chunking(full_attention_model):
    shared = random_prompt(64, seed=4000)
    prompts = [shared + random_prompt(20 + 9 * index, seed=4001 + index) for index in range(6)]
    new_tokens = [36] * len(prompts)
    config = ContinuousBatchingConfig(
        page_size=8, num_blocks=40, max_batch_tokens=48, allow_block_sharing=True
    )
    generated, stats = _run(full_attention_model, prompts, new_tokens, config)
    assert stats.preemptions > 0 and stats.prefix_cache_hit_tokens > 0, stats
    _assert_parity(full_attention_model, prompts, new_tokens, generated)


def test_generate_batch_returns_outputs_in_input_order_equal_to_generate(full_attention_model):
    prompts = [random_prompt(length, seed=5000 + length) for length in (40, 5, 90)]
    outputs = generate_batch(
        full_attention_model,
        prompts,
        continuous_batching_config=ContinuousBatchingConfig(page_size=16, num_blocks=64),
        max_new_tokens=10,
        eos_token_id=[],
    )
    assert list(outputs) == ["req_0", "req_1", "req_2"]
    for prompt, output in zip(prompts, outputs.values(), strict=True):
        assert output.prompt_ids == prompt
        assert output.generated_tokens == reference_greedy(full_attention_model, prompt, 10)


def test_decode_rows_batched_by_length_keep_parity(full_attention_model, monkeypatch):
    """Decode rows of very different lengths are attended in batches of similar lengths (eager decode on
    the gather path); the tokens stay `generate`'s."""
    from engine.runner import inputs

    batch_counts: list[int] = []
    split = inputs.decode_buckets

    def counted(chunks):
        buckets = split(chunks)
        batch_counts.append(len(buckets))
        assert sorted(chunk.row for bucket in buckets for chunk in bucket) == sorted(
            chunk.row for chunk in chunks
        )
        for bucket in buckets:
            assert [chunk.row for chunk in bucket] == sorted(chunk.row for chunk in bucket)
        return buckets

    monkeypatch.setattr(inputs, "decode_buckets", counted)
    lengths = (2, 3, 5, 8, 11, 14, 18, 23, 30, 40, 52, 66, 85, 110, 140, 180, 230, 290, 350, 420)
    prompts = [random_prompt(length, seed=2000 + length) for length in lengths]
    new_tokens = [6] * len(prompts)
    config = ContinuousBatchingConfig(
        page_size=16, num_blocks=512, max_batch_tokens=4096, max_blocks_per_request=0
    )
    generated, _ = _run(full_attention_model, prompts, new_tokens, config)
    _assert_parity(full_attention_model, prompts, new_tokens, generated)
    assert max(batch_counts) >= 2, batch_counts
