"""AdminFleet: a trainer pauses every replica and pushes weights to all of them, through real servers."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import grpc
import pytest
from cbserve_client import AdminClient, AdminFleet, FleetError, UnavailableError, replica_targets

from tests.helpers.models import tiny_model
from tests.helpers.servers import ADMIN_TOKEN, ByteTokenizer, RunningServer, wait_until

# Two replicas of different models, so that one tensor name exists on one replica only.
FAMILIES = ("llama", "qwen3")
ONLY_ON_QWEN3 = "model.layers.0.self_attn.q_norm.weight"


@pytest.fixture(scope="module")
def replicas() -> Iterator[list[RunningServer]]:
    servers = [RunningServer(tiny_model(family), tokenizer=ByteTokenizer()) for family in FAMILIES]
    try:
        for server in servers:
            server.load()
        yield servers
    finally:
        for server in servers:
            server.close()


@pytest.fixture
def fleet(replicas: list[RunningServer]) -> Iterator[AdminFleet]:
    with AdminFleet([server.admin_target for server in replicas], token=ADMIN_TOKEN, timeout=30) as connected:
        yield connected


def _unchanged_weights(family: str, name: str) -> dict[str, object]:
    """The tensor's current value: an update that bumps the version without changing any output (the
    tiny models are shared by the whole test session)."""
    return {name: dict(tiny_model(family).named_parameters())[name].detach().clone()}


def test_the_final_norm_is_the_same_on_both_replicas() -> None:
    """What the update test below relies on: pushing one replica's final norm leaves the other's as it was."""
    llama, qwen3 = (_unchanged_weights(family, "model.norm.weight") for family in FAMILIES)
    assert (llama["model.norm.weight"] == qwen3["model.norm.weight"]).all()  # type: ignore[union-attr]


def test_replica_targets_lists_one_address_per_resolved_address() -> None:
    assert replica_targets("127.0.0.1:50052") == ["127.0.0.1:50052"]
    assert replica_targets("[::1]:50052") == ["[::1]:50052"]
    assert "127.0.0.1:7" in replica_targets("localhost:7")
    with pytest.raises(ValueError, match="host:port"):
        replica_targets("cbserve-admin")
    with pytest.raises(UnavailableError, match="does not resolve"):
        replica_targets("no-such-host.invalid:50052")


def test_resolve_opens_a_client_per_address(replicas: list[RunningServer]) -> None:
    port = replicas[0].admin_target.rpartition(":")[2]
    with AdminFleet.resolve(f"127.0.0.1:{port}", token=ADMIN_TOKEN) as fleet:
        assert fleet.targets == [f"127.0.0.1:{port}"]
        assert fleet.status()[0].running


def test_paused_holds_every_replica_and_releases_them_all(
    fleet: AdminFleet, replicas: list[RunningServer]
) -> None:
    with fleet.paused() as infos:
        assert len(infos) == len(replicas)
        assert all(status.paused for status in fleet.status())
    # A hold ends when the server sees its stream cancelled, a moment after the block exits.
    wait_until(lambda: not any(status.paused for status in fleet.status()), timeout=10, what="all resumed")


def test_update_weights_reaches_every_replica(fleet: AdminFleet) -> None:
    versions = [status.weight_version for status in fleet.status()]
    name = "model.norm.weight"
    with fleet.paused():
        updates = fleet.update_weights(_unchanged_weights("llama", name), version="step-1")
    assert [update.weight_version for update in updates] == [version + 1 for version in versions]
    assert all(update.version_label == "step-1" for update in updates)


def test_a_replica_that_rejects_an_update_is_named_and_the_others_results_kept(
    fleet: AdminFleet, replicas: list[RunningServer]
) -> None:
    llama, qwen3 = (server.admin_target for server in replicas)
    with pytest.raises(FleetError) as caught:
        fleet.update_weights(_unchanged_weights("qwen3", ONLY_ON_QWEN3))
    error = caught.value
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert list(error.failures) == [llama] and ONLY_ON_QWEN3 in error.failures[llama].details
    assert list(error.results) == [qwen3] and error.results[qwen3].tensors_updated == 1
    assert f"1 of 2 replicas failed: {llama}" in str(error)


def test_a_replica_that_cannot_be_paused_releases_the_holds_already_taken(
    replicas: list[RunningServer],
) -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        unreachable = f"127.0.0.1:{probe.getsockname()[1]}"
    reachable = replicas[0].admin_target
    fleet = AdminFleet([reachable, unreachable], token=ADMIN_TOKEN, timeout=10)
    try:
        with pytest.raises(FleetError) as caught, fleet.paused(timeout=10):
            pytest.fail("the block must not run with a replica unpaused")
        assert list(caught.value.failures) == [unreachable]
        assert caught.value.code == grpc.StatusCode.UNAVAILABLE
        # Asked while the fleet's channels are still open: closing them would release any hold anyway.
        with AdminClient(reachable, token=ADMIN_TOKEN) as admin:
            wait_until(lambda: not admin.status().paused, timeout=10, what="the reachable replica resumed")
    finally:
        fleet.close()
