"""Per-request sampling: greedy limits, seeds independent of batch companions, logprobs."""

from __future__ import annotations

import pytest
import torch

from engine import ContinuousBatchingConfig, RequestStatus, continuous_batching_context_manager
from engine.sampling.sampler import GREEDY_BLOCK_COLUMNS, greedy_tokens
from tests.helpers.models import random_prompt, tiny_model
from tests.helpers.oracle import reference_greedy

TIMEOUT = 60
CONFIG = dict(page_size=8, num_blocks=256, max_batch_tokens=256)


@pytest.fixture
def model():
    return tiny_model("qwen3")


def _generate(manager, prompt, **kwargs):
    request_id = manager.add_request(prompt, eos_token_id=[], **kwargs)
    output = manager.get_result(request_id, timeout=TIMEOUT)
    assert output.status == RequestStatus.FINISHED, output.error
    return output


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 1e-4, "do_sample": True},
        {"top_k": 1, "temperature": 1.5},
        {"top_p": 1e-6, "temperature": 1.0},
        {"min_p": 1.0, "temperature": 1.0},
    ],
)
def test_limits_of_sampling_equal_greedy(model, sampling):
    prompt = random_prompt(30, seed=1)
    expected = reference_greedy(model, prompt, 12)
    with continuous_batching_context_manager(
        model, continuous_batching_config=ContinuousBatchingConfig(**CONFIG)
    ) as m:
        output = _generate(m, prompt, max_new_tokens=12, seed=3, **sampling)
    assert output.generated_tokens == expected


def test_same_seed_gives_same_tokens_whatever_the_batch_companions(model):
    prompt = random_prompt(20, seed=2)
    sampling = dict(max_new_tokens=16, temperature=1.3, top_k=50, top_p=0.95, seed=1234)
    with continuous_batching_context_manager(
        model, continuous_batching_config=ContinuousBatchingConfig(**CONFIG)
    ) as m:
        alone = _generate(m, prompt, **sampling).generated_tokens
        companions = [
            m.add_request(
                random_prompt(10 + index, seed=50 + index),
                max_new_tokens=20,
                temperature=1.0,
                eos_token_id=[],
            )
            for index in range(5)
        ]
        in_batch = _generate(m, prompt, **sampling).generated_tokens
        for request_id in companions:
            m.get_result(request_id, timeout=TIMEOUT)
        other_seed = _generate(m, prompt, **{**sampling, "seed": 99}).generated_tokens
    assert alone == in_batch
    assert alone != other_seed, "different seeds should (overwhelmingly likely) sample differently"


def test_sampling_without_seed_differs_between_runs(model):
    prompt = random_prompt(20, seed=3)
    with continuous_batching_context_manager(
        model, continuous_batching_config=ContinuousBatchingConfig(**CONFIG)
    ) as m:
        runs = {
            tuple(_generate(m, prompt, max_new_tokens=16, temperature=2.0).generated_tokens) for _ in range(3)
        }
    assert len(runs) > 1


def test_logprobs_equal_log_softmax_of_the_models_logits(model):
    prompt = random_prompt(40, seed=4)
    config = ContinuousBatchingConfig(**CONFIG, return_logprobs=True)
    with continuous_batching_context_manager(model, continuous_batching_config=config) as m:
        output = _generate(m, prompt, max_new_tokens=10, top_logprobs=3)
    sequence = torch.tensor([prompt + output.generated_tokens])
    with torch.no_grad():
        logits = model(sequence).logits[0, len(prompt) - 1 : -1]
    expected = torch.log_softmax(logits.float(), dim=-1)
    chosen = expected.gather(1, torch.tensor(output.generated_tokens).unsqueeze(1)).squeeze(1)
    assert torch.allclose(torch.tensor(output.logprobs), chosen, atol=1e-4), (
        output.logprobs,
        chosen.tolist(),
    )
    for step, top in enumerate(output.top_logprobs):
        values, indices = expected[step].topk(3)
        assert list(top) == indices.tolist()
        assert torch.allclose(torch.tensor(list(top.values())), values, atol=1e-4)


def test_min_p_never_samples_a_token_below_its_threshold():
    from engine.request import Request
    from engine.sampling.params import SamplingParams
    from engine.sampling.sampler import Sampler

    # Probabilities 0.5, 0.3, 0.15, 0.05: min_p 0.5 keeps the tokens at >= 0.25, i.e. 0 and 1 only.
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(400, 1)
    params = SamplingParams(max_new_tokens=1, temperature=1.0, min_p=0.5)
    requests = [Request(f"r{row}", [1], params) for row in range(400)]
    drawn = Sampler(torch.device("cpu"), seed=0).sample(logits, requests, [None] * 400).to_output().token_ids
    assert set(drawn) == {0, 1}, sorted(set(drawn))
    without = SamplingParams(max_new_tokens=1, temperature=1.0)
    requests = [Request(f"r{row}", [1], without) for row in range(400)]
    drawn = Sampler(torch.device("cpu"), seed=0).sample(logits, requests, [None] * 400).to_output().token_ids
    assert {2, 3} <= set(drawn), "without min_p the unlikely tokens are drawn too"


def test_min_p_out_of_bounds_is_refused(model):
    with continuous_batching_context_manager(
        model, continuous_batching_config=ContinuousBatchingConfig(**CONFIG)
    ) as m:
        for bad in (-0.1, 1.5, float("nan")):
            with pytest.raises(ValueError, match=r"min_p must be a finite number in \[0, 1\]"):
                m.add_request([1, 2, 3], max_new_tokens=2, min_p=bad, temperature=1.0)


def test_a_stop_token_ends_the_output_with_its_id_as_stop_reason(model):
    prompt = random_prompt(20, seed=4)
    expected = reference_greedy(model, prompt, 12)
    stop = expected[4]
    cut = expected.index(stop) + 1
    with continuous_batching_context_manager(
        model, continuous_batching_config=ContinuousBatchingConfig(**CONFIG)
    ) as m:
        output = _generate(m, prompt, max_new_tokens=12, stop_token_ids=[stop])
        held = _generate(m, prompt, max_new_tokens=12, stop_token_ids=[stop], min_new_tokens=12)
        with pytest.raises(ValueError, match=r"stop_token_ids: token id 100000 is not in \[0, 256\)"):
            m.add_request(prompt, max_new_tokens=2, stop_token_ids=[100000])
    assert output.generated_tokens == expected[:cut], (output.generated_tokens, expected)
    assert output.finish_reason == "stop" and output.stop_reason == stop
    assert stop not in held.generated_tokens and held.finish_reason == "length" and held.stop_reason is None


def test_greedy_tokens_are_argmaxs_first_of_tied_maxima_on_every_path():
    """The CPU's two-stage pick agrees with argmax: ties (inside a block and across blocks), -inf rows
    and masks, NaN, a vocabulary that is not a whole number of blocks, and a non-contiguous view."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(12, 32000, generator=generator)
    logits[0, [5, 77, 4000]] = 50.0  # tied inside the first block and across blocks
    logits[1, [GREEDY_BLOCK_COLUMNS - 1, GREEDY_BLOCK_COLUMNS]] = 50.0  # tied across a block edge
    logits[2] = float("-inf")
    logits[3, :31000] = float("-inf")  # a grammar mask leaving the last columns
    logits[4, 31999] = 60.0  # the very last column
    logits[5, 1234] = float("nan")
    logits[6] = 1.0  # every column tied
    cases = {
        "blocks": logits,
        "ragged vocabulary": logits[:, :31999].contiguous(),
        "non-contiguous": logits[:, ::2],
        "one row": logits[4:5],
    }
    for name, case in cases.items():
        expected = case.argmax(dim=-1)
        got = greedy_tokens(case)
        assert torch.equal(got, expected), f"{name}: greedy_tokens {got.tolist()}, argmax {expected.tolist()}"


def _sample_rows(logits, params, seed=0):
    from engine.request import Request
    from engine.sampling.sampler import Sampler

    requests = [Request(f"r{row}", [1], each) for row, each in enumerate(params)]
    sampler = Sampler(torch.device("cpu"), seed=seed)
    return sampler.sample(logits.clone(), requests, [None] * len(requests)).to_output()


def test_each_row_of_a_batch_gets_the_logprobs_of_its_own_mode():
    from engine.sampling.params import LogprobsMode, SamplingParams

    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    processed = LogprobsMode.PROCESSED
    params = [
        SamplingParams(max_new_tokens=1, temperature=0.5, logprobs=True, top_logprobs=3),
        SamplingParams(
            max_new_tokens=1, temperature=0.5, logprobs=True, top_logprobs=3, logprobs_mode=processed
        ),
        SamplingParams(
            max_new_tokens=1, temperature=1.0, top_k=2, logprobs=True, top_logprobs=5, logprobs_mode=processed
        ),
        SamplingParams(
            max_new_tokens=1, logprobs=True, top_logprobs=3, logit_bias=((7, 3.0),), logprobs_mode=processed
        ),
    ]
    output = _sample_rows(logits, params)
    biased = logits[3].clone()
    biased[7] += 3.0
    expected_rows = {
        0: torch.log_softmax(logits[0], dim=-1),  # raw: the temperature does not count
        1: torch.log_softmax(logits[1] / 0.5, dim=-1),
        3: torch.log_softmax(biased, dim=-1),  # greedy: after the bias, no temperature
    }
    for row, expected in expected_rows.items():
        token = output.token_ids[row]
        assert output.logprobs[row] == pytest.approx(expected[token].item(), abs=1e-5), (row, token)
        values, indices = expected.topk(3)
        assert list(output.top_logprobs[row]) == indices.tolist(), row
        assert list(output.top_logprobs[row].values()) == pytest.approx(values.tolist(), abs=1e-5), row
    assert output.token_ids[3] == int(biased.argmax())
    top_two = logits[2].topk(2)
    kept = torch.log_softmax(top_two.values, dim=-1)
    expected_top = dict(zip(top_two.indices.tolist(), kept.tolist(), strict=True))
    assert output.top_logprobs[2] == pytest.approx(expected_top), (
        "top_k=2: the three other alternatives asked for have logprob -inf and are left out"
    )
    assert output.token_ids[2] in top_two.indices.tolist()
    assert output.logprobs[2] == pytest.approx(output.top_logprobs[2][output.token_ids[2]])


def test_processed_logprobs_of_a_single_token_top_k_are_certain():
    from engine.sampling.params import LogprobsMode, SamplingParams

    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(
        max_new_tokens=1,
        temperature=0.7,
        top_k=1,
        logprobs=True,
        top_logprobs=2,
        logprobs_mode=LogprobsMode.PROCESSED,
    )
    output = _sample_rows(logits, [params])
    assert output.token_ids == [int(logits[0].argmax())]
    assert output.logprobs == [0.0] and output.top_logprobs == [{output.token_ids[0]: 0.0}]


def test_processed_logprobs_equal_log_softmax_of_the_scaled_logits_of_a_reference_forward(model):
    prompt = random_prompt(30, seed=5)
    config = ContinuousBatchingConfig(**CONFIG, logprobs_mode="processed_logprobs")
    with continuous_batching_context_manager(model, continuous_batching_config=config) as m:
        processed = _generate(m, prompt, max_new_tokens=8, temperature=0.5, seed=7, top_logprobs=2)
        raw = _generate(
            m, prompt, max_new_tokens=8, temperature=0.5, seed=7, top_logprobs=2, logprobs_mode="raw_logprobs"
        )
        with pytest.raises(
            ValueError,
            match=r"logprobs_mode must be one of \['raw_logprobs', 'processed_logprobs'\], got 'raw'",
        ):
            m.add_request(prompt, max_new_tokens=2, logprobs_mode="raw")
    assert processed.generated_tokens == raw.generated_tokens, (
        "the mode changes what is reported, not what is drawn"
    )
    sequence = torch.tensor([prompt + processed.generated_tokens])
    with torch.no_grad():
        logits = model(sequence).logits[0, len(prompt) - 1 : -1].float()
    chosen = torch.tensor(processed.generated_tokens).unsqueeze(1)
    for name, output, expected in (
        ("processed (the server's default)", processed, torch.log_softmax(logits / 0.5, dim=-1)),
        ("raw", raw, torch.log_softmax(logits, dim=-1)),
    ):
        want = expected.gather(1, chosen).squeeze(1)
        assert torch.allclose(torch.tensor(output.logprobs), want, atol=1e-4), (
            name,
            output.logprobs,
            want.tolist(),
        )
        assert [list(top) for top in output.top_logprobs] == expected.topk(2).indices.tolist(), name
