"""The HTTP control port (vLLM's admin routes, `cbserve serve --control-port`) against a live server: each
route does the operation, and the gRPC Admin GetStatus sees its effect; the token, unknown routes and bad
input are refused with 401, 404 and 400."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch
from cbserve_client import AdminClient, Client

from tests.helpers.control import announcement, control_call, tensor_bytes
from tests.helpers.models import fresh_tiny_model, random_prompt
from tests.helpers.servers import ADMIN_TOKEN, ByteTokenizer, RunningServer, wait_until
from tests.helpers.update_group import Trainer

ROUTES = {
    "/pause": "POST",
    "/pause_generation": "POST",
    "/resume": "POST",
    "/continue_generation": "POST",
    "/is_paused": "GET",
    "/sleep": "POST",
    "/wake_up": "POST",
    "/is_sleeping": "GET",
    "/reset_prefix_cache": "POST",
    "/init_weight_transfer_engine": "POST",
    "/update_weights": "POST",
    "/update_weight_version": "POST",
    "/weight_info": "GET",
    "/server_info": "GET",
    "/version": "GET",
}


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    # Its own model: the weight tests write into it.
    return fresh_tiny_model("llama")


@pytest.fixture(scope="module")
def served(model: torch.nn.Module) -> Iterator[RunningServer]:
    running = RunningServer(model, tokenizer=ByteTokenizer(), control_port=0)
    try:
        running.load()
        yield running
    finally:
        running.close()


@pytest.fixture
def url(served: RunningServer) -> str:
    return served.control_url


def _decoding(client: Client, seed: int) -> str:
    """A long request, once it has its first token."""
    request_id = client.submit(random_prompt(20, seed), max_new_tokens=900, ignore_eos=True)
    next(chunk for chunk in client.results(request_id) if chunk.token_ids)
    return request_id


def _generated(client: Client, request_id: str) -> int:
    chunk = next(iter(client.results(request_id, from_index=10**6)))
    assert chunk.usage is not None
    return chunk.usage.generated_tokens


@pytest.mark.parametrize("token", [None, "wrong-token"])
def test_every_route_refuses_a_call_without_the_right_token(url: str, admin: AdminClient, token) -> None:
    for path, method in ROUTES.items():
        status, reply = control_call(url, method, path, {}, token=token)
        assert status == 401, f"{method} {path} answered {status} {reply}"
        assert "admin token" in reply["error"]
    status = admin.status()
    assert (status.paused, status.sleep_level) == (False, 0)


def test_an_unknown_route_is_404_listing_the_routes(url: str) -> None:
    status, reply = control_call(url, "POST", "/pause_everything")
    assert status == 404
    assert reply["routes"] == [f"{ROUTES[path]} {path}" for path in sorted(ROUTES)], reply


def test_a_route_called_with_another_method_is_405(url: str) -> None:
    status, reply = control_call(url, "GET", "/pause")
    assert status == 405 and "POST" in reply["error"], reply


def test_pause_keep_holds_the_requests_in_flight_until_resume(
    url: str, client: Client, admin: AdminClient
) -> None:
    request_id = _decoding(client, seed=3)
    assert control_call(url, "POST", "/pause?mode=keep") == (200, {"status": "paused"})
    try:
        status = admin.status()
        assert (status.paused, status.pause_holders) == (True, 1)
        assert control_call(url, "GET", "/is_paused") == (200, {"is_paused": True})
        before = _generated(client, request_id)
        time.sleep(0.3)
        assert _generated(client, request_id) == before
    finally:
        assert control_call(url, "POST", "/resume") == (200, {"status": "resumed"})
    status = admin.status()
    assert (status.paused, status.pause_holders) == (False, 0)
    assert control_call(url, "GET", "/is_paused") == (200, {"is_paused": False})
    wait_until(lambda: _generated(client, request_id) > before, what="tokens after /resume")
    client.cancel(request_id)


def test_pause_generation_takes_its_mode_from_the_body_as_the_gateways_client_sends_it(
    url: str, client: Client, admin: AdminClient
) -> None:
    request_id = _decoding(client, seed=4)
    assert control_call(url, "POST", "/pause_generation", {"mode": "keep"}) == (200, {"status": "paused"})
    assert admin.status().paused
    assert admin.status().active_requests + admin.status().queued_requests == 1  # kept, not aborted
    assert control_call(url, "POST", "/continue_generation", {}) == (200, {"status": "resumed"})
    assert not admin.status().paused
    client.cancel(request_id)


def test_pause_in_its_default_mode_aborts_the_requests_in_flight(
    url: str, client: Client, admin: AdminClient
) -> None:
    request_id = _decoding(client, seed=5)
    assert control_call(url, "POST", "/pause") == (200, {"status": "paused"})
    try:
        assert admin.status().paused
        last = list(client.results(request_id))[-1]
        assert last.finish_reason == "cancelled", last
    finally:
        control_call(url, "POST", "/resume")


@pytest.mark.parametrize(
    ("path", "body", "field", "bound"),
    [
        ("/pause?mode=later", None, "mode", "abort, wait, keep"),
        ("/pause_generation", {"mode": "in_place"}, "mode", "abort, wait, keep"),
        ("/pause_generation", b"{not json", "body", "malformed JSON"),
        ("/pause?clear_cache=maybe", None, "clear_cache", "true or false"),
        ("/sleep?level=3", None, "level", "[1, 2]"),
        ("/sleep?level=one", None, "level", "not an integer"),
        ("/wake_up?tags=everything", None, "tags", "weights, kv_cache"),
        ("/update_weight_version", {"new_version": 7}, "new_version", "non-empty string"),
        ("/init_weight_transfer_engine", {"init_info": {"packed": True}}, "init_info.packed", "master_port"),
        ("/update_weights", {"update_info": {"names": ["x"]}}, "update_info.dtype_names", "a list"),
    ],
)
def test_bad_input_is_400_naming_the_field_and_changes_nothing(
    url: str, admin: AdminClient, path: str, body, field: str, bound: str
) -> None:
    status, reply = control_call(url, "POST", path, body)
    assert status == 400, reply
    assert reply["field"] == field and bound in reply["error"], reply
    status_after = admin.status()
    assert (status_after.paused, status_after.sleep_level, status_after.pause_holders) == (False, 0, 0)


def test_sleep_and_wake_up(url: str, admin: AdminClient) -> None:
    assert control_call(url, "POST", "/sleep?level=1") == (200, {"status": "sleeping", "level": 1})
    assert admin.status().sleep_level == 1
    assert control_call(url, "GET", "/is_sleeping") == (200, {"is_sleeping": True})
    assert control_call(url, "POST", "/wake_up?tags=weights") == (
        200,
        {"status": "sleeping", "tags": ["weights"]},
    )
    assert control_call(url, "POST", "/wake_up") == (200, {"status": "awake", "tags": None})
    assert admin.status().sleep_level == 0
    assert control_call(url, "GET", "/is_sleeping") == (200, {"is_sleeping": False})


def test_reset_prefix_cache_drops_the_cached_prompt(url: str, client: Client, admin: AdminClient) -> None:
    prompt = random_prompt(64, 6)

    def hits_of_one_more_run() -> int:
        before = admin.status().prefix_cache_hits
        client.generate(prompt, max_new_tokens=1)
        return admin.status().prefix_cache_hits - before

    hits_of_one_more_run()
    assert hits_of_one_more_run() > 0, "the control: a second run of the prompt hits the cache"
    assert control_call(url, "POST", "/reset_prefix_cache") == (200, {"success": True})
    assert hits_of_one_more_run() == 0


def test_reset_prefix_cache_with_a_request_in_flight_is_not_a_success(url: str, client: Client) -> None:
    request_id = _decoding(client, seed=7)
    try:
        assert control_call(url, "POST", "/reset_prefix_cache") == (200, {"success": False})
        status, reply = control_call(url, "POST", "/reset_prefix_cache?reset_running_requests=true")
        assert status == 400 and reply["field"] == "reset_running_requests", reply
    finally:
        client.cancel(request_id)


def test_update_weight_version_labels_the_weights_and_keeps_their_number(
    url: str, admin: AdminClient
) -> None:
    number = admin.status().weight_version
    reply = control_call(url, "POST", "/update_weight_version", {"new_version": "step-7"})
    assert reply == (200, {"success": True, "new_version": "step-7"})
    assert control_call(url, "GET", "/weight_info") == (
        200,
        {"weight_version": "step-7", "weight_version_number": number},
    )
    assert admin.status().weight_version == number


def test_a_push_over_the_group_through_the_control_routes_replaces_the_weights(
    url: str, admin: AdminClient, model: torch.nn.Module
) -> None:
    trainer = Trainer(world_size=2)
    init_info = {"master_address": "127.0.0.1", "master_port": trainer.port, "rank_offset": 1}
    init_info |= {"world_size": 2, "backend": "gloo", "timeout_s": 30}
    replies: dict[str, tuple[int, object]] = {}
    joining = threading.Thread(
        target=lambda: replies.setdefault(
            "init", control_call(url, "POST", "/init_weight_transfer_engine", {"init_info": init_info})
        )
    )
    joining.start()
    trainer.form()
    joining.join(60)
    assert replies["init"] == (200, {"message": "Weight transfer initialized"})
    assert admin.status().weights_update_group_ranks == (1,)
    state = model.state_dict()
    new = {name: torch.randn_like(state[name]) for name in ("model.norm.weight", "lm_head.weight")}
    number = admin.status().weight_version
    try:
        pushing = threading.Thread(
            target=lambda: replies.setdefault(
                "update", control_call(url, "POST", "/update_weights", {"update_info": announcement(new)})
            )
        )
        pushing.start()
        for tensor in new.values():
            trainer.broadcast(tensor_bytes(tensor))
        pushing.join(60)
        assert replies["update"] == (200, {"message": "Weights updated"})
        assert admin.status().weight_version == number + 1
        for name, tensor in new.items():
            assert torch.equal(model.state_dict()[name], tensor), name
    finally:
        admin.destroy_weights_update_group()
        trainer.shutdown()


def test_server_info_and_version(url: str) -> None:
    status, reply = control_call(url, "GET", "/server_info")
    assert status == 200 and isinstance(reply["vllm_config"], str), reply
    assert all("TOKEN" not in name for name in reply["vllm_env"]), reply["vllm_env"]
    status, reply = control_call(url, "GET", "/server_info?config_format=json")
    assert status == 200 and reply["vllm_config"]["page_size"] == 16, reply
    status, reply = control_call(url, "GET", "/version")
    assert status == 200 and "version" in reply, reply


def test_the_control_port_is_off_unless_asked_for(admin: AdminClient) -> None:
    running = RunningServer(torch.nn.Linear(1, 1), admin_token=ADMIN_TOKEN)
    try:
        assert running.server.control_port is None
    finally:
        running.close()
