"""Admin.UpdateWeights through the Python SDK against a live server (issue 7, weight updates)."""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterator

import pytest
import torch
from cbserve_client import AdminClient, Client, WeightsUpdate
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from tests.helpers.models import random_prompt, tiny_config, tiny_model
from tests.helpers.oracle import reference_greedy
from tests.helpers.servers import ADMIN_TOKEN, ByteTokenizer, RunningServer


def _other_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(
        tiny_config("llama"), attn_implementation="sdpa", dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def own_model() -> torch.nn.Module:
    """The served model itself: updates write into its tensors in place."""
    return copy.deepcopy(tiny_model("llama"))


@pytest.fixture(scope="module")
def own_served(own_model: torch.nn.Module) -> Iterator[RunningServer]:
    running = RunningServer(own_model, tokenizer=ByteTokenizer())
    try:
        running.load()
        yield running
    finally:
        running.close()


def test_update_weights_streamed_and_from_safetensors(own_served: RunningServer, tmp_path) -> None:
    prompt = random_prompt(10, 21)
    with (
        Client(own_served.target, timeout=30) as client,
        AdminClient(own_served.admin_target, token=ADMIN_TOKEN, timeout=30) as admin,
    ):
        start = admin.status().weight_version
        first = client.generate(prompt, max_new_tokens=5)
        assert first.weight_version == start
        other = _other_model(31)
        result = admin.update_weights(other.state_dict(), version="step-1")
        assert result.weight_version == start + 1 and result.tensors_updated == len(other.state_dict())
        assert admin.status().weight_version == start + 1
        assert client.model_info().weight_version == start + 1
        second = client.generate(prompt, max_new_tokens=5)
        assert list(second.token_ids) == reference_greedy(other, prompt, 5)
        assert second.weight_version == start + 1

        third_model = _other_model(41)
        save_file(
            {k: v.clone() for k, v in third_model.state_dict().items()}, str(tmp_path / "w.safetensors")
        )
        result = admin.update_weights(str(tmp_path / "w.safetensors"))
        assert result.weight_version == start + 2
        third = client.generate(prompt, max_new_tokens=5)
        assert list(third.token_ids) == reference_greedy(third_model, prompt, 5)
        assert third.weight_version == start + 2


def test_corrupted_update_is_rejected_and_changes_nothing(own_served: RunningServer) -> None:
    import grpc
    from cbserve_client import _weights
    from cbserve_client.proto import admin_pb2_grpc

    prompt = random_prompt(10, 22)
    other = _other_model(51)
    with (
        Client(own_served.target, timeout=30) as client,
        AdminClient(own_served.admin_target, token=ADMIN_TOKEN, timeout=30) as admin,
    ):
        version = admin.status().weight_version
        before = list(client.generate(prompt, max_new_tokens=5).token_ids)
        messages = list(_weights.update_weights_requests(other.state_dict()))
        bad = messages[3]
        bad.chunk.data = bytes([bad.chunk.data[0] ^ 1]) + bad.chunk.data[1:]
        with grpc.insecure_channel(own_served.admin_target) as channel:
            stub = admin_pb2_grpc.AdminServiceStub(channel)
            with pytest.raises(grpc.RpcError) as caught:
                stub.UpdateWeights(
                    iter(messages), metadata=[("authorization", f"Bearer {ADMIN_TOKEN}")], timeout=30
                )
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert bad.chunk.name in caught.value.details() and "sha256" in caught.value.details()
        wrong = {"model.norm.weight": torch.ones(3)}
        with pytest.raises(Exception) as caught_sdk:
            admin.update_weights(wrong)
        assert "model.norm.weight" in str(caught_sdk.value)
        assert admin.status().weight_version == version
        assert list(client.generate(prompt, max_new_tokens=5).token_ids) == before


def test_concurrent_updates_are_applied_one_after_the_other(
    own_served: RunningServer, own_model: torch.nn.Module
) -> None:
    pushed = {"seed-61": _other_model(61).state_dict(), "seed-71": _other_model(71).state_dict()}
    results: dict[str, WeightsUpdate] = {}
    failures: list[BaseException] = []
    both_ready = threading.Barrier(len(pushed))
    with AdminClient(own_served.admin_target, token=ADMIN_TOKEN, timeout=30) as admin:
        start = admin.status().weight_version

        def push(label: str) -> None:
            try:
                both_ready.wait(timeout=30)
                results[label] = admin.update_weights(pushed[label], version=label, timeout=60)
            except BaseException as exc:
                failures.append(exc)

        threads = [threading.Thread(target=push, args=(label,)) for label in pushed]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert not failures, f"an update failed: {failures!r}"
        assert {label: result.version_label for label, result in results.items()} == {
            label: label for label in pushed
        }
        assert sorted(result.weight_version for result in results.values()) == [start + 1, start + 2], (
            f"versions {[r.weight_version for r in results.values()]} from start {start}"
        )
        assert admin.status().weight_version == start + 2

    last = max(results, key=lambda label: results[label].weight_version)
    served = own_model.state_dict()
    mismatched = [name for name, value in pushed[last].items() if not torch.equal(served[name], value)]
    assert not mismatched, f"served tensors that differ from the last update ({last}): {mismatched}"


def test_kv_on_weight_update_through_the_sdk(own_served: RunningServer) -> None:
    """Two streams of one prompt live through an UpdateWeights. Each chunk says which weights made its
    tokens; after the update, the stream that asked for kv_on_weight_update="recompute" gets exactly the
    logprobs the new weights give the text so far, the kept one does not (its KV is the old weights')."""
    prompt = random_prompt(20, 23)
    new_model = _other_model(53)
    with (
        Client(own_served.target, timeout=60) as client,
        AdminClient(own_served.admin_target, token=ADMIN_TOKEN, timeout=60) as admin,
    ):
        start = admin.status().weight_version
        streams = {
            policy: client.stream(
                prompt, max_new_tokens=60, ignore_eos=True, logprobs=True, kv_on_weight_update=policy
            )
            for policy in ("keep", "recompute")
        }
        chunks = {policy: [next(iter(stream))] for policy, stream in streams.items()}
        assert all(chunk[0].weight_version == start for chunk in chunks.values())
        admin.update_weights(new_model.state_dict())
        for policy, stream in streams.items():
            chunks[policy].extend(stream)
    for policy, received in chunks.items():
        tokens = [token for chunk in received for token in chunk.token_ids]
        logprobs = [entry.logprob for chunk in received for entry in chunk.logprobs]
        num_old = sum(len(chunk.token_ids) for chunk in received if chunk.weight_version == start)
        assert len(tokens) == 60 and 0 < num_old < 60, (policy, num_old)
        assert {chunk.weight_version for chunk in received[-1:]} == {start + 1}
        with torch.no_grad():
            logits = new_model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
        expected = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1)
        difference = (torch.tensor(logprobs[num_old:]) - expected[num_old:]).abs().max().item()
        if policy == "recompute":
            assert difference < 1e-4, (policy, logprobs[num_old:], expected[num_old:].tolist())
        else:
            assert difference > 1e-2, (policy, logprobs[num_old:], expected[num_old:].tolist())
