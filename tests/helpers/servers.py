"""Real cbserve servers on loopback (in-process, or `cbserve serve` in a subprocess), and the probes and
pause holders the tests aim at them."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import grpc
import torch
from cbserve_client import AdminClient
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider

from bench.ports import free_ports
from engine import ContinuousBatchingConfig
from service.engine_host import EngineHost
from service.server import CbserveServer, ServerOptions
from service.tls import ServerTls

T = TypeVar("T")
ADMIN_TOKEN = "s3cret-admin-token"
CALL_TIMEOUT_S = 60.0
REPO_ROOT = Path(__file__).resolve().parents[2]
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class ByteTokenizer:
    """A tokenizer whose tokens are UTF-8 bytes (the tiny models' vocab is 256), so text prompts and text
    deltas can be checked, including characters split across tokens."""

    chat_template: str | None = None

    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": list(text.encode())}

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(token_ids).decode("utf-8", errors="replace")


def engine_config_for_tests(**overrides: Any) -> ContinuousBatchingConfig:
    values: dict[str, Any] = dict(page_size=16, num_blocks=64, max_batch_tokens=256)
    values.update(overrides)
    return ContinuousBatchingConfig(**values)


class RunningServer:
    """Starts the server on free ports; `close()` shuts it down and frees the engine.

    `tls` makes both ports TLS (or mutual TLS); `tracer_provider` receives the request spans (without
    one, the server builds its own, exporting to `otlp_endpoint` if given); `metrics_port` serves the
    Prometheus endpoint at `metrics_url`; `control_port` (0: a free one) the HTTP control routes at
    `control_url`.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        tokenizer: Any | None = None,
        admin_token: str | None = ADMIN_TOKEN,
        config: ContinuousBatchingConfig | None = None,
        max_pause_lease_s: float = 300.0,
        grace_period_s: float = 10.0,
        tls: ServerTls | None = None,
        tracer_provider: TracerProvider | None = None,
        otlp_endpoint: str | None = None,
        metrics_port: int | None = None,
        control_port: int | None = None,
    ) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="cbserve-test-server", daemon=True)
        self._thread.start()
        options = ServerOptions(
            port=0,
            admin_port=0,
            admin_token=admin_token,
            max_pause_lease_s=max_pause_lease_s,
            grace_period_s=grace_period_s,
            tls=tls,
            otlp_endpoint=otlp_endpoint,
            metrics_port=metrics_port,
            control_port=control_port,
        )
        self.server: CbserveServer = self.call(self._open(options, tracer_provider))
        self._model = model
        self._tokenizer = tokenizer
        self._config = config or engine_config_for_tests()

    async def _open(self, options: ServerOptions, tracer_provider: TracerProvider | None) -> CbserveServer:
        server = CbserveServer(options, tracer_provider)
        await server.start()
        return server

    def load(self) -> EngineHost:
        return self.call(
            self.server.load(
                lambda: EngineHost(self._model, self._tokenizer, self._config, model_name="tiny")
            )
        )

    def call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(CALL_TIMEOUT_S)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.server.metrics_port}/metrics"

    @property
    def admin_target(self) -> str:
        return f"127.0.0.1:{self.server.admin_port}"

    @property
    def control_url(self) -> str:
        return f"http://127.0.0.1:{self.server.control_port}"

    def close(self) -> None:
        try:
            self.call(self.server.shutdown())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(CALL_TIMEOUT_S)
            self.loop.close()


def loaded_server(model: torch.nn.Module, **options: Any) -> RunningServer:
    """A `RunningServer(model, **options)` with its engine loaded; closed again if loading fails."""
    running = RunningServer(model, **options)
    try:
        running.load()
    except BaseException:
        running.close()
        raise
    return running


def wait_until(condition: Callable[[], bool], timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def wait_all_blocks_free(admin: AdminClient) -> None:
    """Every request has ended and released its KV blocks (prefix-cached blocks count as free)."""
    wait_until(
        lambda: (status := admin.status()).kv_blocks_used == 0 and status.active_requests == 0,
        what="all KV blocks free",
    )


def health_status(target: str) -> int:
    """The server's overall grpc.health.v1 status (SERVING, NOT_SERVING, ...)."""
    with grpc.insecure_channel(target) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def probe_health(target: str) -> int | None:
    """`health_status`, or None while nothing answers on `target`."""
    try:
        return health_status(target)
    except grpc.RpcError:
        return None


class ServerProcess:
    """`cbserve serve` in a subprocess on free loopback ports, serving the model saved in `model_dir`.

    In float32 unless `extra_args` name a `--dtype`: `auto` is bfloat16 on CPUs with AMX, whose outputs
    depend on the batch's shape, and tests compare outputs exactly. Its log goes to `log_path`
    (`log_tail()` shows it when a test fails). `close()` kills it if it still runs; always call it, e.g.
    in a `finally`.
    """

    def __init__(
        self, model_dir: str | Path, log_path: str | Path, *extra_args: str, admin_token: str = ADMIN_TOKEN
    ) -> None:
        self.port, self.admin_port = free_ports(2)
        command = [sys.executable, "-m", "service", "serve", "--model", str(model_dir)]
        command += ["--port", str(self.port), "--admin-port", str(self.admin_port), *extra_args]
        if "--dtype" not in extra_args:
            command += ["--dtype", "float32"]
        self.log_path = Path(log_path)
        environment = {**os.environ, "CBSERVE_ADMIN_TOKEN": admin_token}
        with open(self.log_path, "wb") as log:  # the child keeps its own handle
            self.process = subprocess.Popen(
                command, cwd=REPO_ROOT, env=environment, stdout=subprocess.DEVNULL, stderr=log
            )

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def admin_target(self) -> str:
        return f"127.0.0.1:{self.admin_port}"

    def wait_serving(self, timeout: float = 120.0) -> None:
        def serving() -> bool:
            if self.process.poll() is not None:
                raise AssertionError(f"the server exited with {self.process.returncode}:\n{self.log_tail()}")
            return probe_health(self.target) == SERVING

        wait_until(serving, timeout=timeout, what="the subprocess server SERVING")

    def terminate(self) -> None:
        """SIGTERM: the server drains in-flight requests, then exits."""
        self.process.send_signal(signal.SIGTERM)

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=CALL_TIMEOUT_S)


@contextlib.contextmanager
def serving_replicas(
    model_dir: str | Path, log_dir: Path, count: int, *extra_args: str, timeout: float = 120.0
) -> Iterator[list[ServerProcess]]:
    """`count` `cbserve serve` replicas of `model_dir`, all SERVING; every one is stopped on the way out."""
    replicas: list[ServerProcess] = []
    try:
        for index in range(count):
            replicas.append(ServerProcess(model_dir, log_dir / f"replica{index}.log", *extra_args))
        for replica in replicas:
            replica.wait_serving(timeout=timeout)
        yield replicas
    finally:
        for replica in replicas:
            replica.close()


def spawn_pause_holder(admin_target: str, token: str = ADMIN_TOKEN) -> subprocess.Popen[str]:
    """A subprocess that holds the engine paused (AdminClient.paused) until it is killed.

    Returns once the pause is held; the caller must kill the process (by its pid) and wait for it.
    """
    script = (
        "import time\n"
        "from cbserve_client import AdminClient\n"
        f"admin = AdminClient({admin_target!r}, token={token!r})\n"
        "with admin.paused():\n"
        "    print('paused', flush=True)\n"
        "    time.sleep(600)\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None
    line = holder.stdout.readline().strip()
    if line != "paused":
        holder.kill()
        holder.wait(timeout=CALL_TIMEOUT_S)
        raise AssertionError(f"the pause holder did not pause: it printed {line!r}")
    return holder
