"""A real cbserve server on loopback, run in a background thread with its own event loop."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import torch
from cbserve_client import AdminClient
from opentelemetry.sdk.trace import TracerProvider

from engine import ContinuousBatchingConfig
from service.engine_host import EngineHost
from service.server import CbserveServer, ServerOptions
from service.tls import ServerTls

T = TypeVar("T")
ADMIN_TOKEN = "s3cret-admin-token"
CALL_TIMEOUT_S = 60.0


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
    Prometheus endpoint at `metrics_url`.
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

    def close(self) -> None:
        try:
            self.call(self.server.shutdown())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(CALL_TIMEOUT_S)
            self.loop.close()


def free_port() -> int:
    """A TCP port free on loopback now (for servers whose port 0 means "off")."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


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
