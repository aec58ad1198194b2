"""The Admin service: bearer-token auth, pause held by an open call, status, stop and start."""

from __future__ import annotations

import signal
import time

import grpc
import pytest
from cbserve_client import AdminClient, Client, UnauthenticatedError, UnavailableError
from cbserve_client.proto import admin_pb2, admin_pb2_grpc

from tests.helpers.models import random_prompt, tiny_model
from tests.helpers.servers import ADMIN_TOKEN, RunningServer, spawn_pause_holder, wait_until


@pytest.mark.parametrize("token", [None, "wrong-token"])
def test_admin_without_the_right_token_is_unauthenticated(served: RunningServer, token: str | None) -> None:
    with AdminClient(served.admin_target, token=token) as admin, pytest.raises(UnauthenticatedError):
        admin.status()


def test_no_token_configured_refuses_every_admin_call(model) -> None:
    running = RunningServer(model, admin_token=None)
    try:
        with (
            AdminClient(running.admin_target, token="anything") as admin,
            pytest.raises(UnauthenticatedError),
        ):
            admin.status()
    finally:
        running.close()


def test_pause_stops_tokens_while_held_and_nests(client: Client, admin: AdminClient) -> None:
    request_id = client.submit(random_prompt(20, 11), max_new_tokens=900, ignore_eos=True)
    next(chunk for chunk in client.results(request_id) if chunk.token_ids)
    with admin.paused() as outer:
        assert outer.paused
        with admin.paused() as inner:
            assert inner.holders == 2
        assert admin.status().pause_holders == 1
        before = _status_generated(client, request_id)
        time.sleep(0.3)
        assert _status_generated(client, request_id) == before
        assert admin.status().paused
    wait_until(lambda: _status_generated(client, request_id) > before, what="tokens after the resume")
    client.cancel(request_id)


def _status_generated(client: Client, request_id: str) -> int:
    chunk = next(iter(client.results(request_id, from_index=10**6)))
    assert chunk.usage is not None
    return chunk.usage.generated_tokens


def test_a_cancelled_pause_call_releases_the_pause(served: RunningServer, admin: AdminClient) -> None:
    with grpc.insecure_channel(served.admin_target) as channel:
        call = admin_pb2_grpc.AdminServiceStub(channel).Pause(
            admin_pb2.PauseRequest(), metadata=[("authorization", f"Bearer {ADMIN_TOKEN}")]
        )
        assert next(call).paused
        assert admin.status().paused
        call.cancel()  # what a crashed caller's broken connection amounts to
    wait_until(lambda: not admin.status().paused, what="the pause released")


def test_pause_lease_expires(served: RunningServer, admin: AdminClient) -> None:
    with grpc.insecure_channel(served.admin_target) as channel:
        messages = list(
            admin_pb2_grpc.AdminServiceStub(channel).Pause(
                admin_pb2.PauseRequest(lease_s=0.2), metadata=[("authorization", f"Bearer {ADMIN_TOKEN}")]
            )
        )
    assert [message.paused for message in messages] == [True, False]
    wait_until(lambda: not admin.status().paused, what="the pause released")


def test_stop_then_start(model) -> None:
    running = RunningServer(model)
    try:
        running.load()
        with Client(running.target) as client, AdminClient(running.admin_target, token=ADMIN_TOKEN) as admin:
            assert client.generate([5, 6], max_new_tokens=2).token_ids
            result = admin.stop()
            assert not admin.status().running
            with pytest.raises(UnavailableError):
                client.submit([5, 6], max_new_tokens=2, timeout=2)
            assert admin.stop().already_stopped and not result.already_stopped
            assert admin.start() is True
            assert client.generate([5, 6], max_new_tokens=2).finish_reason in ("length", "eos")
    finally:
        running.close()


def test_a_pause_holder_killed_with_sigkill_releases_the_pause(
    served: RunningServer, client: Client, admin: AdminClient
) -> None:
    holder = spawn_pause_holder(served.admin_target)
    try:
        assert admin.status().paused
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=10)
        wait_until(lambda: not admin.status().paused, what="the pause to end after its holder died")
        completion = client.generate(random_prompt(8, 12), max_new_tokens=4, ignore_eos=True)
        assert len(completion.token_ids) == 4
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(timeout=10)


@pytest.mark.parametrize(("family", "enabled"), [("llama", True), ("mistral", False)])
def test_status_says_whether_prefix_caching_is_on(family: str, enabled: bool) -> None:
    running = RunningServer(tiny_model(family))
    try:
        running.load()
        with AdminClient(running.admin_target, token=ADMIN_TOKEN) as admin:
            assert admin.status().prefix_caching_enabled is enabled
    finally:
        running.close()
