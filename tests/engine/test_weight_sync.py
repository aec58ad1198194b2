"""Weights pushed by a trainer over a process group of its own, and sleep / wake (issue 15).

The trainer here is a thread of the test process holding rank 0 of a gloo group
(tests/helpers/update_group.py); the engine joins as rank 1. (The SDK's trainer
helper and `cbserve serve --tp 2` are tested through the service, tests/service/test_weight_sync_service.py.)
"""

from __future__ import annotations

import copy
import time

import psutil
import pytest
import torch

from engine import ContinuousBatchingConfig, ContinuousBatchingManager, RequestStatus
from engine.errors import WeightTransferError
from engine.runner import packed_linear
from tests.helpers.engine_runs import engine_core
from tests.helpers.models import random_prompt, seeded_tiny_llama, tiny_model
from tests.helpers.oracle import reference_greedy
from tests.helpers.update_group import Trainer, bucket_plan, join_group, push


@pytest.fixture
def manager():
    model = copy.deepcopy(tiny_model("llama"))
    config = ContinuousBatchingConfig(page_size=8, num_blocks=64, max_batch_tokens=64)
    running = ContinuousBatchingManager(model, continuous_batching_config=config)
    running.start()
    try:
        yield running
    finally:
        running.destroy()


def _generate(manager: ContinuousBatchingManager, prompt: list[int], n: int, timeout: float = 60):
    request_id = manager.add_request(prompt, max_new_tokens=n)
    return manager.get_result(request_id, timeout=timeout)


def test_pushed_weights_serve_the_new_model(manager: ContinuousBatchingManager) -> None:
    _assert_pushed_weights_serve_the_new_model(manager)


def test_pushed_weights_reach_layers_running_on_packed_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU, large linear layers run on copies of their weights packed for oneDNN
    (engine.runner.packed_linear), which a push must reach too. The tiny model's layers are below the
    size that is packed, so here every one is."""
    monkeypatch.setattr(packed_linear, "MIN_PACKED_WEIGHT_ELEMENTS", 0)
    model = copy.deepcopy(tiny_model("llama")).to("cpu")
    config = ContinuousBatchingConfig(page_size=8, num_blocks=64, max_batch_tokens=64)
    running = ContinuousBatchingManager(model, continuous_batching_config=config)
    running.start()
    try:
        assert "forward" in model.lm_head.__dict__, "the LM head should run on packed weights"
        _assert_pushed_weights_serve_the_new_model(running)
    finally:
        running.destroy()


def _assert_pushed_weights_serve_the_new_model(manager: ContinuousBatchingManager) -> None:
    trainer = Trainer()
    try:
        assert join_group(manager, trainer).ranks == (1,)
        assert manager.stats().weights_update_group_ranks == (1,)
        other = seeded_tiny_llama(321)
        state = other.state_dict()
        names = list(state)
        plan = bucket_plan(
            [[(name, state[name]) for name in names[:4]], [(name, state[name]) for name in names[4:]]]
        )
        assert push(manager, trainer, plan, state).result(timeout=30) == 2
        prompt = random_prompt(14, 3)
        output = _generate(manager, prompt, 8)
        expected = reference_greedy(other, prompt, 8)
        assert output.generated_tokens == expected, f"engine {output.generated_tokens} != generate {expected}"
        assert output.weight_version == 2
        assert manager.destroy_weights_update_group() is True
        assert manager.stats().weights_update_group_ranks == ()
    finally:
        trainer.shutdown()


def test_bad_announcement_is_refused_before_any_byte(manager: ContinuousBatchingManager) -> None:
    trainer = Trainer()
    try:
        join_group(manager, trainer)
        state = seeded_tiny_llama(5).state_dict()
        name = "model.layers.0.mlp.up_proj.weight"
        wrong = [
            ("model.embed_tokens.weight", state["model.embed_tokens.weight"]),
            (name, state[name].T.contiguous()),
        ]
        with pytest.raises(ValueError, match=r"up_proj\.weight.*shape"):
            manager.update_weights_from_distributed(bucket_plan([wrong]))
        with pytest.raises(ValueError, match=r"'no\.such\.weight'"):
            manager.update_weights_from_distributed(bucket_plan([[("no.such.weight", state[name])]]))
        # Nothing moved and nothing changed: same version, same outputs, still in the group.
        prompt = random_prompt(10, 4)
        assert manager.weight_version == 1
        assert _generate(manager, prompt, 5).generated_tokens == reference_greedy(
            tiny_model("llama"), prompt, 5
        )
        assert manager.stats().weights_update_group_ranks == (1,)
    finally:
        trainer.shutdown()


def test_trainer_lost_midway_holds_requests_until_a_complete_update(
    manager: ContinuousBatchingManager,
) -> None:
    trainer = Trainer(timeout_s=3.0)
    other = seeded_tiny_llama(77)
    state = other.state_dict()
    names = list(state)
    plan = bucket_plan([[(names[0], state[names[0]])], [(name, state[name]) for name in names[1:]]])
    try:
        join_group(manager, trainer)
        pending = push(manager, trainer, plan, state, buckets=[0])  # the trainer stalls after bucket 1
        started = time.monotonic()
        with pytest.raises(WeightTransferError, match="failed after writing some weights"):
            pending.result(timeout=30)
        assert time.monotonic() - started < 15
    finally:
        trainer.shutdown()
    stats = manager.stats()
    assert stats.weights_incomplete and "bucket 2 of 2" in stats.weights_incomplete
    assert not stats.serving and stats.weights_update_group_ranks == ()
    assert manager.weight_version == 1
    # A request waits rather than run on a mix of two versions.
    prompt = random_prompt(9, 8)
    request_id = manager.add_request(prompt, max_new_tokens=4)
    assert manager.get_result(request_id, timeout=1.0) is None
    # A complete update over a new group makes the weights whole; the waiting request then runs on them.
    trainer = Trainer()
    try:
        join_group(manager, trainer)
        assert push(manager, trainer, plan, state).result(timeout=30) == 2
    finally:
        trainer.shutdown()
    output = manager.get_result(request_id, timeout=60)
    assert output is not None and output.status == RequestStatus.FINISHED
    assert output.generated_tokens == reference_greedy(other, prompt, 4)
    assert manager.stats().serving


def test_failure_before_the_first_bucket_leaves_the_weights_unchanged(
    manager: ContinuousBatchingManager,
) -> None:
    trainer = Trainer(timeout_s=2.0)
    state = seeded_tiny_llama(9).state_dict()
    plan = bucket_plan([[(name, value) for name, value in state.items()]])
    try:
        join_group(manager, trainer)
        with pytest.raises(WeightTransferError, match="weights unchanged"):
            push(manager, trainer, plan, state, buckets=[]).result(timeout=30)
    finally:
        trainer.shutdown()
    assert manager.stats().weights_incomplete is None and manager.stats().serving
    prompt = random_prompt(11, 2)
    assert _generate(manager, prompt, 4).generated_tokens == reference_greedy(tiny_model("llama"), prompt, 4)


def test_join_fields_are_checked(manager: ContinuousBatchingManager) -> None:
    with pytest.raises(ValueError, match="rank_offset must be in"):
        manager.init_weights_update_group("127.0.0.1", 29500, 0, 2)
    with pytest.raises(ValueError, match="world_size must be at least"):
        manager.init_weights_update_group("127.0.0.1", 29500, 1, 1)
    with pytest.raises(ValueError, match="master_port must be in"):
        manager.init_weights_update_group("127.0.0.1", 70000, 1, 2)
    with pytest.raises(ValueError, match="backend must be one of"):
        manager.init_weights_update_group("127.0.0.1", 29500, 1, 2, backend="mpi")
    with pytest.raises(RuntimeError, match="not in a weight-update group"):
        manager.update_weights_from_distributed(bucket_plan([[("lm_head.weight", torch.zeros(256, 64))]]))


def _rss() -> int:
    return int(psutil.Process().memory_info().rss)


def test_sleep_frees_the_kv_cache_and_requests_resume_after_wake_up() -> None:
    model = copy.deepcopy(tiny_model("llama"))
    # A cache of 16384 blocks * 16 tokens * 512 bytes = 128 MiB: large beside what the process's other
    # threads allocate or free while the RSS is read.
    config = ContinuousBatchingConfig(page_size=16, num_blocks=16384, max_batch_tokens=128)
    manager = ContinuousBatchingManager(model, continuous_batching_config=config)
    manager.start()
    try:
        prompts = [random_prompt(20 + index, index) for index in range(4)]
        ids = [manager.add_request(prompt, max_new_tokens=24) for prompt in prompts]
        # Cache pages cost memory once written; a long-running server's cache has been written
        # everywhere, which writing it here stands for.
        with manager.pause():
            for cache in engine_core(manager).kv_caches:
                for tensor in (*cache.key_caches, *cache.value_caches):
                    tensor[16:].fill_(1.0)
        before = _rss()
        outcome = manager.sleep(level=1)
        after = _rss()
        assert outcome.released_bytes == 16384 * 16 * 512
        assert before - after >= 0.8 * outcome.released_bytes, f"RSS {before} -> {after}"
        assert outcome.resident_bytes_released is not None
        assert outcome.resident_bytes_released >= 0.8 * outcome.released_bytes, outcome
        stats = manager.stats()
        assert stats.sleep_level == 1 and not stats.serving
        assert manager.get_result(ids[0], timeout=0.5) is None  # requests wait while asleep
        assert manager.wake_up() == 0
        for request_id, prompt in zip(ids, prompts, strict=True):
            output = manager.get_result(request_id, timeout=60)
            while output is not None and not output.is_finished():
                output = manager.get_result(request_id, timeout=60)
            assert output is not None and output.status == RequestStatus.FINISHED
            expected = reference_greedy(tiny_model("llama"), prompt, 24)
            assert output.generated_tokens == expected, (
                f"engine {output.generated_tokens} != generate {expected}"
            )
    finally:
        manager.destroy()


def test_sleep_of_an_idle_server_reports_the_cache_memory_it_never_held() -> None:
    """A cache allocated and never written costs no resident memory: released_bytes is its size, and
    resident_bytes_released what the process gave back (the pages a request wrote, not 256 MiB). The
    cache owns its pages, so this holds whatever earlier tests left in the heap; with transparent huge
    pages each written page may stand for 2 MiB, hence a cache of 64 MiB tensors."""
    config = ContinuousBatchingConfig(page_size=16, num_blocks=32768, max_batch_tokens=128)
    manager = ContinuousBatchingManager(copy.deepcopy(tiny_model("llama")), continuous_batching_config=config)
    manager.start()
    try:
        _generate(manager, random_prompt(20, 1), 4)
        outcome = manager.sleep(level=1)
        assert outcome.released_bytes == 32768 * 16 * 512
        assert outcome.resident_bytes_released is not None
        assert outcome.resident_bytes_released < 0.25 * outcome.released_bytes, outcome
        assert manager.wake_up() == 0
    finally:
        manager.destroy()


def test_a_populated_cache_is_resident_from_the_start_and_again_after_a_wake_up() -> None:
    """populate_kv_cache backs every page from the start: an idle engine's sleep gives back (nearly) the
    whole cache, where a lazy one gives back only what requests wrote (the test above). A wake-up backs it
    again; the outputs still equal generate's, so backing the pages changed nothing they hold."""
    config = ContinuousBatchingConfig(
        page_size=16, num_blocks=32768, max_batch_tokens=128, populate_kv_cache=True
    )
    manager = ContinuousBatchingManager(copy.deepcopy(tiny_model("llama")), continuous_batching_config=config)
    manager.start()
    try:
        prompt = random_prompt(20, 1)
        expected = reference_greedy(tiny_model("llama"), prompt, 4)
        assert _generate(manager, prompt, 4).generated_tokens == expected
        for _ in range(2):
            caches = engine_core(manager).kv_caches
            assert all(cache.wait_populated(timeout=120) for cache in caches)
            outcome = manager.sleep(level=1)
            assert outcome.released_bytes == 32768 * 16 * 512
            assert outcome.resident_bytes_released is not None
            assert outcome.resident_bytes_released >= 0.8 * outcome.released_bytes, outcome
            assert manager.wake_up() == 0
            assert _generate(manager, prompt, 4).generated_tokens == expected
    finally:
        manager.destroy()


def test_weights_update_while_asleep_apply_after_wake_up(manager: ContinuousBatchingManager) -> None:
    manager.sleep(level=2, mode="wait")
    assert manager.stats().sleep_level == 2
    other = seeded_tiny_llama(44)
    assert manager.update_weights(other.state_dict()) == 2
    assert manager.wake_up(["weights"]) == 1
    assert manager.wake_up(["kv_cache"]) == 0
    prompt = random_prompt(13, 6)
    assert _generate(manager, prompt, 6).generated_tokens == reference_greedy(other, prompt, 6)


def test_sleep_abort_cancels_in_flight_requests(manager: ContinuousBatchingManager) -> None:
    request_id = manager.add_request(random_prompt(30, 1), max_new_tokens=200)
    outcome = manager.sleep(level=1, mode="abort")
    output = manager.get_result(request_id, timeout=10)
    while output is not None and not output.is_finished():
        output = manager.get_result(request_id, timeout=10)
    assert output is not None and output.status == RequestStatus.CANCELLED
    assert outcome.cancelled_requests == 1
    manager.wake_up()


def test_sleep_arguments_are_checked(manager: ContinuousBatchingManager) -> None:
    with pytest.raises(ValueError, match="level must be 1"):
        manager.sleep(level=3)
    with pytest.raises(ValueError, match="mode must be one of"):
        manager.sleep(level=1, mode="later")
    with pytest.raises(ValueError, match="tags: unknown tag 'gpu'"):
        manager.wake_up(["gpu"])
