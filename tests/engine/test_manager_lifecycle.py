"""The manager's lifecycle and delivery semantics, one behaviour per test."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time

import pytest

from engine import (
    ContinuousBatchingConfig,
    ContinuousBatchingManager,
    DuplicateRequestError,
    QueueFullError,
    RequestStatus,
    continuous_batching_context_manager,
    generate_batch,
    init_continuous_batching,
)
from tests.helpers.engine_runs import engine_core, fail_forward_once
from tests.helpers.models import VOCAB_SIZE, random_prompt, tiny_config, tiny_model
from tests.helpers.oracle import reference_greedy

TIMEOUT = 60


@pytest.fixture
def model():
    return tiny_model("llama")


@pytest.fixture
def manager(model):
    manager = init_continuous_batching(
        model,
        continuous_batching_config=ContinuousBatchingConfig(
            page_size=8, num_blocks=128, max_batch_tokens=128
        ),
    )
    manager.start()
    yield manager
    manager.destroy()


def _wait_until(predicate, timeout=TIMEOUT):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.01)


def test_add_request_and_get_result_by_id(manager, model):
    prompt = random_prompt(20, seed=1)
    request_id = manager.add_request(prompt, request_id="mine", max_new_tokens=6, eos_token_id=[])
    assert request_id == "mine"
    output = manager.get_result("mine", timeout=TIMEOUT)
    assert output.status == RequestStatus.FINISHED and output.finish_reason == "length"
    assert output.generated_tokens == reference_greedy(model, prompt, 6)


def test_get_result_by_id_leaves_other_requests_outputs_in_place(manager):
    first = manager.add_request(random_prompt(8, seed=2), max_new_tokens=2, eos_token_id=[])
    second = manager.add_request(random_prompt(8, seed=3), max_new_tokens=12, eos_token_id=[])
    assert manager.get_result(second, timeout=TIMEOUT).request_id == second
    # `first` finished long before; its output is still there for an id-less get_result.
    assert manager.get_result(timeout=TIMEOUT).request_id == first
    assert manager.get_result(timeout=0.05) is None


def test_streaming_emits_one_cumulative_output_per_token_and_ends_with_finished(manager):
    request_id = manager.add_request(
        random_prompt(10, seed=4), max_new_tokens=5, streaming=True, eos_token_id=[]
    )
    outputs = list(manager.request_id_iter(request_id))
    assert [len(output.generated_tokens) for output in outputs] == [1, 2, 3, 4, 5]
    assert [output.status for output in outputs[:-1]] == [RequestStatus.DECODING] * 4
    assert outputs[-1].status == RequestStatus.FINISHED
    assert all(
        later.generated_tokens[: len(early.generated_tokens)] == early.generated_tokens
        for early, later in itertools.pairwise(outputs)
    )


def test_non_streaming_request_emits_exactly_one_output(manager):
    request_id = manager.add_request(random_prompt(10, seed=5), max_new_tokens=4, eos_token_id=[])
    outputs = list(manager.request_id_iter(request_id))
    assert len(outputs) == 1 and outputs[0].is_finished()


def test_iterating_the_manager_yields_every_request_until_stopped(manager):
    ids = {
        manager.add_request(random_prompt(6, seed=seed), max_new_tokens=3, eos_token_id=[])
        for seed in range(4)
    }
    seen = set()
    for output in manager:
        seen.add(output.request_id)
        if seen == ids:
            manager.stop(block=False)
    assert seen == ids


def test_result_handler_receives_outputs_on_the_callers_event_loop(manager):
    async def collect():
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        received = []

        def on_output(output):
            assert asyncio.get_running_loop() is loop
            received.append(output)
            if output.is_finished():
                done.set_result(None)

        request_id = manager.add_request(
            random_prompt(5, seed=6), max_new_tokens=4, streaming=True, eos_token_id=[]
        )
        manager.register_result_handler(request_id, on_output)
        await asyncio.wait_for(done, TIMEOUT)
        return received

    received = asyncio.run(collect())
    assert [len(output.generated_tokens) for output in received] == [1, 2, 3, 4]


def test_cancel_mid_stream_ends_with_cancelled_and_frees_blocks(manager):
    request_id = manager.add_request(
        random_prompt(30, seed=7), max_new_tokens=500, streaming=True, eos_token_id=[]
    )
    stream = manager.request_id_iter(request_id)
    first = next(stream)
    assert first.status == RequestStatus.DECODING
    manager.cancel_request(request_id)
    last = list(stream)[-1]
    assert last.status == RequestStatus.CANCELLED and last.finish_reason == "cancelled"
    assert len(last.generated_tokens) < 500
    _wait_until(lambda: manager.stats().num_blocks_used == 0)


def test_cancel_of_unknown_or_finished_request_is_a_no_op(manager):
    request_id = manager.add_request(random_prompt(4, seed=8), max_new_tokens=2, eos_token_id=[])
    manager.get_result(request_id, timeout=TIMEOUT)
    manager.cancel_request(request_id)
    manager.cancel_request("never-existed")
    again = manager.add_request(random_prompt(4, seed=9), max_new_tokens=2, eos_token_id=[])
    assert manager.get_result(again, timeout=TIMEOUT).status == RequestStatus.FINISHED
    assert manager.get_result(request_id, timeout=0.05) is None


def test_nothing_is_generated_while_paused_and_generation_resumes_after(manager):
    request_id = manager.add_request(
        random_prompt(10, seed=10), max_new_tokens=400, streaming=True, eos_token_id=[]
    )
    stream = manager.request_id_iter(request_id)
    next(stream)
    with manager.pause():
        assert manager.stats().paused
        while manager.get_result(request_id, timeout=0.05) is not None:
            pass  # drain outputs of the step that was running when the pause began
        time.sleep(0.3)
        assert manager.get_result(request_id, timeout=0.05) is None, "a token was generated while paused"
    assert manager.get_result(request_id, timeout=TIMEOUT) is not None
    manager.cancel_request(request_id)


def test_stats_report_the_pause_as_soon_as_it_is_taken_and_as_soon_as_it_is_left(manager):
    # A trainer pauses, pushes weights, resumes and checks the status straight away: the snapshot must
    # not lag behind the loop thread, which may not have run between the two calls.
    for _ in range(20):
        with manager.pause():
            stats = manager.stats()
            assert stats.paused and stats.num_pause_holders == 1, stats
        stats = manager.stats()
        assert not stats.paused and stats.num_pause_holders == 0, stats


def test_pause_held_by_two_threads_resumes_only_when_both_leave(manager):
    first_in, second_in, release_first = threading.Event(), threading.Event(), threading.Event()

    def hold(entered, release):
        with manager.pause():
            entered.set()
            release.wait(TIMEOUT)

    release_second = threading.Event()
    threads = [
        threading.Thread(target=hold, args=(first_in, release_first)),
        threading.Thread(target=hold, args=(second_in, release_second)),
    ]
    for thread in threads:
        thread.start()
    assert first_in.wait(TIMEOUT) and second_in.wait(TIMEOUT)
    request_id = manager.add_request(random_prompt(5, seed=11), max_new_tokens=2, eos_token_id=[])
    release_first.set()
    threads[0].join(TIMEOUT)
    assert manager.get_result(request_id, timeout=0.3) is None, (
        "the loop resumed while a pause was still held"
    )
    release_second.set()
    threads[1].join(TIMEOUT)
    assert manager.get_result(request_id, timeout=TIMEOUT).status == RequestStatus.FINISHED


def test_pause_keeps_in_flight_requests_and_their_outputs_match_an_unpaused_run(manager, model):
    prompt = random_prompt(25, seed=12)
    request_id = manager.add_request(prompt, max_new_tokens=30, streaming=True, eos_token_id=[])
    stream = manager.request_id_iter(request_id)
    next(stream)
    with manager.pause():
        time.sleep(0.1)
    final = list(stream)[-1]
    assert final.generated_tokens == reference_greedy(model, prompt, 30)


def test_hard_stop_fails_queued_and_active_requests(model):
    manager = init_continuous_batching(
        model, continuous_batching_config=ContinuousBatchingConfig(num_blocks=64)
    )
    manager.start()
    try:
        ids = [
            manager.add_request(random_prompt(20, seed=s), max_new_tokens=1000, eos_token_id=[])
            for s in range(3)
        ]
        manager.stop(hard_stop=True, timeout=TIMEOUT)
        outputs = [manager.get_result(request_id, timeout=TIMEOUT) for request_id in ids]
        assert all(
            output.status == RequestStatus.FAILED and "hard-stopped" in output.error for output in outputs
        )
        assert not manager.is_running()
        assert manager.stats().num_blocks_used == 0
    finally:
        manager.destroy()


def test_stop_drains_then_refuses_submissions_and_start_works_again(manager):
    request_id = manager.add_request(random_prompt(5, seed=13), max_new_tokens=8, eos_token_id=[])
    manager.stop(block=True, timeout=TIMEOUT)
    assert manager.get_result(request_id, timeout=TIMEOUT).status == RequestStatus.FINISHED
    with pytest.warns(UserWarning, match="stopped"):
        assert manager.add_request(random_prompt(5, seed=14), max_new_tokens=2) is None
    manager.start()
    again = manager.add_request(random_prompt(5, seed=15), max_new_tokens=2, eos_token_id=[])
    assert manager.get_result(again, timeout=TIMEOUT).status == RequestStatus.FINISHED


def test_request_that_can_never_fit_is_refused_at_once_with_sizes_named(model):
    config = ContinuousBatchingConfig(page_size=8, num_blocks=17, max_batch_tokens=64)
    with continuous_batching_context_manager(model, continuous_batching_config=config) as manager:
        small = manager.add_request(random_prompt(10, seed=16), max_new_tokens=5, eos_token_id=[])
        with pytest.raises(ValueError, match=r"needs up to 200 tokens .* the whole cache holds 128 tokens"):
            manager.add_request(random_prompt(100, seed=17), max_new_tokens=100, eos_token_id=[])
        assert manager.get_result(small, timeout=TIMEOUT).status == RequestStatus.FINISHED


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"input_ids": []}, "non-empty"),
        ({"input_ids": [VOCAB_SIZE]}, r"\[0, 256\)"),
        ({"input_ids": [-1]}, r"\[0, 256\)"),
        ({"input_ids": [1], "max_new_tokens": 0}, "max_new_tokens"),
        ({"input_ids": [1], "temperature": -0.5}, "temperature"),
        ({"input_ids": [1], "top_p": 0.0}, "top_p"),
        ({"input_ids": [1], "top_p": 1.5}, "top_p"),
        ({"input_ids": [1], "top_k": -1}, "top_k"),
    ],
)
def test_bad_input_raises_value_error_and_the_engine_keeps_serving(manager, kwargs, message):
    with pytest.raises(ValueError, match=message):
        manager.add_request(**kwargs)
    request_id = manager.add_request(random_prompt(4, seed=18), max_new_tokens=2, eos_token_id=[])
    assert manager.get_result(request_id, timeout=TIMEOUT).status == RequestStatus.FINISHED


def test_duplicate_live_request_id_is_rejected(manager):
    manager.add_request(random_prompt(4, seed=19), request_id="dup", max_new_tokens=300, eos_token_id=[])
    # A DuplicateRequestError, which is a ValueError, as transformers raises.
    with pytest.raises(DuplicateRequestError, match="already in flight"):
        manager.add_request(random_prompt(4, seed=20), request_id="dup")
    manager.cancel_request("dup")


def test_full_queue_raises_queue_full_error_and_keeps_queued_requests(model):
    config = ContinuousBatchingConfig(num_blocks=64, max_queue_size=2)
    with continuous_batching_context_manager(model, continuous_batching_config=config) as manager:
        with manager.pause():
            ids = [
                manager.add_request(random_prompt(4, seed=s), max_new_tokens=2, eos_token_id=[])
                for s in (1, 2)
            ]
            with pytest.raises(QueueFullError, match="max_queue_size=2"):
                manager.add_request(random_prompt(4, seed=3), max_new_tokens=2)
        assert all(manager.get_result(i, timeout=TIMEOUT).status == RequestStatus.FINISHED for i in ids)


def test_a_failing_step_fails_only_its_requests_and_the_loop_keeps_serving(manager, monkeypatch):
    with manager.pause():
        fail_forward_once(monkeypatch, engine_core(manager).runner, on_call=1)
        doomed = manager.add_request(random_prompt(4, seed=21), max_new_tokens=3, eos_token_id=[])
    output = manager.get_result(doomed, timeout=TIMEOUT)
    assert output.status == RequestStatus.FAILED and "injected fault" in output.error
    survivor = manager.add_request(random_prompt(4, seed=22), max_new_tokens=3, eos_token_id=[])
    assert manager.get_result(survivor, timeout=TIMEOUT).status == RequestStatus.FINISHED
    assert manager.stats().failed_steps == 1


def test_destroy_is_idempotent_final_and_restores_attention(model):
    manager = ContinuousBatchingManager(
        model, continuous_batching_config=ContinuousBatchingConfig(num_blocks=32)
    )
    manager.start()
    assert model.config._attn_implementation == "cbserve|sdpa"
    manager.destroy()
    manager.destroy()
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError, match="destroyed"):
        manager.start()


@pytest.mark.parametrize("implementation", ["flash_attention_2", "paged|flash_attention_3", "flex_attention"])
def test_a_model_loaded_with_flash_attention_is_served_and_gets_it_back(model, monkeypatch, implementation):
    """A training loop's model (often loaded with flash attention) is served through paged SDPA, with
    outputs equal to model.generate's, and has its own implementation back after destroy. flash-attn is
    not installed here, so the model's switches are recorded rather than loading it."""
    switches = []

    def set_attn_implementation(name):
        switches.append(name)
        model.config._attn_implementation = name

    monkeypatch.setattr(model, "set_attn_implementation", set_attn_implementation)
    model.config._attn_implementation = implementation
    prompt = random_prompt(12, seed=3)
    try:
        manager = init_continuous_batching(
            model, continuous_batching_config=ContinuousBatchingConfig(page_size=8, num_blocks=32)
        )
        manager.start()
        request_id = manager.add_request(prompt, max_new_tokens=6, eos_token_id=[])
        output = manager.get_result(request_id, timeout=TIMEOUT)
        manager.destroy()
        assert switches == ["cbserve|sdpa", implementation]
    finally:
        model.config._attn_implementation = "sdpa"
    assert output.generated_tokens == reference_greedy(model, prompt, 6)


def test_an_attention_implementation_the_engine_cannot_stand_in_for_is_refused_by_name(model, monkeypatch):
    monkeypatch.setattr(model.config, "_attn_implementation", "kernels-community/vllm-flash-attn3")
    manager = init_continuous_batching(
        model, continuous_batching_config=ContinuousBatchingConfig(num_blocks=32)
    )
    with pytest.raises(ValueError, match=r"'kernels-community/vllm-flash-attn3' is not supported.*'sdpa'"):
        manager.start()
    manager.destroy()


def test_timestamps_are_recorded_per_generated_token(manager):
    request_id = manager.add_request(
        random_prompt(4, seed=23), max_new_tokens=5, record_timestamps=True, eos_token_id=[]
    )
    output = manager.get_result(request_id, timeout=TIMEOUT)
    assert len(output.timestamps) == 5 and output.timestamps == sorted(output.timestamps)
    assert output.created_time <= output.scheduled_time <= output.first_token_time == output.timestamps[0]


def test_persistent_manager_is_reused_and_serves_prefix_hits_across_calls(model):
    config = ContinuousBatchingConfig(page_size=8, num_blocks=64)
    prompt = random_prompt(40, seed=24)
    try:
        generate_batch(
            model, [prompt], continuous_batching_config=config, max_new_tokens=2, persistent_manager=True
        )
        kept = model._cbserve_cached_manager
        outputs = generate_batch(model, [prompt], max_new_tokens=2, persistent_manager=True)
        assert model._cbserve_cached_manager is kept
        assert next(iter(outputs.values())).num_cached_tokens == 32
    finally:
        model._cbserve_cached_manager.destroy()


def test_generate_batch_progress_bar_counts_finished_requests(model, capsys):
    generate_batch(
        model,
        [random_prompt(4, seed=s) for s in range(3)],
        max_new_tokens=2,
        progress_bar=True,
        continuous_batching_config=ContinuousBatchingConfig(num_blocks=32),
    )
    assert "3/3" in capsys.readouterr().err


def test_steps_run_only_on_engine_threads_with_the_configured_thread_count(monkeypatch) -> None:
    """Warmup and the loop step on threads of their own, each with `num_threads` intra-op threads; the
    caller's thread never runs a step (its OpenMP team would slow the loop's on the CPU)."""
    import torch

    model = tiny_model("llama")
    callers_threads = torch.get_num_threads()
    config = ContinuousBatchingConfig(page_size=8, num_blocks=64, max_batch_tokens=64, num_threads=1)
    manager = ContinuousBatchingManager(model, continuous_batching_config=config)
    engine = engine_core(manager)
    seen: list[tuple[str, int]] = []
    original_step = engine.step

    def step():
        seen.append((threading.current_thread().name, torch.get_num_threads()))
        return original_step()

    monkeypatch.setattr(engine, "step", step)
    try:
        manager.warmup()
        manager.start()
        request_id = manager.add_request(random_prompt(5, 1), max_new_tokens=3)
        assert manager.get_result(request_id, timeout=60).status == RequestStatus.FINISHED
    finally:
        manager.destroy()
    names = {name for name, _ in seen}
    assert names == {"cbserve-warmup", "cbserve-engine"}, names
    assert {threads for _, threads in seen} == {1}
    assert torch.get_num_threads() == callers_threads


def test_building_warming_and_updating_a_stopped_engine_leave_the_callers_thread_without_an_openmp_team() -> (
    None
):
    """A torch op large enough to run in parallel gives the thread that runs it an OpenMP team for the
    thread's lifetime; with more OpenMP threads than cores libgomp stops spinning, and every step then
    waits for its workers to wake (SmolLM2 served 1.7x slower after the caller's thread had zeroed the
    cache's null block). Building, warmup and commands applied while the loop is stopped (here a weight
    update) run on threads that end, so the caller keeps no team."""
    import os

    import torch
    from transformers import AutoModelForCausalLM

    def num_os_threads() -> int:
        return len(os.listdir("/proc/self/task"))

    # Sizes past torch's grain for running an op in parallel (32,768 elements): the null block zeroed at
    # build (page_size slots of 2 KV heads x 16 dims) and the embedding an update copies (2,048 x 64).
    model_config = tiny_config("llama")
    model_config.vocab_size = 2048
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(model_config, attn_implementation="sdpa").eval()
    new_embedding = torch.randn_like(model.get_input_embeddings().weight)
    config = ContinuousBatchingConfig(page_size=2048, num_blocks=2, max_batch_tokens=64, num_threads=2)
    counts: dict[str, int] = {}

    def callers_thread() -> None:
        torch.set_num_threads(2)
        counts["before"] = num_os_threads()
        manager = ContinuousBatchingManager(model, continuous_batching_config=config)
        try:
            manager.warmup()
            manager.update_weights({"model.embed_tokens.weight": new_embedding})
            # Threads that ended take their teams with them, a moment later.
            deadline = time.monotonic() + 10
            while num_os_threads() > counts["before"] and time.monotonic() < deadline:
                time.sleep(0.05)
            counts["after"] = num_os_threads()
        finally:
            manager.destroy()

    thread = threading.Thread(target=callers_thread, name="callers-thread")
    thread.start()
    thread.join()
    assert torch.equal(model.get_input_embeddings().weight, new_embedding)
    assert counts["after"] <= counts["before"], counts
