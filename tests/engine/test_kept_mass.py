"""The kept probability mass (SamplingParams.return_kept_mass, issue 53): per sampled token, the log of the
mass top-k, top-p and min-p kept of the distribution they truncated, checked against a renormalising
constant computed here from the same logits (softmax, sort, cumsum), in the sampler and through the
engine; refused for greedy requests; the same bits whatever the batch."""

from __future__ import annotations

import math
import random

import pytest
import torch

from engine import (
    ContinuousBatchingConfig,
    RequestStatus,
    continuous_batching_context_manager,
    generate_batch,
)
from engine.request import Request
from engine.sampling.params import InvalidParameterError, LogprobsMode, SamplingParams, build_sampling_params
from engine.sampling.sampler import Sampler
from tests.helpers.models import TEST_DEVICE, VOCAB_SIZE, random_prompt, tiny_model
from tests.helpers.oracle import reference_kept_mass, reference_kept_masses

TIMEOUT = 60
CONFIG = dict(page_size=8, num_blocks=256, max_batch_tokens=256)
TRUNCATIONS = {
    "top_k": dict(top_k=7),
    "top_p": dict(top_p=0.6),
    "min_p": dict(min_p=0.3),
    "top_k, top_p and min_p": dict(top_k=12, top_p=0.8, min_p=0.1),
}


def _sample(logits: torch.Tensor, params: list[SamplingParams], seed: int = 0):
    requests = [Request(f"r{row}", [1], each) for row, each in enumerate(params)]
    sampler = Sampler(torch.device("cpu"), seed=seed)
    return sampler.sample(logits.clone(), requests, [None] * len(requests)).to_output()


def _params(**settings) -> SamplingParams:
    return SamplingParams(max_new_tokens=1, logprobs=True, return_kept_mass=True, **settings)


def test_the_sampler_returns_the_reference_renormalising_constant_of_each_truncation():
    logits = torch.randn(len(TRUNCATIONS) + 1, 300, generator=torch.Generator().manual_seed(3)) * 3
    temperature = 0.8
    settings = [*TRUNCATIONS.values(), {}]
    output = _sample(logits, [_params(temperature=temperature, **each) for each in settings])
    assert output.log_kept_masses is not None
    for row, (name, truncation) in enumerate(TRUNCATIONS.items()):
        expected = reference_kept_mass(logits[row], temperature, **truncation)
        assert expected < 0.999, f"{name}: the case must truncate something"
        assert output.log_kept_masses[row] == pytest.approx(math.log(expected), abs=1e-5), name
    assert output.log_kept_masses[-1] == 0.0, "no truncation keeps all the mass: log 1, exactly"


def test_a_processed_logprob_plus_the_kept_mass_is_the_untruncated_logprob():
    """What a trainer's importance ratio needs: the sampler's logprob taken back to the full vocabulary."""
    logits = torch.randn(len(TRUNCATIONS), 300, generator=torch.Generator().manual_seed(4)) * 3
    params = [
        _params(temperature=1.3, logprobs_mode=LogprobsMode.PROCESSED, **each)
        for each in TRUNCATIONS.values()
    ]
    output = _sample(logits, params, seed=5)
    full = torch.log_softmax(logits / 1.3, dim=-1)
    for row, name in enumerate(TRUNCATIONS):
        token = output.token_ids[row]
        assert output.logprobs[row] + output.log_kept_masses[row] == pytest.approx(
            full[row, token].item(), abs=1e-5
        ), name


def test_the_kept_mass_is_of_the_distribution_after_penalties_and_bias():
    logits = torch.randn(1, 300, generator=torch.Generator().manual_seed(6)) * 3
    bias = ((int(logits[0].argmin()), 40.0), (int(logits[0].argmax()), -5.0))
    output = _sample(logits, [_params(temperature=0.9, top_k=5, logit_bias=bias)])
    biased = logits[0].clone()
    for token, value in bias:
        biased[token] += value
    expected = reference_kept_mass(biased, 0.9, top_k=5)
    assert output.log_kept_masses[0] == pytest.approx(math.log(expected), abs=1e-5)


def test_a_single_token_top_k_at_a_temperature_keeps_its_probability():
    logits = torch.randn(1, 300, generator=torch.Generator().manual_seed(7))
    output = _sample(logits, [_params(temperature=0.7, top_k=1)])
    assert output.token_ids == [int(logits[0].argmax())]
    expected = torch.log_softmax(logits[0] / 0.7, dim=-1).max().item()
    assert output.log_kept_masses[0] == pytest.approx(expected, abs=1e-5)


def test_rows_that_do_not_ask_cost_nothing_and_get_no_kept_mass():
    logits = torch.randn(2, 300, generator=torch.Generator().manual_seed(8))
    plain = SamplingParams(max_new_tokens=1, temperature=0.8, top_k=5, logprobs=True)
    assert _sample(logits, [plain, plain]).log_kept_masses is None
    mixed = _sample(logits, [plain, _params(temperature=0.8, top_k=5)])
    assert mixed.log_kept_masses[1] == pytest.approx(math.log(reference_kept_mass(logits[1], 0.8, top_k=5)))


def test_a_rows_kept_mass_has_the_same_bits_alone_and_in_any_batch():
    needle_logits = torch.randn(1, 512, generator=torch.Generator().manual_seed(9)) * 4
    needle = _params(temperature=0.9, top_k=40, top_p=0.9, min_p=0.02)
    alone = _sample(needle_logits, [needle]).log_kept_masses[0]
    rng = random.Random(10)
    for size in (2, 7, 33):
        others = torch.randn(size, 512, generator=torch.Generator().manual_seed(size)) * 4
        position = rng.randrange(size + 1)
        batch = torch.cat([others[:position], needle_logits, others[position:]])
        params = [
            _params(temperature=rng.uniform(0.5, 1.5), top_p=rng.uniform(0.5, 1.0)) for _ in range(size)
        ]
        params.insert(position, needle)
        batched = _sample(batch, params).log_kept_masses[position]
        assert batched == alone, f"needle {position} of {size + 1}: {batched!r} alone {alone!r}"


def _build(**settings) -> SamplingParams:
    return build_sampling_params(
        {"max_new_tokens": 4, **settings}, None, VOCAB_SIZE, field_prefix="sampling."
    )


def test_a_greedy_request_is_refused_the_kept_mass_naming_the_field():
    for greedy in ({}, {"temperature": 0.0}, {"top_k": 5}):
        with pytest.raises(
            InvalidParameterError, match=r"^sampling\.return_kept_mass needs a request that samples"
        ):
            _build(return_kept_mass=True, **greedy)
    with pytest.raises(InvalidParameterError, match=r"^sampling\.return_kept_mass must be a bool, got 1"):
        _build(return_kept_mass=1, temperature=1.0)


def test_asking_for_the_kept_mass_implies_logprobs():
    params = _build(return_kept_mass=True, temperature=1.0, top_p=0.9)
    assert params.return_kept_mass and params.logprobs
    assert not _build(temperature=1.0).return_kept_mass


@pytest.mark.parametrize("name", list(TRUNCATIONS))
def test_each_generated_token_carries_the_reference_kept_mass_of_its_logits(name):
    model = tiny_model("qwen3")
    prompt = random_prompt(30, seed=11)
    sampling = dict(temperature=0.5, seed=12, **TRUNCATIONS[name])
    with continuous_batching_context_manager(
        model, continuous_batching_config=ContinuousBatchingConfig(**CONFIG)
    ) as manager:
        request_id = manager.add_request(
            prompt, max_new_tokens=8, eos_token_id=[], return_kept_mass=True, **sampling
        )
        output = manager.get_result(request_id, timeout=TIMEOUT)
    assert output.status == RequestStatus.FINISHED, output.error
    assert len(output.log_kept_masses) == len(output.generated_tokens) == len(output.logprobs) == 8
    expected = reference_kept_masses(model, prompt, output.generated_tokens, 0.5, **TRUNCATIONS[name])
    assert output.log_kept_masses == pytest.approx(expected, abs=1e-4), name
    assert max(expected) < -1e-3, f"{name}: every step must truncate something"


@pytest.mark.skipif(
    TEST_DEVICE.type == "cpu" and not torch.backends.mkldnn.is_available(),
    reason="batch-invariant mode on the CPU needs oneDNN",
)
def test_the_kept_mass_has_the_same_bits_alone_and_in_a_batch_in_batch_invariant_mode():
    needle = random_prompt(45, seed=13)
    settings = dict(
        max_new_tokens=10,
        eos_token_id=[],
        temperature=0.9,
        top_k=40,
        top_p=0.9,
        seed=14,
        return_kept_mass=True,
    )
    config = dict(page_size=8, num_blocks=512, batch_invariant=True)
    model = tiny_model("llama")
    alone = next(
        iter(
            generate_batch(
                model,
                [needle],
                continuous_batching_config=ContinuousBatchingConfig(max_batch_tokens=256, **config),
                warmup=False,
                **settings,
            ).values()
        )
    )
    rng = random.Random(15)
    prompts = [random_prompt(rng.randint(1, 60), seed=rng.randrange(1 << 30)) for _ in range(12)]
    prompts.insert(5, needle)
    batched = list(
        generate_batch(
            model,
            prompts,
            continuous_batching_config=ContinuousBatchingConfig(max_batch_tokens=64, **config),
            warmup=False,
            **settings,
        ).values()
    )[5]
    assert batched.generated_tokens == alone.generated_tokens
    assert torch.equal(torch.tensor(batched.log_kept_masses), torch.tensor(alone.log_kept_masses)), (
        batched.log_kept_masses,
        alone.log_kept_masses,
    )
