"""Penalties and min_new_tokens: greedy outputs equal `model.generate` with the same processing."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from engine import ContinuousBatchingConfig, RequestStatus, generate_batch, init_continuous_batching
from tests.helpers.engine_runs import engine_core
from tests.helpers.models import random_prompt, tiny_model
from tests.helpers.oracle import reference_generate

TIMEOUT = 600


class OpenAIPenalties(LogitsProcessor):
    """The oracle of presence and frequency penalties: OpenAI's formula over the generated tokens."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        counts = torch.zeros_like(scores)
        generated = input_ids[:, self.prompt_len :]
        counts.scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def _run(
    model: torch.nn.Module, requests: list[dict[str, Any]], **config: Any
) -> tuple[list[list[int]], Any]:
    """Every request through one started manager, all queued at once so they share batches."""
    values: dict[str, Any] = dict(page_size=8, num_blocks=128, max_batch_tokens=64)
    values.update(config)
    manager = init_continuous_batching(model, continuous_batching_config=ContinuousBatchingConfig(**values))
    manager.start()
    try:
        ids = [manager.add_request(**request) for request in requests]
        outputs = [manager.get_result(request_id, timeout=TIMEOUT) for request_id in ids]
        stats = manager.stats()
        history = engine_core(manager).runner.sampler.penalties.history
    finally:
        manager.destroy()
    for output in outputs:
        assert output is not None and output.status == RequestStatus.FINISHED, output
    return [list(output.generated_tokens) for output in outputs], (stats, history)


def _assert_equal(label: str, engine: list[int], generate: list[int]) -> None:
    assert engine == generate, (
        f"{label}: differs from model.generate\n  engine:   {engine}\n  generate: {generate}"
    )


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral"])
@pytest.mark.parametrize("async_batching", [False, True])
def test_repetition_penalty_equals_generate(family: str, async_batching: bool) -> None:
    model = tiny_model(family)
    penalties = [1.0, 1.3, 0.7, 2.5, 1.3]
    prompts = [random_prompt(20 + 9 * index, seed=300 + index) for index in range(len(penalties))]
    # The 64-token budget chunks the longer prompts, and the batch mixes penalised and plain rows.
    requests = [
        dict(input_ids=prompt, max_new_tokens=24, eos_token_id=[], repetition_penalty=penalty)
        for prompt, penalty in zip(prompts, penalties, strict=True)
    ]
    generated, _ = _run(model, requests, use_async_batching=async_batching)
    for prompt, penalty, tokens in zip(prompts, penalties, generated, strict=True):
        expected = reference_generate(model, prompt, 24, repetition_penalty=penalty)
        _assert_equal(f"{family} repetition_penalty={penalty}", tokens, expected)


def test_penalties_survive_preemption_and_async_batching() -> None:
    model = tiny_model("llama")
    prompts = [random_prompt(length, seed=400 + length) for length in (60, 75, 90, 50)]
    requests = [
        dict(
            input_ids=prompt,
            max_new_tokens=40,
            eos_token_id=[],
            repetition_penalty=1.6,
            frequency_penalty=0.5,
        )
        for prompt in prompts
    ]
    # 33 usable blocks of 8 tokens hold about two of these at full length: growth must preempt.
    generated, (stats, _) = _run(
        model,
        requests,
        num_blocks=34,
        max_batch_tokens=256,
        allow_block_sharing=False,
        use_async_batching=True,
    )
    assert stats.preemptions > 0, "the cache was meant to be too small to avoid preemption"
    for prompt, tokens in zip(prompts, generated, strict=True):
        processors = LogitsProcessorList([OpenAIPenalties(len(prompt), presence=0.0, frequency=0.5)])
        expected = reference_generate(
            model, prompt, 40, None, repetition_penalty=1.6, logits_processor=processors
        )
        _assert_equal("preempted, async", tokens, expected)


@pytest.mark.parametrize(("presence", "frequency"), [(1.5, 0.0), (0.0, 0.8), (0.6, 0.4), (-1.0, -0.5)])
def test_presence_and_frequency_penalties_equal_openai_formula(presence: float, frequency: float) -> None:
    model = tiny_model("qwen3")
    prompts = [random_prompt(25 + 7 * index, seed=500 + index) for index in range(3)]
    requests = [
        dict(
            input_ids=prompt,
            max_new_tokens=24,
            eos_token_id=[],
            presence_penalty=presence,
            frequency_penalty=frequency,
        )
        for prompt in prompts
    ]
    generated, _ = _run(model, requests)
    for prompt, tokens in zip(prompts, generated, strict=True):
        processors = LogitsProcessorList([OpenAIPenalties(len(prompt), presence, frequency)])
        expected = reference_generate(model, prompt, 24, logits_processor=processors)
        _assert_equal(f"presence={presence} frequency={frequency}", tokens, expected)


def test_logit_bias_equals_generate_sequence_bias_before_the_repetition_penalty() -> None:
    model = tiny_model("llama")
    prompt = random_prompt(24, seed=550)
    plain = reference_generate(model, prompt, 12)
    # Ban the greedy output's first two tokens, pull another one up: the output must change.
    bias = {plain[0]: -100.0, plain[1]: -100.0, 77: 4.0}
    generated, _ = _run(
        model,
        [
            dict(input_ids=prompt, max_new_tokens=12, eos_token_id=[], logit_bias=bias),
            dict(
                input_ids=prompt, max_new_tokens=12, eos_token_id=[], logit_bias=bias, repetition_penalty=1.4
            ),
        ],
    )
    sequence_bias = {(token,): value for token, value in bias.items()}
    expected = reference_generate(model, prompt, 12, sequence_bias=sequence_bias)
    _assert_equal("logit_bias", generated[0], expected)
    assert plain[0] not in generated[0] and plain[1] not in generated[0], generated[0]
    expected = reference_generate(model, prompt, 12, sequence_bias=sequence_bias, repetition_penalty=1.4)
    _assert_equal("logit_bias with repetition_penalty", generated[1], expected)


def test_min_new_tokens_holds_eos_back_as_generate_does() -> None:
    model = tiny_model("llama")
    prompt = random_prompt(30, seed=600)
    plain = reference_generate(model, prompt, 16)
    eos = plain[1]  # the greedy output would end at its second token
    requests = [
        dict(input_ids=prompt, max_new_tokens=16, eos_token_id=[eos]),
        dict(input_ids=prompt, max_new_tokens=16, eos_token_id=[eos], min_new_tokens=6),
        dict(input_ids=prompt, max_new_tokens=16, eos_token_id=[eos], min_new_tokens=16),
    ]
    generated, _ = _run(model, requests)
    assert generated[0] == plain[:2], generated[0]
    for tokens, minimum in zip(generated[1:], (6, 16), strict=True):
        expected = reference_generate(model, prompt, 16, eos, min_new_tokens=minimum)
        _assert_equal(f"min_new_tokens={minimum}", tokens, expected)
        assert len(tokens) >= minimum and eos not in tokens[:minimum], tokens


def test_generation_config_penalties_apply_as_in_generate() -> None:
    # A model's generation config is what training loops and `generate` both read: the engine follows it.
    model = tiny_model("qwen3")
    prompts = [random_prompt(18 + 5 * index, seed=650 + index) for index in range(3)]
    config = GenerationConfig(max_new_tokens=16, do_sample=False, repetition_penalty=1.5, eos_token_id=None)
    outputs = generate_batch(
        model, prompts, config, ContinuousBatchingConfig(page_size=8, num_blocks=64), eos_token_id=[]
    )
    for prompt, output in zip(prompts, outputs.values(), strict=True):
        expected = reference_generate(model, prompt, 16, repetition_penalty=1.5)
        _assert_equal("generation config repetition_penalty=1.5", list(output.generated_tokens), expected)


def test_logprobs_stay_those_of_the_raw_logits_under_penalties() -> None:
    model = tiny_model("llama")
    prompt = random_prompt(20, seed=800)
    manager = init_continuous_batching(
        model, continuous_batching_config=ContinuousBatchingConfig(page_size=8)
    )
    manager.start()
    try:
        request_id = manager.add_request(
            prompt, max_new_tokens=8, eos_token_id=[], repetition_penalty=2.0, logprobs=True
        )
        output = manager.get_result(request_id, timeout=TIMEOUT)
    finally:
        manager.destroy()
    tokens = list(output.generated_tokens)
    _assert_equal(
        "repetition_penalty=2.0 with logprobs",
        tokens,
        reference_generate(model, prompt, 8, repetition_penalty=2.0),
    )
    device = next(model.parameters()).device
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens], device=device)).logits[0, len(prompt) - 1 : -1].cpu()
    raw = torch.log_softmax(logits.float(), dim=-1).gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1)
    assert torch.allclose(torch.tensor(output.logprobs), raw, atol=1e-4), (output.logprobs, raw.tolist())


def test_seeded_sampling_with_penalties_ignores_batch_companions() -> None:
    # Each request's history is its own: penalised companions change nothing in its tokens.
    model = tiny_model("qwen3")
    prompt = random_prompt(20, seed=900)
    sampling = dict(
        max_new_tokens=16, temperature=1.2, top_p=0.95, seed=77, repetition_penalty=1.3, frequency_penalty=0.4
    )
    alone, _ = _run(model, [dict(input_ids=prompt, eos_token_id=[], **sampling)])
    companions = [
        dict(
            input_ids=random_prompt(12 + index, seed=910 + index),
            max_new_tokens=20,
            eos_token_id=[],
            temperature=1.0,
            presence_penalty=1.5,
            repetition_penalty=1.1 + index / 10,
        )
        for index in range(4)
    ]
    batched, _ = _run(
        model, [*companions[:2], dict(input_ids=prompt, eos_token_id=[], **sampling), *companions[2:]]
    )
    assert batched[2] == alone[0], (alone[0], batched[2])


def test_history_rows_are_given_back_when_requests_end() -> None:
    model = tiny_model("llama")
    # Three waves of penalised requests, one after another: rows are reused, not added.
    requests = [
        dict(input_ids=random_prompt(10, seed=700 + index), max_new_tokens=4 + index, repetition_penalty=1.2)
        for index in range(12)
    ]
    _, (_, history) = _run(model, requests, max_batch_tokens=32, max_requests_per_batch=4)
    assert history.tokens.shape[0] <= 8, f"{history.tokens.shape[0]} rows for at most 4 live requests"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(repetition_penalty=0.0), "repetition_penalty must be a finite number > 0"),
        (dict(repetition_penalty=float("inf")), "repetition_penalty must be a finite number > 0"),
        (dict(presence_penalty=2.5), r"presence_penalty must be a finite number in \[-2, 2\]"),
        (dict(frequency_penalty=float("nan")), r"frequency_penalty must be a finite number in \[-2, 2\]"),
        (dict(min_new_tokens=-1), "min_new_tokens must be an int >= 0"),
        (dict(min_new_tokens=9), r"min_new_tokens \(9\) must not exceed max_new_tokens \(8\)"),
        (dict(logit_bias={256: 1.0}), r"logit_bias: token id 256 is not in \[0, 256\)"),
        (dict(logit_bias={5: 150.0}), r"logit_bias\[5\] must be a finite number in \[-100, 100\]"),
        (dict(logit_bias={5: float("nan")}), r"logit_bias\[5\] must be a finite number"),
        (dict(logit_bias=[(5, 1.0)]), "logit_bias must be a mapping of token id to bias, got list"),
    ],
)
def test_bad_penalties_are_refused_naming_the_parameter(kwargs: dict[str, Any], message: str) -> None:
    manager = init_continuous_batching(
        tiny_model("llama"), continuous_batching_config=ContinuousBatchingConfig(page_size=8, num_blocks=16)
    )
    try:
        with pytest.raises(ValueError, match=message):
            manager.add_request([5, 6, 7], max_new_tokens=8, **kwargs)
    finally:
        manager.destroy()
