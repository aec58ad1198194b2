"""Batch-invariant mode online: a server started with `batch_invariant=True` (`cbserve serve
--batch-invariant`) gives a needle prompt the same tokens and logprobs, bit for bit, when one caller sends
it alone and when sixteen callers send their prompts at the same time over gRPC (issue 33), and the SDK's
`check_logprobs` recomputes those logprobs on the server bit for bit."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from cbserve_client import Client, Completion, check_logprobs

from tests.helpers.models import random_prompt, tiny_model
from tests.helpers.servers import RunningServer, engine_config_for_tests

NEEDLE = random_prompt(45, seed=4500)
CALLERS = 16
NEEDLES = 3


def _generate(target: str, prompt: list[int]) -> Completion:
    """One caller: its own connection, its own request."""
    with Client(target, timeout=120) as client:
        return client.generate(prompt, max_new_tokens=16, ignore_eos=True, logprobs=True)


def test_needle_has_the_same_bits_alone_and_among_concurrent_callers() -> None:
    running = RunningServer(
        tiny_model("llama"), config=engine_config_for_tests(batch_invariant=True, max_batch_tokens=64)
    )
    try:
        running.load()
        alone = _generate(running.target, NEEDLE)
        rng = random.Random(33)
        prompts = [random_prompt(rng.randint(1, 120), seed=rng.randrange(1 << 30)) for _ in range(CALLERS)]
        positions = sorted(rng.sample(range(CALLERS), NEEDLES))
        for position in positions:
            prompts[position] = NEEDLE
        with ThreadPoolExecutor(CALLERS) as pool:
            completions = list(pool.map(lambda prompt: _generate(running.target, prompt), prompts))
        rollouts = [
            (prompt, completion.token_ids, [entry.logprob for entry in completion.logprobs or ()])
            for prompt, completion in zip(prompts[:4], completions[:4], strict=True)
        ]
        with Client(running.target, timeout=120) as client:
            check = check_logprobs(client, rollouts)
            assert check.max_abs_difference == 0.0, (
                f"recomputed logprobs differ from the sampled ones by {check.differences}:\n"
                f"  sampled:    {[rollout[2] for rollout in rollouts]}\n  recomputed: {check.server_logprobs}"
            )
            prompt, tokens, logprobs = rollouts[0]
            off = check_logprobs(client, [(prompt, tokens, [logprobs[0] + 0.25, *logprobs[1:]])])
            assert off.max_abs_difference == pytest.approx(0.25), "a trainer off by 0.25 is reported so"
    finally:
        running.close()
    assert alone.logprobs is not None
    expected = torch.tensor([entry.logprob for entry in alone.logprobs])
    for position in positions:
        completion = completions[position]
        assert completion.token_ids == alone.token_ids, (
            f"caller {position}: tokens differ\n  alone:      {alone.token_ids}\n"
            f"  concurrent: {completion.token_ids}"
        )
        assert completion.logprobs is not None
        served = torch.tensor([entry.logprob for entry in completion.logprobs])
        assert torch.equal(served, expected), (
            f"caller {position}: logprobs differ by up to {(served - expected).abs().max().item():.3g}"
        )


def test_serve_flag_turns_the_mode_on() -> None:
    from service.cli import _parser, engine_config

    assert engine_config(_parser().parse_args(["serve", "--batch-invariant"])).batch_invariant is True
    assert engine_config(_parser().parse_args(["serve"])).batch_invariant is False
