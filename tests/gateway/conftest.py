"""Two `cbserve serve` replicas behind the real SMG gateway, shared by a module's tests, always stopped."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

import engine
from service.default_model import ensure_default_model
from tests.helpers.gateway import Gateway, save_tiny_model_with_tokenizer
from tests.helpers.servers import ServerProcess, serving_replicas

# Small pages, so a 200-token prefix fills a dozen blocks that the gateway's index can match.
PAGE_SIZE = "16"


@pytest.fixture(scope="session")
def embedded_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The embedded SmolLM2, converted once (reused from `$CBSERVE_CACHE_DIR` when it is there)."""
    cache_root = os.environ.get(engine.CACHE_DIR_ENV) or str(tmp_path_factory.mktemp("cbserve-cache"))
    return ensure_default_model(cache_root)


@pytest.fixture(scope="session")
def tiny_model_dir(embedded_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_tiny_model_with_tokenizer(
        tmp_path_factory.mktemp("tiny-smollm2-tokenizer"), embedded_model_dir
    )


@pytest.fixture(scope="module")
def replicas(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[ServerProcess]]:
    logs = tmp_path_factory.mktemp("replica-logs")
    with serving_replicas(tiny_model_dir, logs, 2, "--page-size", PAGE_SIZE) as started:
        yield started


@pytest.fixture(scope="module")
def gateway(replicas: list[ServerProcess], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    log = Path(tmp_path_factory.mktemp("gateway-logs")) / "smg.log"
    running = Gateway([replica.target for replica in replicas], log)
    try:
        running.wait_ready()
        yield running
    finally:
        running.stop()
