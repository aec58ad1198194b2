"""LFM2's short convolutions through the engine: each request's convolution state lives in its slot across
steps, so chunked prefill, preemption with recompute, async batching, forked sequences and slots reused by
later requests all give `model.generate`'s greedy tokens; what the state cannot go with is refused at load.
"""

from __future__ import annotations

import pytest
import torch

from engine import ContinuousBatchingConfig, ContinuousBatchingManager, init_continuous_batching
from engine.errors import UnsupportedModelError
from engine.kv.layer_groups import kv_cache_groups, state_group
from engine.request import RequestStatus, sequence_request_id
from engine.runner.kv_cache import KVCacheShape, resolve_cache_sizes
from engine.runner.recurrent.state_cache import state_bytes
from tests.helpers.engine_runs import dequantized_copy, engine_core
from tests.helpers.families import tiny_family_model
from tests.helpers.models import random_prompt
from tests.helpers.oracle import reference_greedy

NEW_TOKENS = 12
TIMEOUT = 120


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_family_model("lfm2")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return [random_prompt(length, seed=100 + length) for length in (3, 17, 40, 9, 26)]


@pytest.fixture(scope="module")
def expected(model, prompts) -> list[list[int]]:
    return [reference_greedy(model, prompt, NEW_TOKENS) for prompt in prompts]


def _outputs(model, prompts, sampling=None, **config):
    """Every prompt's final output through one manager (EOS ignored), and its stats."""
    settings: dict[str, object] = dict(page_size=8, num_blocks=64, max_batch_tokens=64)
    settings.update(config)
    manager = init_continuous_batching(model, continuous_batching_config=ContinuousBatchingConfig(**settings))
    manager.start()
    try:
        ids = [
            manager.add_request(prompt, max_new_tokens=NEW_TOKENS, eos_token_id=[], **(sampling or {}))
            for prompt in prompts
        ]
        outputs = [manager.get_result(request_id, timeout=TIMEOUT) for request_id in ids]
        manager.stop(block=True, timeout=TIMEOUT)
        stats = manager.stats()
    finally:
        manager.destroy()
    for output in outputs:
        assert output is not None and output.status == RequestStatus.FINISHED, output
    return outputs, stats


def _run(model, prompts, **config):
    """Greedy tokens of every prompt through one manager, and its stats."""
    outputs, stats = _outputs(model, prompts, **config)
    return [list(output.generated_tokens) for output in outputs], stats


def _assert_parity(prompts, got, expected, label):
    for prompt, tokens, reference in zip(prompts, got, expected, strict=True):
        assert tokens == reference, (
            f"lfm2 {label}, prompt of {len(prompt)} tokens, differs from model.generate\n"
            f"  engine:   {tokens}\n  generate: {reference}"
        )


def test_a_prompt_arriving_over_several_steps_carries_its_state_from_chunk_to_chunk(model, prompts, expected):
    got, _ = _run(model, prompts, max_batch_tokens=8)  # 40 tokens: five chunks beside other requests
    _assert_parity(prompts, got, expected, "chunked prefill of 8 tokens a step")


def test_preempted_requests_recompute_their_state_and_give_the_tokens_they_give_alone(
    model, prompts, expected
):
    # 12 usable blocks of 8 tokens cannot hold the five requests' 40 + 12 tokens at once: some are preempted,
    # and with room on the host they still recompute (a state has no host copy).
    got, stats = _run(model, prompts, num_blocks=13, cpu_offload_space=0.01)
    assert stats.preemptions > 0 and stats.recomputed_tokens > 0, stats
    assert stats.offloaded_blocks == 0, stats
    _assert_parity(prompts, got, expected, "with preemptions")


def test_a_slot_reused_by_a_later_request_starts_from_zeros(model, prompts, expected):
    got, _ = _run(model, prompts, max_requests_per_batch=1)  # one slot, each request after the last
    _assert_parity(prompts, got, expected, "one request at a time")


def test_async_batching_reads_each_state_after_the_step_that_wrote_it(model, prompts, expected):
    got, _ = _run(model, prompts, use_async_batching=True, max_batch_tokens=16)
    _assert_parity(prompts, got, expected, "async batching")


def test_the_gather_path_serves_the_attention_layers_beside_the_convolutions(model, prompts, expected):
    got, _ = _run(model, prompts, max_blocks_per_request=0)
    _assert_parity(prompts, got, expected, "gather path")


def test_forked_sequences_take_a_copy_of_the_prompts_state(model):
    prompt = random_prompt(19, seed=19)
    config = ContinuousBatchingConfig(page_size=8, num_blocks=64, max_batch_tokens=64)
    manager = ContinuousBatchingManager(model, continuous_batching_config=config)
    manager.start()
    try:
        request_id = manager.add_request(
            prompt, eos_token_id=[], num_return_sequences=3, max_new_tokens=NEW_TOKENS
        )
        outputs = []
        for index in range(3):
            output = manager.get_result(sequence_request_id(request_id, index), timeout=TIMEOUT)
            while output is not None and not output.is_finished():
                output = manager.get_result(sequence_request_id(request_id, index), timeout=TIMEOUT)
            outputs.append(output)
        stats = manager.stats()
    finally:
        manager.destroy()
    expected = reference_greedy(model, prompt, NEW_TOKENS)
    assert [output.generated_tokens for output in outputs] == [expected] * 3
    assert stats.forked_sequences == 2


def test_prefix_caching_is_off_so_a_repeated_prompt_computes_its_whole_state(model, prompts, expected):
    repeated = [prompts[2], prompts[2]]
    got, stats = _run(model, repeated, allow_block_sharing=True, max_requests_per_batch=1)
    assert not stats.prefix_caching_enabled and stats.prefix_cache_hit_tokens == 0, stats
    _assert_parity(repeated, got, [expected[2]] * 2, "a repeated prompt")


def test_batch_invariant_mode_gives_a_request_the_same_bits_alone_and_batched(model, prompts):
    (alone,), _ = _outputs(model, prompts[2:3], dict(logprobs=True), batch_invariant=True)
    outputs, _ = _outputs(model, prompts, dict(logprobs=True), batch_invariant=True, max_batch_tokens=16)
    batched = outputs[2]
    assert batched.generated_tokens == alone.generated_tokens, (
        alone.generated_tokens,
        batched.generated_tokens,
    )
    assert torch.equal(torch.tensor(batched.logprobs), torch.tensor(alone.logprobs)), (
        f"alone:   {alone.logprobs}\nbatched: {batched.logprobs}"
    )


def test_int8_layers_around_the_convolution_give_generates_tokens_on_their_dequantized_weights(prompts):
    quantized = tiny_family_model("lfm2")
    got, _ = _run(quantized, prompts, quantization="int8", quantize_activations=False)
    oracle = dequantized_copy(quantized, tiny_family_model("lfm2"))
    expected = [reference_greedy(oracle, prompt, NEW_TOKENS) for prompt in prompts]
    _assert_parity(prompts, got, expected, "int8")


def test_sleep_frees_the_state_slots_and_the_requests_recompute_after_waking(model, prompts, expected):
    config = ContinuousBatchingConfig(page_size=8, num_blocks=64, max_batch_tokens=8)
    manager = init_continuous_batching(model, continuous_batching_config=config)
    manager.start()
    try:
        ids = [manager.add_request(prompt, max_new_tokens=NEW_TOKENS, eos_token_id=[]) for prompt in prompts]
        released = manager.sleep(level=1).released_bytes
        manager.wake_up()
        outputs = [manager.get_result(request_id, timeout=TIMEOUT) for request_id in ids]
    finally:
        manager.destroy()
    group = state_group(model.config)
    assert group is not None
    assert released >= state_bytes(group, 1025, torch.float32), released
    _assert_parity(prompts, [list(output.generated_tokens) for output in outputs], expected, "after sleep")


def test_the_engine_gives_the_modules_their_own_forwards_back(model):
    _run(model, [random_prompt(5, seed=5)])
    convs = [module for module in model.modules() if type(module).__name__ == "Lfm2ShortConv"]
    assert len(convs) == 2 and all("forward" not in vars(module) for module in convs)


@pytest.mark.parametrize(
    ("config", "lacking"),
    [(dict(use_cuda_graph=True), "use_cuda_graph"), (dict(use_cuda_graph=(False, True)), "use_cuda_graph")],
)
def test_a_combination_the_state_cannot_go_with_is_refused_at_load(model, config, lacking):
    manager = init_continuous_batching(model, continuous_batching_config=ContinuousBatchingConfig(**config))
    with pytest.raises(UnsupportedModelError) as refused:
        engine_core(manager)
    message = str(refused.value)
    assert "Lfm2ForCausalLM (model type 'lfm2')" in message and lacking in message, message
    assert "short-convolution layers keep a state per request" in message, message


def test_the_cache_plan_takes_the_state_slots_from_the_budget_before_sizing_blocks(model):
    text_config = model.config.get_text_config()
    group = state_group(text_config)
    assert group is not None
    reserved = state_bytes(group, 1025, torch.float32)
    assert reserved == 2 * 1025 * 2 * text_config.hidden_size * 4
    shape = KVCacheShape.from_model_config(model.config, torch.float32)
    sizing = dict(
        shape=shape,
        groups=kv_cache_groups(text_config),
        device=torch.device("cpu"),
        page_size=8,
        num_blocks=None,
        max_batch_tokens=64,
        max_memory_percent=1.0,
        max_tokens_needed=1 << 30,
        max_requests=1024,
        activation_bytes_per_token=0,
    )
    budget = 64 * reserved
    (without,), _ = resolve_cache_sizes(**sizing, max_budget_bytes=budget)  # type: ignore[arg-type]
    (with_state,), _ = resolve_cache_sizes(
        **sizing,  # type: ignore[arg-type]
        max_budget_bytes=budget,
        reserved_bytes=reserved,
    )
    bytes_per_block = shape.for_layers(1).bytes_per_token() * 8
    assert without - with_state == pytest.approx(reserved / bytes_per_block, abs=1)
