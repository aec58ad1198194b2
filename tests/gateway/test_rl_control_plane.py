"""The gateway's RL control plane over cbserve: `smg launch --enable-rl` with two `cbserve serve` replicas
registered with their control URL (`POST /workers` with the `rl.control_url` label and the admin token as
their `api_key`), driven through SMG's own client (`smg.rl`) as a trainer drives a vLLM fleet."""

from __future__ import annotations

import json
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from cbserve_client import AdminClient, Client
from smg.rl import RL, paused

from bench.ports import free_ports
from tests.helpers.control import announcement, control_call, tensor_bytes
from tests.helpers.gateway import Gateway
from tests.helpers.models import random_prompt
from tests.helpers.servers import ADMIN_TOKEN, ServerProcess, wait_until
from tests.helpers.update_group import Trainer

SELECTOR = "engine=vllm"


class ControlledReplica(ServerProcess):
    """`cbserve serve` with its HTTP control port on a free loopback port."""

    def __init__(self, model_dir: str, log_path: Path) -> None:
        (self.control_port,) = free_ports(1)
        super().__init__(model_dir, log_path, "--control-port", str(self.control_port))

    @property
    def control_url(self) -> str:
        return f"http://127.0.0.1:{self.control_port}"


def _post_json(url: str, body: dict[str, Any], method: str = "POST") -> tuple[int, Any]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), method=method, headers={"content-type": "application/json"}
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(request, timeout=30) as response:
        return response.status, json.loads(response.read())


@pytest.fixture(scope="module")
def replicas(
    tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[ControlledReplica]]:
    logs = tmp_path_factory.mktemp("rl-replica-logs")
    started: list[ControlledReplica] = []
    try:
        for index in range(2):
            started.append(ControlledReplica(tiny_model_dir, logs / f"replica{index}.log"))
        for replica in started:
            replica.wait_serving()
        yield started
    finally:
        for replica in started:
            replica.close()


@pytest.fixture(scope="module")
def gateway(replicas: list[ControlledReplica], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """The gateway with no worker on its command line: each replica is registered through its API (IGW
    mode, in which a worker registered later gets the router of its protocol, gRPC here)."""
    running = Gateway(
        [], Path(tmp_path_factory.mktemp("rl-gateway-logs")) / "smg.log", "--enable-rl", "--enable-igw"
    )
    try:
        running.num_workers = len(replicas)
        for replica in replicas:
            spec = {"url": f"grpc://{replica.target}", "api_key": ADMIN_TOKEN}
            spec["labels"] = {"rl.control_url": replica.control_url}
            wait_until(
                lambda spec=spec: _registers(running, spec), timeout=60, what="the gateway accepting workers"
            )
        running.wait_ready()
        yield running
    finally:
        running.stop()


def _registers(gateway: Gateway, spec: dict[str, Any]) -> bool:
    try:
        status, _ = _post_json(f"{gateway.base_url}/workers", spec)
    except OSError:  # not listening yet
        return False
    return status == 202


@pytest.fixture(scope="module")
def rl(gateway: Gateway) -> RL:
    client = RL(gateway.base_url, timeout=120)
    wait_until(
        lambda: len([worker for worker in client.workers() if worker.control_url]) == 2,
        timeout=60,
        what="both workers listed with their control URL",
    )
    return client


def _statuses(replicas: list[ControlledReplica]) -> list[Any]:
    statuses = []
    for replica in replicas:
        with AdminClient(replica.admin_target, token=ADMIN_TOKEN, timeout=30) as admin:
            statuses.append(admin.status())
    return statuses


def _bodies(result: Any) -> list[Any]:
    assert not result.failed and result.succeeded == 2, result
    return [call.body for call in result.results.values()]


def test_a_pause_fanned_out_keeps_requests_and_a_push_reaches_both_replicas(
    rl: RL, replicas: list[ControlledReplica], gateway: Gateway
) -> None:
    with Client(replicas[0].target, timeout=60) as client:
        request_id = client.submit(random_prompt(16, 1), max_new_tokens=500, ignore_eos=True)
        next(chunk for chunk in client.results(request_id) if chunk.token_ids)
        with paused(rl, SELECTOR, mode="keep") as pause:
            assert [call.body for call in pause.results.values()] == [{"status": "paused"}] * 2
            assert [status.paused for status in _statuses(replicas)] == [True, True]
            assert (
                _bodies(rl.fanout("is_paused", selector=SELECTOR, method="GET")) == [{"is_paused": True}] * 2
            )
            kept = _statuses(replicas)[0]
            assert kept.active_requests + kept.queued_requests == 1, "keep: the request waits, not aborted"
            _push_through_the_control_routes(rl, replicas)
        assert [status.paused for status in _statuses(replicas)] == [False, False]
        assert _bodies(rl.fanout("is_paused", selector=SELECTOR, method="GET")) == [{"is_paused": False}] * 2
        client.cancel(request_id)
    openai_client = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="unused", timeout=120)
    model_id = openai_client.models.list().data[0].id
    completion = openai_client.completions.create(model=model_id, prompt="Hello", max_tokens=4)
    assert completion.choices[0].text, completion


def _push_through_the_control_routes(rl: RL, replicas: list[ControlledReplica]) -> None:
    """Both replicas join one group (each its own rank, so one call each), then one fan-out of
    `/update_weights` receives one broadcast per tensor on both, and the version label is fanned out."""
    trainer = Trainer(world_size=3, timeout_s=60)
    workers = {worker.control_url: worker.id for worker in rl.workers()}
    joins = []
    for rank, replica in enumerate(replicas, start=1):
        init_info = {"master_address": "127.0.0.1", "master_port": trainer.port, "rank_offset": rank}
        init_info |= {"world_size": 3, "backend": "gloo"}
        worker_id = workers[replica.control_url]
        body = {"init_info": init_info}
        joins.append(threading.Thread(target=rl.call, args=(worker_id, "init_weight_transfer_engine", body)))
    try:
        for join in joins:
            join.start()
        trainer.form()
        for join in joins:
            join.join(60)
        new = {"model.norm.weight": torch.full((64,), 0.5), "lm_head.weight": torch.randn(49152, 64) * 0.02}
        before = [status.weight_version for status in _statuses(replicas)]
        outcome: dict[str, Any] = {}
        push = threading.Thread(
            target=lambda: outcome.setdefault(
                "update", rl.fanout("update_weights", {"update_info": announcement(new)}, selector=SELECTOR)
            )
        )
        push.start()
        for tensor in new.values():
            trainer.broadcast(tensor_bytes(tensor))
        push.join(120)
        assert _bodies(outcome["update"]) == [{"message": "Weights updated"}] * 2
        labelled = rl.fanout("update_weight_version", {"new_version": "step-1"}, selector=SELECTOR)
        assert _bodies(labelled) == [{"success": True, "new_version": "step-1"}] * 2
        info = _bodies(rl.fanout("weight_info", selector=SELECTOR, method="GET"))
        assert info == [
            {"weight_version": "step-1", "weight_version_number": version + 1} for version in before
        ]
        assert [status.weight_version for status in _statuses(replicas)] == [
            version + 1 for version in before
        ]
    finally:
        for replica in replicas:
            with AdminClient(replica.admin_target, token=ADMIN_TOKEN, timeout=30) as admin:
                admin.destroy_weights_update_group()
        trainer.shutdown()


def test_a_control_call_without_the_token_is_refused(
    rl: RL, replicas: list[ControlledReplica], gateway: Gateway
) -> None:
    status, reply = control_call(replicas[0].control_url, "POST", "/pause_generation", {}, token=None)
    assert status == 401 and "admin token missing" in reply["error"], reply
    worker_id = next(worker.id for worker in rl.workers() if worker.control_url == replicas[0].control_url)
    _post_json(f"{gateway.base_url}/workers/{worker_id}", {"api_key": "wrong-token"}, method="PATCH")
    try:
        wait_until(
            lambda: (
                rl.fanout("is_paused", selector=SELECTOR, method="GET", allow_partial=True).succeeded == 1
            ),
            timeout=30,
            what="the gateway calling with the wrong key",
        )
        result = rl.fanout("pause_generation", {"mode": "keep"}, selector=SELECTOR, allow_partial=True)
        refused = [(failure.worker_id, failure.status) for failure in result.failed]
        assert refused == [(worker_id, 401)], result
    finally:
        _post_json(f"{gateway.base_url}/workers/{worker_id}", {"api_key": ADMIN_TOKEN}, method="PATCH")
        rl.fanout("continue_generation", {}, selector=SELECTOR, allow_partial=True)
    assert [status.paused for status in _statuses(replicas)] == [False, False]
