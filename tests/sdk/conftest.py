"""Fixtures of the Python SDK tests (the fakes live in tests/helpers/sdk_fakes.py)."""

from __future__ import annotations

import importlib.util
import pathlib
import sys
from collections.abc import Iterator

import pytest

# The SDK is its own distribution (pip install -e sdk/python). When it is not installed, test the
# checkout's copy rather than failing to import it.
if importlib.util.find_spec("cbserve_client") is None:
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "sdk" / "python"))

from tests.helpers.sdk_fakes import FakeServer, start_fake_server


@pytest.fixture
def fake_server() -> Iterator[FakeServer]:
    """A real gRPC server on 127.0.0.1 (free port) with fake servicers; always stopped afterwards."""
    server, fake = start_fake_server()
    try:
        yield fake
    finally:
        # grace 0, not None: with None grpcio's `stop` itself waits for the shutdown, without a bound, so a
        # handler that never returns would hang the run; with 0 it cancels every call and returns at once.
        server.stop(grace=0).wait(5)
