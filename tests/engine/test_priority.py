"""The "priority" scheduling policy through the manager: admission order by priority, ties first-come,
and outputs unchanged by the order they ran in."""

from __future__ import annotations

import pytest

from engine import ContinuousBatchingConfig, ContinuousBatchingManager, RequestStatus
from tests.helpers.models import random_prompt, tiny_model
from tests.helpers.oracle import reference_greedy


def test_requests_queued_together_run_in_priority_order() -> None:
    model = tiny_model("llama")
    config = ContinuousBatchingConfig(
        page_size=8, num_blocks=64, max_batch_tokens=64, max_requests_per_batch=1, scheduler_type="priority"
    )
    manager = ContinuousBatchingManager(model, continuous_batching_config=config)
    manager.start()
    try:
        priorities = {"background": 10, "interactive": -5, "normal": 0, "interactive-2": -5, "normal-2": 0}
        prompts = {name: random_prompt(6 + index, index) for index, name in enumerate(priorities)}
        with manager.pause():  # all queued before the first is admitted
            for name, priority in priorities.items():
                manager.add_request(prompts[name], request_id=name, max_new_tokens=3, priority=priority)
        outputs = {name: manager.get_result(name, timeout=60) for name in priorities}
    finally:
        manager.destroy()
    order = sorted(outputs, key=lambda name: outputs[name].scheduled_time)
    assert order == ["interactive", "interactive-2", "normal", "normal-2", "background"]
    for name, output in outputs.items():
        assert output.status == RequestStatus.FINISHED
        assert output.generated_tokens == reference_greedy(model, prompts[name], 3)


def test_priority_must_be_a_32_bit_int() -> None:
    manager = ContinuousBatchingManager(
        tiny_model("llama"), continuous_batching_config=ContinuousBatchingConfig()
    )
    try:
        for bad in (2**31, "high", 1.5):
            with pytest.raises(ValueError, match="priority must be an int"):
                manager.add_request([1, 2, 3], max_new_tokens=2, priority=bad)
    finally:
        manager.destroy()
