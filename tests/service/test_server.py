"""The servers around the engine: health, reflection, port separation, graceful SIGTERM."""

from __future__ import annotations

import grpc
import pytest
import torch
from cbserve_client import AdminClient, Client
from cbserve_client.proto import admin_pb2, admin_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests.helpers.servers import (
    ADMIN_TOKEN,
    NOT_SERVING,
    SERVING,
    RunningServer,
    ServerProcess,
    health_status,
    wait_until,
)


def _services(target: str) -> set[str]:
    with grpc.insecure_channel(target) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        response = next(stub.ServerReflectionInfo(iter([request]), timeout=5))
    return {service.name for service in response.list_services_response.service}


def test_health_goes_serving_after_load_and_not_serving_on_stop(model: torch.nn.Module) -> None:
    running = RunningServer(model)
    try:
        assert health_status(running.target) == NOT_SERVING  # ports open, model not loaded yet
        running.load()
        assert health_status(running.target) == SERVING
        with AdminClient(running.admin_target, token=ADMIN_TOKEN) as admin:
            admin.stop()
            wait_until(lambda: health_status(running.target) == NOT_SERVING, what="NOT_SERVING after stop")
            admin.start()
            wait_until(lambda: health_status(running.target) == SERVING, what="SERVING after start")
    finally:
        running.close()


def test_reflection_lists_the_services_of_each_port(served: RunningServer) -> None:
    assert {"cbserve.v1.GenerationService", "grpc.health.v1.Health"} <= _services(served.target)
    assert "cbserve.v1.AdminService" not in _services(served.target)
    assert "cbserve.v1.AdminService" in _services(served.admin_target)


def test_admin_rpcs_are_absent_from_the_main_port(served: RunningServer) -> None:
    with grpc.insecure_channel(served.target) as channel, pytest.raises(grpc.RpcError) as caught:
        admin_pb2_grpc.AdminServiceStub(channel).GetStatus(
            admin_pb2.GetStatusRequest(), metadata=[("authorization", f"Bearer {ADMIN_TOKEN}")], timeout=5
        )
    assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_sigterm_lets_in_flight_requests_finish_then_exits_0(model: torch.nn.Module, tmp_path) -> None:
    model.save_pretrained(tmp_path / "model")
    server = ServerProcess(
        tmp_path / "model", tmp_path / "server.log", "--num-blocks", "64", "--page-size", "16"
    )
    try:
        server.wait_serving(timeout=60)
        with Client(server.target) as client:
            tokens: list[int] = []
            with client.stream([5, 6, 7], max_new_tokens=200, ignore_eos=True) as stream:
                for chunk in stream:
                    if not tokens and chunk.token_ids:  # in flight: now ask the server to stop
                        server.terminate()
                    tokens.extend(chunk.token_ids)
                    if chunk.finished:
                        break
            assert len(tokens) == 200 and chunk.finish_reason == "length"
        assert server.process.wait(timeout=30) == 0
    finally:
        server.close()
