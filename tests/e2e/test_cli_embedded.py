"""The README's main commands, as a user runs them: `cbserve serve` on the embedded model, then
`cbserve generate "What is the capital of France?"` against it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.ports import free_ports

STARTUP_TIMEOUT_S = 240


def _wait_serving(target: str, server: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    with grpc.insecure_channel(target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            assert server.poll() is None, (
                f"cbserve serve exited early:\n{server.stdout.read() if server.stdout else ''}"
            )
            try:
                response = health.Check(health_pb2.HealthCheckRequest(), timeout=2)
                if response.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.5)
    raise AssertionError(f"cbserve serve was not SERVING after {STARTUP_TIMEOUT_S} s")


def test_cbserve_generate_answers_through_the_served_embedded_model(model_dir: str, cache_root: str) -> None:
    port, admin_port = free_ports(2)
    environment = {**os.environ, "CBSERVE_CACHE_DIR": cache_root}
    server = subprocess.Popen(
        [sys.executable, "-m", "service", "serve", "--port", str(port), "--admin-port", str(admin_port)],
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        _wait_serving(f"127.0.0.1:{port}", server)
        command = [
            sys.executable,
            "-m",
            "service",
            "generate",
            "What is the capital of France?",
            "--target",
            f"127.0.0.1:{port}",
        ]
        answer = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=120)
        assert answer.returncode == 0, answer.stderr
        assert answer.stdout.strip() == "The capital of France is Paris.", answer.stdout
        # The same answer cut before a stop string, which the model's BPE tokens complete mid-token.
        stopped = subprocess.run(
            [*command, "--stop", "is Par", "--stop", "never said"],
            env=environment,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert stopped.returncode == 0, stopped.stderr
        assert stopped.stdout == "The capital of France \n", repr(stopped.stdout)
    finally:
        server.send_signal(signal.SIGINT)
        try:
            assert server.wait(timeout=60) == 0
        finally:
            if server.poll() is None:
                server.kill()
