"""The kept probability mass through the Python SDK against a live in-process server (issue 53):
`return_kept_mass=True` gives every token's TokenLogprob.log_kept_mass, equal to the renormalising
constant of top-k, top-p and min-p computed from a plain forward of the served model; a greedy request is
refused naming the field; a request that does not ask gets None."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from cbserve_client import Client, InvalidArgumentError

from tests.helpers.models import random_prompt, tiny_model
from tests.helpers.oracle import reference_kept_masses
from tests.helpers.servers import RunningServer, loaded_server

TIMEOUT = 60
TEMPERATURE = 0.5
TRUNCATIONS = {
    "top_k": dict(top_k=7),
    "top_p": dict(top_p=0.6),
    "min_p": dict(min_p=0.3),
    "top_k, top_p and min_p": dict(top_k=12, top_p=0.8, min_p=0.1),
}


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    running = loaded_server(tiny_model("llama"))
    try:
        yield running
    finally:
        running.close()


@pytest.fixture
def client(server: RunningServer) -> Iterator[Client]:
    with Client(server.target, timeout=TIMEOUT, stream_timeout=TIMEOUT) as connected:
        yield connected


@pytest.mark.parametrize("name", list(TRUNCATIONS))
def test_each_token_carries_the_reference_kept_mass(client: Client, name: str) -> None:
    prompt = random_prompt(20, seed=21)
    completion = client.generate(
        prompt,
        max_new_tokens=6,
        ignore_eos=True,
        temperature=TEMPERATURE,
        seed=22,
        return_kept_mass=True,
        logprobs_mode="processed_logprobs",
        **TRUNCATIONS[name],
    )
    assert completion.logprobs is not None and len(completion.logprobs) == len(completion.token_ids) == 6
    got = [step.log_kept_mass for step in completion.logprobs]
    expected = reference_kept_masses(
        tiny_model("llama"), prompt, list(completion.token_ids), TEMPERATURE, **TRUNCATIONS[name]
    )
    assert got == pytest.approx(expected, abs=1e-4), name
    assert sum(value < -1e-3 for value in expected) >= 3, f"{name}: the case must truncate"


def test_streamed_chunks_carry_the_kept_mass_of_their_tokens(client: Client) -> None:
    sampling = dict(
        max_new_tokens=5, ignore_eos=True, temperature=0.8, top_k=5, seed=23, return_kept_mass=True
    )
    prompt = random_prompt(10, seed=24)
    streamed = [step.log_kept_mass for chunk in client.stream(prompt, **sampling) for step in chunk.logprobs]
    whole = client.generate(prompt, **sampling)
    assert whole.logprobs is not None
    assert streamed == [step.log_kept_mass for step in whole.logprobs]
    assert all(value is not None and value < 0.0 for value in streamed), streamed


def test_a_request_that_does_not_ask_gets_no_kept_mass(client: Client) -> None:
    completion = client.generate([5, 6, 7], max_new_tokens=3, temperature=0.8, top_k=5, logprobs=True)
    assert completion.logprobs is not None
    assert [step.log_kept_mass for step in completion.logprobs] == [None] * 3


def test_a_greedy_request_is_refused_naming_the_field(client: Client) -> None:
    with pytest.raises(
        InvalidArgumentError, match=r"sampling\.return_kept_mass needs a request that samples"
    ):
        client.generate([5, 6], max_new_tokens=2, temperature=0.0, return_kept_mass=True)
    with pytest.raises(TypeError, match="return_kept_mass must be a bool"):
        client.generate([5, 6], max_new_tokens=2, temperature=1.0, return_kept_mass="yes")
