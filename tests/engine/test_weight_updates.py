"""ContinuousBatchingManager.update_weights and the pause modes (issue 7, weight updates)."""

from __future__ import annotations

import copy
import time

import pytest
import torch
from safetensors.torch import save_file

from engine import ContinuousBatchingConfig, ContinuousBatchingManager, RequestStatus
from tests.helpers.models import random_prompt, seeded_tiny_llama, tiny_model
from tests.helpers.oracle import reference_greedy


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def manager(request: pytest.FixtureRequest):
    """Updates and pauses with and without a step launched ahead (async batching): tokens of a step
    launched before an update carry the old version."""
    model = copy.deepcopy(tiny_model("llama"))
    config = ContinuousBatchingConfig(
        page_size=8, num_blocks=64, max_batch_tokens=64, use_async_batching=request.param
    )
    running = ContinuousBatchingManager(model, continuous_batching_config=config)
    running.start()
    try:
        yield running
    finally:
        running.destroy()


def _generate(manager: ContinuousBatchingManager, prompt: list[int], n: int):
    request_id = manager.add_request(prompt, max_new_tokens=n)
    output = manager.get_result(request_id, timeout=60)
    assert output is not None and output.status == RequestStatus.FINISHED
    return output


def test_update_changes_outputs_to_the_new_weights(manager: ContinuousBatchingManager) -> None:
    prompt = random_prompt(12, 1)
    before = _generate(manager, prompt, 6)
    assert before.weight_version == 1 and manager.weight_version == 1
    other = seeded_tiny_llama(123)
    assert manager.update_weights(other.state_dict(), version="step-1") == 2
    after = _generate(manager, prompt, 6)
    assert after.generated_tokens == reference_greedy(other, prompt, 6)
    assert after.generated_tokens != before.generated_tokens
    assert after.weight_version == 2
    stats = manager.stats()
    assert stats.weight_version == 2 and stats.weight_version_label == "step-1"
    assert manager.update_weights(dict(seeded_tiny_llama(7).named_parameters())) == 3


def test_bad_updates_change_nothing(manager: ContinuousBatchingManager, tmp_path) -> None:
    before = _snapshot(manager.model)
    good = seeded_tiny_llama(5).state_dict()
    unknown = dict(good, **{"model.nope.weight": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"model\.nope\.weight"):
        manager.update_weights(unknown)
    wrong_shape = dict(good)
    wrong_shape["model.norm.weight"] = torch.ones(3)
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*shape"):
        manager.update_weights(wrong_shape)
    wrong_dtype = dict(good)
    wrong_dtype["model.norm.weight"] = torch.ones_like(good["model.norm.weight"], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*dtype"):
        manager.update_weights(wrong_dtype)
    tensors = {name: value.clone() for name, value in good.items()}
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(5, 5)
    save_file(tensors, str(tmp_path / "bad.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj\.weight"):
        manager.update_weights(str(tmp_path / "bad.safetensors"))
    after = _snapshot(manager.model)
    assert all(torch.equal(before[name], after[name]) for name in before)
    assert manager.weight_version == 1


def test_safetensors_file_and_folder(manager: ContinuousBatchingManager, tmp_path) -> None:
    other = seeded_tiny_llama(11)
    tensors = {name: value.clone() for name, value in other.state_dict().items()}
    names = sorted(tensors)
    save_file({name: tensors[name].half() for name in names[::2]}, str(tmp_path / "a.safetensors"))
    save_file({name: tensors[name] for name in names[1::2]}, str(tmp_path / "b.safetensors"))
    assert manager.update_weights(str(tmp_path)) == 2
    prompt = random_prompt(9, 3)
    expected_model = copy.deepcopy(other)
    with torch.no_grad():
        for name in names[::2]:
            expected_model.get_parameter(name).copy_(tensors[name].half().float())
    assert _generate(manager, prompt, 5).generated_tokens == reference_greedy(expected_model, prompt, 5)
    save_file(tensors, str(tmp_path / "one.safetensors"))
    assert manager.update_weights(str(tmp_path / "one.safetensors")) == 3
    assert _generate(manager, prompt, 5).generated_tokens == reference_greedy(other, prompt, 5)


def test_in_flight_request_continues_with_new_weights(manager: ContinuousBatchingManager) -> None:
    prompt = random_prompt(10, 2)
    new_weights = seeded_tiny_llama(9).state_dict()
    request_id = manager.add_request(prompt, max_new_tokens=120, streaming=True, eos_token_id=[])
    # In flight: it has generated a token. (A pause taken before the loop first schedules it holds it
    # queued, with nothing generated yet.) 120 tokens outlast the moment the pause takes to hold.
    first = manager.get_result(request_id, timeout=60)
    assert first is not None and first.weight_version == 1
    with manager.pause():
        manager.update_weights(new_weights)
    outputs = [first, *manager.request_id_iter(request_id)]
    last = outputs[-1]
    assert last.status == RequestStatus.FINISHED and len(last.generated_tokens) == 120
    assert last.weight_version == 2
    assert [output.weight_version for output in outputs] == sorted(
        output.weight_version for output in outputs
    )


def test_prefix_cache_is_reset(manager: ContinuousBatchingManager) -> None:
    prompt = random_prompt(40, 4)
    _generate(manager, prompt, 2)
    assert _generate(manager, prompt, 2).num_cached_tokens > 0
    manager.update_weights(seeded_tiny_llama(3).state_dict())
    assert _generate(manager, prompt, 2).num_cached_tokens == 0


def test_update_joins_a_held_pause(manager: ContinuousBatchingManager) -> None:
    with manager.pause():
        assert manager.update_weights(seeded_tiny_llama(2).state_dict()) == 2
    assert _generate(manager, random_prompt(5, 5), 2).weight_version == 2


def test_wait_mode_finishes_in_flight_and_holds_new(manager: ContinuousBatchingManager) -> None:
    running_id = manager.add_request(random_prompt(8, 6), max_new_tokens=30, streaming=True)
    assert manager.get_result(running_id, timeout=60) is not None
    with manager.pause("wait"):
        outputs = []
        while (output := manager.get_result(running_id, timeout=0.2)) is not None:
            outputs.append(output)
        assert outputs and outputs[-1].status == RequestStatus.FINISHED
        assert len(outputs[-1].generated_tokens) == 30
        queued_id = manager.add_request(random_prompt(8, 7), max_new_tokens=3)
        time.sleep(0.3)
        assert manager.get_result(queued_id, timeout=0.1) is None
    assert manager.get_result(queued_id, timeout=60).status == RequestStatus.FINISHED


def test_abort_mode_cancels_in_flight(manager: ContinuousBatchingManager) -> None:
    running_id = manager.add_request(random_prompt(8, 8), max_new_tokens=200, streaming=True)
    assert manager.get_result(running_id, timeout=60) is not None
    with manager.pause("abort") as handle:
        assert handle.cancelled == 1
        outputs = list(manager.request_id_iter(running_id))
        assert outputs[-1].status == RequestStatus.CANCELLED
    assert _generate(manager, random_prompt(5, 9), 2).status == RequestStatus.FINISHED


def _new_weights_logprobs(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The logprob `model` gives each of `tokens` after `prompt` and the tokens before it."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits.float(), dim=-1).gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1)


def test_a_request_that_asks_recomputes_its_kv_under_the_new_weights(
    manager: ContinuousBatchingManager,
) -> None:
    """Two requests with one prompt live through an update under a KEEP pause. The one with
    kv_on_weight_update="recompute" gives, for each token after the update, the logprob the new weights
    give it after the whole text so far; the kept one goes on from the old weights' KV, and its logprobs
    are not the new weights' (the control that shows the option is what makes the difference)."""
    prompt = random_prompt(20, 11)
    new_model = seeded_tiny_llama(9)
    ids = {
        policy: manager.add_request(
            prompt,
            max_new_tokens=60,
            streaming=True,
            eos_token_id=[],
            logprobs=True,
            kv_on_weight_update=policy,
        )
        for policy in ("keep", "recompute")
    }
    firsts = {policy: manager.get_result(request_id, timeout=60) for policy, request_id in ids.items()}
    with manager.pause():
        manager.update_weights(new_model.state_dict())
    for policy, request_id in ids.items():
        outputs = [firsts[policy], *manager.request_id_iter(request_id)]
        last = outputs[-1]
        assert last.status == RequestStatus.FINISHED and len(last.generated_tokens) == 60
        num_old = max(len(output.generated_tokens) for output in outputs if output.weight_version == 1)
        assert 0 < num_old < 60, (policy, num_old)
        after = last.generated_tokens[num_old:]
        expected = _new_weights_logprobs(new_model, prompt + last.generated_tokens[:num_old], after)
        got = torch.tensor(last.logprobs[num_old:])
        difference = (got - expected).abs().max().item()
        if policy == "recompute":
            assert difference < 1e-4, (policy, got.tolist(), expected.tolist())
        else:
            assert difference > 1e-2, (policy, got.tolist(), expected.tolist())


def test_a_bad_kv_on_weight_update_is_refused_by_name(manager: ContinuousBatchingManager) -> None:
    with pytest.raises(ValueError, match=r"kv_on_weight_update must be one of \['keep', 'recompute'\]"):
        manager.add_request(random_prompt(4, 1), max_new_tokens=2, kv_on_weight_update="drop")
