"""The real SMG gateway (PyPI `smg`) in front of `cbserve serve` replicas, for the gateway tests.

Each gateway runs in its own process group (the `smg` launcher starts the Rust router as a child), so
`close()` stops both, even when a test fails.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from tests.service.service_harness import REPO_ROOT, free_port, wait_until

GATEWAY_READY_TIMEOUT_S = 60.0


def save_tiny_model_with_tokenizer(folder: Path, tokenizer_source: str) -> str:
    """A tiny random Llama (fixed seed) that speaks the tokenizer of `tokenizer_source` (its vocabulary,
    EOS and chat template), saved to `folder`: fast to serve, with a real tokenizer for the gateway."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_source)
    eos_token_id = tokenizer.eos_token_id
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,  # tied, the random model only ever repeats one token
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = eos_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def get_json(url: str) -> Any:
    """The JSON body of GET `url`; raises OSError (urllib's HTTPError among them) on failure."""
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


class Gateway:
    """`smg launch --backend vllm` routing over `worker_targets` with `policy`, on free loopback ports."""

    def __init__(
        self, worker_targets: Sequence[str], log_path: Path, policy: str = "cache_aware", *extra: str
    ) -> None:
        self.port, self.metrics_port = free_port(), free_port()
        command = ["smg", "launch", "--backend", "vllm", "--policy", policy]
        command += ["--worker-urls", *(f"grpc://{target}" for target in worker_targets)]
        command += ["--host", "127.0.0.1", "--port", str(self.port)]
        command += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.metrics_port)]
        # Workers started just before are registered within a second rather than on the 30 s default.
        command += ["--worker-startup-check-interval", "1", "--log-level", "info", *extra]
        self.log_path = log_path
        with open(log_path, "wb") as log:
            self.process = subprocess.Popen(
                command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.num_workers = len(worker_targets)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self) -> None:
        def ready() -> bool:
            if self.process.poll() is not None:
                raise AssertionError(f"the gateway exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                readiness = get_json(f"{self.base_url}/readiness")
            except (OSError, ValueError):  # not listening yet, or not ready (an HTTP error status)
                return False
            return readiness.get("healthy_workers") == self.num_workers

        wait_until(ready, timeout=GATEWAY_READY_TIMEOUT_S, what="the gateway ready with every worker")

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Every sample of the gateway's Prometheus endpoint: (name, sorted labels) -> value."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as response:
            text = response.read().decode()
        samples = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
        return samples

    def metric(self, name: str, **labels: str) -> float:
        """The sum of `name` over the samples whose labels include `labels`."""
        return sum(
            value
            for (sample_name, sample_labels), value in self.metrics().items()
            if sample_name == name and set(labels.items()) <= set(sample_labels)
        )

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def close(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)
        # The router child may outlive the launcher for a moment.
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                os.killpg(self.process.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)
        os.killpg(self.process.pid, signal.SIGKILL)
