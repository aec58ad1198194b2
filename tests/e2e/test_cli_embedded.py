"""The README's main commands, as a user runs them: `cbserve serve` on the embedded model, then
`cbserve generate "What is the capital of France?"` against it, and a question whose answer runs long."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
from cbserve_client import Client
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.ports import free_ports
from service.default_model import CHAT_MAX_NEW_TOKENS

STARTUP_TIMEOUT_S = 240
ANSWER_TIMEOUT_S = 120
# The embedded model's answer to it runs past CHAT_MAX_NEW_TOKENS (greedy, so always the same answer).
LONG_QUESTION = "Explain how photosynthesis works."


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


@dataclass
class EmbeddedServer:
    target: str
    environment: dict[str, str]


@pytest.fixture(scope="module")
def embedded_server(model_dir: str, cache_root: str) -> Iterator[EmbeddedServer]:
    """`cbserve serve` with no --model, SERVING; stopped by SIGINT (Ctrl-C), after which it exits 0."""
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
        yield EmbeddedServer(f"127.0.0.1:{port}", environment)
    finally:
        server.send_signal(signal.SIGINT)
        try:
            assert server.wait(timeout=60) == 0
        finally:
            if server.poll() is None:
                server.kill()


def generate(server: EmbeddedServer, *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "service", "generate", *args, "--target", server.target]
    return subprocess.run(
        command, env=server.environment, capture_output=True, text=True, timeout=ANSWER_TIMEOUT_S
    )


def test_cbserve_generate_answers_through_the_served_embedded_model(embedded_server: EmbeddedServer) -> None:
    answer = generate(embedded_server, "What is the capital of France?")
    assert answer.returncode == 0, answer.stderr
    assert answer.stdout.strip() == "The capital of France is Paris.", answer.stdout
    assert answer.stderr == "", "an answer that ended at its end of turn needs no notice"


def test_cbserve_generate_ends_the_output_before_a_stop_string(embedded_server: EmbeddedServer) -> None:
    # The same answer cut before a stop string, which the model's BPE tokens complete mid-token.
    stopped = generate(
        embedded_server, "What is the capital of France?", "--stop", "is Par", "--stop", "never said"
    )
    assert stopped.returncode == 0, stopped.stderr
    assert stopped.stdout == "The capital of France \n", repr(stopped.stdout)


def test_a_long_answer_runs_to_the_default_length_and_says_it_stopped_there(
    embedded_server: EmbeddedServer,
) -> None:
    answer = generate(embedded_server, LONG_QUESTION)
    assert answer.returncode == 0, answer.stderr
    assert answer.stderr == (
        f"cbserve: the answer stopped at --max-new-tokens {CHAT_MAX_NEW_TOKENS}; pass a larger "
        "--max-new-tokens for a longer answer\n"
    ), answer.stderr
    # About 4 characters a token: far past the 20 tokens of transformers' default length.
    assert len(answer.stdout) > 2 * CHAT_MAX_NEW_TOKENS, answer.stdout


def test_a_request_without_max_new_tokens_gets_the_embedded_models_chat_length(
    embedded_server: EmbeddedServer,
) -> None:
    with Client(embedded_server.target) as client:
        completion = client.generate([{"role": "user", "content": LONG_QUESTION}])
    assert completion.finish_reason == "length", completion.text
    assert len(completion.token_ids) == CHAT_MAX_NEW_TOKENS, (
        f"{len(completion.token_ids)} tokens, not the generation config's {CHAT_MAX_NEW_TOKENS}"
    )
