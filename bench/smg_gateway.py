"""The Shepherd Model Gateway (PyPI `smg`) as a subprocess in front of `cbserve serve` replicas, for the
serving benchmark and the gateway tests.

The launcher runs the Rust router as a child, so the gateway starts in a session of its own and `stop()`
signals the whole process group: neither outlives its caller, even when a run fails.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from bench.ports import free_ports

READY_TIMEOUT_S = 120.0


def http_get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    """(status, body) of GET `url`, an HTTP error status included; loopback never goes through a proxy."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


class SmgGateway:
    """`smg launch --backend vllm` routing over `worker_targets` ("host:port" of cbserve's generation
    port) with `policy`, on free loopback ports; `extra_args` go to `smg launch` as they are."""

    def __init__(
        self,
        worker_targets: Sequence[str],
        log_path: Path,
        *extra_args: str,
        policy: str = "cache_aware",
        log_level: str = "info",
    ) -> None:
        self.port, self.metrics_port = free_ports(2)
        self.log_path = log_path
        self.num_workers = len(worker_targets)
        launcher = shutil.which("smg")
        command = [*([launcher] if launcher else [sys.executable, "-m", "smg"]), "launch"]
        command += ["--backend", "vllm", "--policy", policy]
        command += ["--worker-urls", *(f"grpc://{target}" for target in worker_targets)]
        command += ["--host", "127.0.0.1", "--port", str(self.port)]
        command += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.metrics_port)]
        # Workers started just before are registered within a second rather than on the 30 s default.
        command += ["--worker-startup-check-interval", "1", "--log-level", log_level, *extra_args]
        with open(log_path, "wb") as log:
            self.process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> str:
        """Waits until every worker is healthy and a model is listed; returns the served model's id."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the gateway exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                status, body = http_get(f"{self.base_url}/readiness")
                if status == 200 and json.loads(body).get("healthy_workers") == self.num_workers:
                    status, body = http_get(f"{self.base_url}/v1/models")
                    models = json.loads(body)["data"] if status == 200 else []
                    if models:
                        return str(models[0]["id"])
            except (OSError, ValueError, KeyError):  # not listening yet, or an answer not ready to read
                pass
            time.sleep(0.1)
        raise RuntimeError(
            f"the gateway was not ready with {self.num_workers} workers in time:\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        """SIGTERM to the whole process group, then SIGKILL to what is left of it after 30 s."""
        group = self.process.pid
        for sig, grace in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(group, sig)
            except ProcessLookupError:
                return
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline:
                self.process.poll()  # reap the launcher, or its zombie keeps the group alive
                try:
                    os.killpg(group, 0)
                except ProcessLookupError:
                    return
                time.sleep(0.1)
