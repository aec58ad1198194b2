"""Fixtures of the service tests: a live server on the tiny random llama, always shut down."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
import torch
from cbserve_client import AdminClient, Client
from service_harness import ADMIN_TOKEN, ByteTokenizer, RunningServer

from tests.conftest import tiny_model


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_model("llama")


@pytest.fixture(scope="module")
def served(model: torch.nn.Module) -> Iterator[RunningServer]:
    running = RunningServer(model, tokenizer=ByteTokenizer())
    try:
        running.load()
        yield running
    finally:
        running.close()


@pytest.fixture
def client(served: RunningServer) -> Iterator[Client]:
    with Client(served.target, timeout=30) as connected:
        yield connected


@pytest.fixture
def admin(served: RunningServer) -> Iterator[AdminClient]:
    with AdminClient(served.admin_target, token=ADMIN_TOKEN, timeout=30) as connected:
        yield connected


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
