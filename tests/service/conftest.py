"""Fixtures of the service tests: a live server on the tiny random llama, always shut down."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from cbserve_client import AdminClient, Client

from tests.helpers.models import tiny_model
from tests.helpers.servers import ADMIN_TOKEN, ByteTokenizer, RunningServer


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
