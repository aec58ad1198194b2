"""One GenerationConfig handed to transformers' continuous batching and to cbserve's, in either order.

transformers' `generate_batch` writes `eos_token_id = -1` ("disabled") into a config without an EOS, in
place; cbserve reads that marker as transformers does (no EOS), so the same config serves the same greedy
tokens from both engines whichever runs first, and cbserve leaves the config as it found it.
"""

from __future__ import annotations

import pytest
from transformers import GenerationConfig

from engine import InvalidParameterError, generate_batch
from tests.helpers.models import fresh_tiny_model, random_prompt

NEW_TOKENS = 6
PROMPTS = [random_prompt(7, 1), random_prompt(12, 2), random_prompt(5, 3)]


def transformers_tokens(model, config: GenerationConfig) -> list[list[int]]:
    outputs = model.generate_batch(PROMPTS, generation_config=config, progress_bar=False)
    return [list(output.generated_tokens) for output in outputs.values()]


def cbserve_tokens(model, config: GenerationConfig, **kwargs) -> list[list[int]]:
    outputs = generate_batch(model, PROMPTS, generation_config=config, warmup=False, **kwargs)
    return [list(output.generated_tokens) for output in outputs.values()]


@pytest.mark.parametrize("transformers_first", [True, False], ids=["transformers-first", "cbserve-first"])
def test_one_config_without_eos_serves_the_same_tokens_from_both_engines(transformers_first: bool) -> None:
    model = fresh_tiny_model("llama")
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False)
    if transformers_first:
        theirs = transformers_tokens(model, config)
        assert config.eos_token_id == -1, "transformers no longer marks the config; this test is moot"
        ours = cbserve_tokens(model, config)
    else:
        ours = cbserve_tokens(model, config)
        assert config.eos_token_id is None, f"cbserve changed the config it was handed: {config.eos_token_id}"
        theirs = transformers_tokens(model, config)
    assert ours == theirs, f"cbserve: {ours}\ntransformers: {theirs}"
    assert all(len(tokens) == NEW_TOKENS for tokens in ours), ours


def test_one_config_with_an_eos_stops_both_engines_at_it() -> None:
    model = fresh_tiny_model("llama")
    unstopped = cbserve_tokens(model, GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False))
    eos = unstopped[0][2]  # the first prompt's third token
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=eos)
    theirs = transformers_tokens(model, config)
    ours = cbserve_tokens(model, config)
    assert ours == theirs, f"cbserve: {ours}\ntransformers: {theirs}"
    assert ours[0] == unstopped[0][: unstopped[0].index(eos) + 1]
    assert config.eos_token_id == eos


@pytest.mark.parametrize("disabled", [-1, [], [-1]])
def test_an_eos_argument_of_minus_one_or_an_empty_list_means_no_eos(disabled) -> None:
    model = fresh_tiny_model("llama")
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False)
    everything = cbserve_tokens(model, config)
    assert cbserve_tokens(model, config, eos_token_id=disabled) == everything


def test_other_negative_eos_ids_are_still_refused_naming_the_field() -> None:
    model = fresh_tiny_model("llama")
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-2)
    with pytest.raises(InvalidParameterError, match=r"eos_token_id: token id -2 is not in \[0, 256\)"):
        cbserve_tokens(model, config)
