"""Fixtures of the reliability suites, and the summary line of figures each suite reports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.models import tiny_model
from tests.helpers.reliability import FIGURES, PoolEntry, build_prompt_pool


@pytest.fixture(scope="session")
def prompt_pool() -> list[PoolEntry]:
    """Computed with the model's own attention, before any in-process server swaps it for the paged one."""
    return build_prompt_pool(tiny_model("llama"))


@pytest.fixture(scope="session")
def saved_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama saved for `cbserve serve` subprocesses."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama").save_pretrained(folder)
    return folder


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not FIGURES:
        return
    terminalreporter.write_sep("-", "reliability figures")
    for suite, figures in FIGURES.items():
        terminalreporter.write_line(f"reliability {suite}: {json.dumps(figures)}")
