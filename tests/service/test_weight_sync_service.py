"""Weight sync the way RL frameworks do it, through real processes: this test process is the trainer
(rank 0 of a gloo weight-update group, through the SDK's WeightSyncGroup), `cbserve serve` the server,
with two tensor-parallel ranks or as two replicas sharing one broadcast (issue 15)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cbserve_client import (
    AdminClient,
    AdminFleet,
    Client,
    InvalidArgumentError,
    UnavailableError,
    WeightSyncGroup,
    push_and_verify,
    weights_checksum,
)

from tests.helpers.models import random_prompt, seeded_tiny_llama
from tests.helpers.oracle import reference_greedy
from tests.helpers.servers import (
    ADMIN_TOKEN,
    NOT_SERVING,
    SERVING,
    ServerProcess,
    probe_health,
    serving_replicas,
    wait_until,
)

ENGINE_FLAGS = ("--num-blocks", "64", "--page-size", "16")
MAX_NEW_TOKENS = 10
GROUP_TIMEOUT_S = 30.0


@pytest.fixture()
def model_dir(tmp_path: Path) -> Path:
    seeded_tiny_llama(0).save_pretrained(tmp_path / "model")
    return tmp_path / "model"


def _assert_serves(target: str, model: torch.nn.Module, seeds: tuple[int, ...] = (1, 2)) -> None:
    with Client(target) as client:
        for seed in seeds:
            prompt = random_prompt(8 + 5 * seed, seed)
            got = client.generate(prompt, max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True).token_ids
            want = reference_greedy(model, prompt, MAX_NEW_TOKENS)
            assert got == want, f"server after the push: {got}\nmodel.generate: {want}"


def test_push_over_the_group_to_two_tensor_parallel_ranks(model_dir: Path, tmp_path: Path) -> None:
    server = ServerProcess(model_dir, tmp_path / "server.log", "--tp", "2", *ENGINE_FLAGS)
    try:
        server.wait_serving(timeout=180)
        with AdminClient(server.admin_target, token=ADMIN_TOKEN) as admin:
            assert admin.status().tensor_parallel_size == 2
            with WeightSyncGroup.create(
                admin, master_address="127.0.0.1", backend="gloo", group_timeout_s=GROUP_TIMEOUT_S
            ) as group:
                assert group.server_ranks == [(1, 2)] and group.world_size == 3
                assert admin.status().weights_update_group_ranks == (1, 2)
                trained = seeded_tiny_llama(7)
                (update,) = group.push(trained.state_dict(), version="step-1", bucket_bytes=64 << 10)
                assert update.weight_version == 2
                _assert_serves(server.target, trained)

                # A refused announcement moves no byte and changes nothing; the group stays usable.
                wrong = {"model.layers.0.mlp.up_proj.weight": torch.zeros(3, 3)}
                with pytest.raises(InvalidArgumentError, match=r"up_proj\.weight"):
                    group.push(wrong, version="bad")
                assert admin.status().weight_version == 2
                _assert_serves(server.target, trained)
                again = seeded_tiny_llama(8)
                assert group.push(again.state_dict(), version="step-2")[0].weight_version == 3
                _assert_serves(server.target, again, seeds=(3,))
            assert admin.status().weights_update_group_ranks == ()

            # Sleep frees the KV cache on both ranks; the server refuses work until it wakes.
            slept = admin.sleep(level=1)
            assert slept.released_bytes > 0
            assert admin.status().sleep_level == 1
            wait_until(lambda: probe_health(server.target) == NOT_SERVING, what="NOT_SERVING while asleep")
            with Client(server.target) as client, pytest.raises(UnavailableError, match="asleep"):
                client.generate([5, 6, 7], max_new_tokens=2)
            assert admin.wake_up() == 0
            wait_until(lambda: probe_health(server.target) == SERVING, what="SERVING after wake_up")
            _assert_serves(server.target, again, seeds=(4,))
    finally:
        server.close()


def test_one_broadcast_updates_two_replicas(model_dir: Path, tmp_path: Path) -> None:
    with serving_replicas(model_dir, tmp_path, 2, *ENGINE_FLAGS) as replicas:
        targets = [replica.admin_target for replica in replicas]
        with AdminFleet(targets, token=ADMIN_TOKEN) as fleet:
            with WeightSyncGroup.create(
                fleet, master_address="127.0.0.1", backend="gloo", group_timeout_s=GROUP_TIMEOUT_S
            ) as group:
                assert group.server_ranks == [(1,), (2,)]
                trained = seeded_tiny_llama(11)
                updates = group.push(trained.state_dict(), version="step-1")
                assert [update.weight_version for update in updates] == [2, 2]
                # The trainer's one call: the broadcast, then every replica's digest against its own.
                report = push_and_verify(
                    fleet, seeded_tiny_llama(12).state_dict(), version="step-2", group=group
                )
                assert report.weight_versions == dict.fromkeys(targets, 3)
                assert report.checksum.digest == weights_checksum(seeded_tiny_llama(12).state_dict()).digest
                updates = group.push(trained.state_dict(), version="step-3")
            for replica in replicas:
                _assert_serves(replica.target, trained)
