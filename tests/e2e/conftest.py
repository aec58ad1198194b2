"""The converted embedded model, shared by the end-to-end tests (converted once per session)."""

from __future__ import annotations

import os

import pytest

import engine
from service.default_model import ensure_default_model


@pytest.fixture(scope="session")
def cache_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    """`$CBSERVE_CACHE_DIR` when set (a model converted there before is reused), else a session folder."""
    return os.environ.get(engine.CACHE_DIR_ENV) or str(tmp_path_factory.mktemp("cbserve-cache"))


@pytest.fixture(scope="session")
def model_dir(cache_root: str) -> str:
    return ensure_default_model(cache_root)
