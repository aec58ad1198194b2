"""Async batching: each step is launched before the previous one's tokens are back.

Every behaviour of the synchronous loop must hold unchanged: greedy parity with `model.generate`,
preemption (recompute and offload), prefix caching, chunked prefill, EOS, cancellation, seeded sampling
and log-probabilities. Each test also checks that steps really were prepared ahead (some input ids were
fed from the previous step's tokens on the device), so a silent fallback to the synchronous loop fails.
"""

from __future__ import annotations

import pytest
import torch

from engine import ContinuousBatchingConfig, RequestStatus, init_continuous_batching
from engine.engine_core import EngineCore
from tests.helpers.engine_runs import engine_core, fail_forward_once, generate_greedy
from tests.helpers.models import TEST_DEVICE, random_prompt, tiny_model
from tests.helpers.oracle import assert_greedy_parity, reference_greedy

TIMEOUT = 120


def _config(**overrides) -> ContinuousBatchingConfig:
    settings = {"page_size": 8, "num_blocks": 96, "max_batch_tokens": 48, "use_async_batching": True}
    settings.update(overrides)
    return ContinuousBatchingConfig(**settings)


def _assert_ran_ahead(engine: EngineCore) -> None:
    assert engine.async_batching, "use_async_batching=True did not turn async batching on"
    assert engine.runner.num_placeholder_inputs > 0, "no step was prepared before its predecessor's tokens"


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral", "gemma2"])
def test_greedy_parity_with_chunked_prefill_for_every_family(family):
    model = tiny_model(family)
    prompts = [random_prompt(length, seed=100 + length) for length in (1, 9, 30, 70, 120)]
    new_tokens = [12, 30, 1, 20, 40]
    generated, engine = generate_greedy(model, _config(), prompts, new_tokens)
    _assert_ran_ahead(engine)
    assert_greedy_parity(model, prompts, new_tokens, generated, f"async, {family}")


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_greedy_parity_on_the_kernel_path(family):
    """Placeholder input ids in steps the attention kernel serves whole, prefill chunks included (on the
    CPU under Triton's interpreter)."""
    pytest.importorskip("triton")
    model = tiny_model(family)
    prompts = [random_prompt(length, seed=150 + length) for length in (1, 9, 30, 70)]
    new_tokens = [12, 20, 9, 16]
    generated, engine = generate_greedy(model, _config(max_blocks_per_request=32), prompts, new_tokens)
    assert engine.runner.forward_paths.attention_kernel is not None
    _assert_ran_ahead(engine)
    assert_greedy_parity(model, prompts, new_tokens, generated, f"async, kernel path, {family}")


@pytest.mark.parametrize("scheduler_type", ["fifo", "prefill_first"])
@pytest.mark.parametrize("offload", [False, True], ids=["recompute", "offload"])
def test_greedy_parity_under_preemption(offload, scheduler_type):
    model = tiny_model("llama")
    prompts = [random_prompt(length, seed=200 + length) for length in (60, 75, 90, 50, 66, 81)]
    new_tokens = [40] * len(prompts)
    config = _config(
        num_blocks=34,
        max_batch_tokens=256,
        allow_block_sharing=False,
        cpu_offload_space=0.01 if offload else 0.0,
        scheduler_type=scheduler_type,
    )
    generated, engine = generate_greedy(model, config, prompts, new_tokens)
    stats = engine.make_stats()
    counters = stats.scheduler.counters
    assert counters.preemptions > 0, "the cache was meant to be too small to avoid preemption"
    assert (counters.offloaded_blocks > 0) == offload, counters
    assert stats.kv_cache.num_blocks_used == 0
    _assert_ran_ahead(engine)
    assert_greedy_parity(model, prompts, new_tokens, generated, "async under preemption")


def test_greedy_parity_with_prefix_caching_preemption_and_chunking():
    model = tiny_model("qwen3")
    shared = random_prompt(64, seed=300)
    prompts = [shared + random_prompt(20 + 9 * index, seed=301 + index) for index in range(6)]
    new_tokens = [36] * len(prompts)
    config = _config(num_blocks=40, allow_block_sharing=True)
    generated, engine = generate_greedy(model, config, prompts, new_tokens)
    stats = engine.make_stats()
    assert stats.scheduler.counters.preemptions > 0
    assert stats.kv_cache.prefix_cache.hit_tokens > 0
    _assert_ran_ahead(engine)
    assert_greedy_parity(model, prompts, new_tokens, generated, "async with prefix caching")


def test_eos_ends_a_request_at_its_eos_token_and_the_step_run_ahead_is_dropped():
    model = tiny_model("llama")
    prompt, other = random_prompt(20, seed=400), random_prompt(33, seed=401)
    expected = reference_greedy(model, prompt, 12)
    eos = expected[4]
    manager = init_continuous_batching(model, continuous_batching_config=_config())
    manager.start()
    try:
        stopped_id = manager.add_request(prompt, max_new_tokens=12, eos_token_id=[eos])
        other_id = manager.add_request(other, max_new_tokens=12, eos_token_id=[])
        stopped = manager.get_result(stopped_id, timeout=TIMEOUT)
        finished = manager.get_result(other_id, timeout=TIMEOUT)
        stats = manager.stats()
        engine = engine_core(manager)
    finally:
        manager.destroy()
    assert stopped.finish_reason == "eos"
    assert stopped.generated_tokens == expected[: expected.index(eos) + 1]
    assert finished.generated_tokens == reference_greedy(model, other, 12)
    assert stats.num_blocks_used == 0, stats
    _assert_ran_ahead(engine)


def _sampled_outputs(use_async_batching: bool):
    model = tiny_model("llama")
    manager = init_continuous_batching(
        model, continuous_batching_config=_config(use_async_batching=use_async_batching, return_logprobs=True)
    )
    manager.start()
    try:
        ids = [
            manager.add_request(
                random_prompt(10 + 7 * index, seed=500 + index),
                max_new_tokens=16,
                eos_token_id=[],
                temperature=0.8,
                top_k=50,
                top_p=0.9,
                seed=index,
                top_logprobs=3,
            )
            for index in range(4)
        ]
        outputs = [manager.get_result(request_id, timeout=TIMEOUT) for request_id in ids]
        engine = engine_core(manager)
    finally:
        manager.destroy()
    return outputs, engine


def test_seeded_sampling_and_logprobs_equal_the_synchronous_loop():
    synchronous, _ = _sampled_outputs(use_async_batching=False)
    ahead, engine = _sampled_outputs(use_async_batching=True)
    _assert_ran_ahead(engine)
    for sync_output, async_output in zip(synchronous, ahead, strict=True):
        assert async_output.generated_tokens == sync_output.generated_tokens
        assert len(async_output.logprobs) == 16 and len(async_output.top_logprobs) == 16
        torch.testing.assert_close(async_output.logprobs, sync_output.logprobs)
        assert [list(top) for top in async_output.top_logprobs] == [
            list(top) for top in sync_output.top_logprobs
        ]


def test_cancel_with_a_step_in_flight_ends_cancelled_and_frees_every_block():
    model = tiny_model("llama")
    manager = init_continuous_batching(model, continuous_batching_config=_config())
    manager.start()
    try:
        doomed = manager.add_request(
            random_prompt(30, seed=600), max_new_tokens=400, streaming=True, eos_token_id=[]
        )
        kept = manager.add_request(random_prompt(12, seed=601), max_new_tokens=30, eos_token_id=[])
        stream = manager.request_id_iter(doomed)
        next(stream)
        manager.cancel_request(doomed)
        last = list(stream)[-1]
        assert last.status == RequestStatus.CANCELLED and len(last.generated_tokens) < 400
        finished = manager.get_result(kept, timeout=TIMEOUT)
        stats = manager.stats()
        engine = engine_core(manager)
    finally:
        manager.destroy()
    assert finished.generated_tokens == reference_greedy(model, random_prompt(12, seed=601), 30)
    assert stats.num_blocks_used == 0, stats
    _assert_ran_ahead(engine)


def test_async_batching_is_off_unless_asked_for():
    model = tiny_model("llama")
    for config in (ContinuousBatchingConfig(num_blocks=16), _config(num_blocks=16, use_async_batching=False)):
        engine = EngineCore(model, config)
        # Released: an engine gives the shared model its own layers back.
        engine.release_model()
        assert not engine.async_batching


def test_a_step_that_fails_to_launch_fails_its_requests_and_the_loop_keeps_serving(monkeypatch):
    model = tiny_model("llama")
    manager = init_continuous_batching(model, continuous_batching_config=_config())
    manager.start()
    try:
        with manager.pause():
            # The third forward is launched while the second step is in flight.
            fail_forward_once(monkeypatch, engine_core(manager).runner, on_call=3)
            doomed = manager.add_request(random_prompt(6, seed=700), max_new_tokens=8, eos_token_id=[])
        output = manager.get_result(doomed, timeout=TIMEOUT)
        assert output.status == RequestStatus.FAILED and "injected fault" in output.error
        assert len(output.generated_tokens) <= 2, output
        prompt = random_prompt(9, seed=701)
        survivor = manager.add_request(prompt, max_new_tokens=6, eos_token_id=[])
        served = manager.get_result(survivor, timeout=TIMEOUT)
        stats = manager.stats()
    finally:
        manager.destroy()
    assert served.generated_tokens == reference_greedy(model, prompt, 6)
    assert stats.failed_steps == 1 and stats.num_blocks_used == 0, stats


@pytest.mark.skipif(TEST_DEVICE.type != "cuda", reason="CUDA graphs need CBSERVE_TEST_DEVICE=cuda")
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_greedy_parity_with_decode_graphs_and_the_attention_kernel(family):
    """Placeholder inputs go into a graph's static input buffer; the kernel reads their fresh keys."""
    model = tiny_model(family)
    prompts = [random_prompt(length, seed=900 + length) for length in (1, 9, 30, 70)]
    new_tokens = [20, 12, 30, 9]
    config = _config(use_cuda_graph=(False, True), kv_padding_interval_size=16, max_blocks_per_request=32)
    generated, engine = generate_greedy(model, config, prompts, new_tokens, warmup=True)
    graphs = engine.runner.forward_paths.decode_graphs
    assert graphs is not None and len(graphs.graphs) > 0, "no decode step replayed a graph"
    _assert_ran_ahead(engine)
    assert_greedy_parity(model, prompts, new_tokens, generated, f"async, decode graphs, {family}")


@pytest.mark.skipif(TEST_DEVICE.type != "cuda", reason="only CUDA has implicit synchronisations to look for")
def test_launching_a_step_never_waits_for_the_device(monkeypatch):
    """The overlap exists only if `launch` queues its work without an implicit synchronisation (a pageable
    copy, `.item()`, `nonzero()`): CUDA's sync debug mode turns each into an error that fails the step."""
    model = tiny_model("llama")
    manager = init_continuous_batching(model, continuous_batching_config=_config(return_logprobs=True))
    manager.start()
    try:
        runner = engine_core(manager).runner
        launch = runner.launch

        def launch_without_synchronising(scheduler_output, previous=None):
            torch.cuda.set_sync_debug_mode("error")
            try:
                return launch(scheduler_output, previous)
            finally:
                torch.cuda.set_sync_debug_mode("default")

        monkeypatch.setattr(runner, "launch", launch_without_synchronising)
        prompts = [random_prompt(length, seed=800 + length) for length in (5, 40, 90)]
        greedy = [manager.add_request(prompt, max_new_tokens=10, eos_token_id=[]) for prompt in prompts]
        sampled = manager.add_request(prompts[0], max_new_tokens=10, temperature=0.7, top_p=0.9, seed=1)
        outputs = [manager.get_result(request_id, timeout=TIMEOUT) for request_id in [*greedy, sampled]]
        engine = engine_core(manager)
    finally:
        manager.destroy()
    for output in outputs:
        assert output.error is None, output.error
    for output, prompt in zip(outputs, prompts, strict=False):
        assert output.generated_tokens == reference_greedy(model, prompt, 10)
    _assert_ran_ahead(engine)
