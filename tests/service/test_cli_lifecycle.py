"""`cbserve --version`, and the line `cbserve serve` logs when it stops: which signal stopped it and how
long it served, so an operator reading the log knows the stop was asked for, not a crash."""

from __future__ import annotations

import importlib.metadata
import re
import signal
from pathlib import Path

import pytest

from service import cli
from tests.helpers.cli import run_cli
from tests.helpers.models import fresh_tiny_model
from tests.helpers.servers import ServerProcess

STOP_TIMEOUT_S = 60


def test_version_prints_the_installed_packages_version() -> None:
    result = run_cli("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"cbserve {importlib.metadata.version('cbserve')}\n", result.stdout


@pytest.mark.parametrize(
    ("signum", "named"), [(signal.SIGTERM, "SIGTERM"), (signal.SIGINT, "SIGINT (Ctrl-C)")]
)
def test_serve_logs_one_line_saying_which_signal_stopped_it_and_how_long_it_served(
    signum: signal.Signals, named: str, tmp_path: Path
) -> None:
    fresh_tiny_model("llama").save_pretrained(tmp_path / "model")
    server = ServerProcess(tmp_path / "model", tmp_path / "server.log")
    try:
        server.wait_serving()
        server.process.send_signal(signum)
        assert server.process.wait(timeout=STOP_TIMEOUT_S) == 0, server.log_tail()
    finally:
        server.close()
    stopped = [line for line in server.log_tail().splitlines() if " stopped on " in line]
    assert len(stopped) == 1, f"one stop line expected, the log ends:\n{server.log_tail()}"
    pattern = rf" INFO service\.cli: stopped on {re.escape(named)} after serving \S+ for \d+ s$"
    assert re.search(pattern, stopped[0]), f"{stopped[0]!r} does not match {pattern!r}"


@pytest.mark.parametrize(
    ("seconds", "shown"), [(4.4, "4 s"), (59.4, "59 s"), (65, "1 min 05 s"), (4379, "1 h 12 min")]
)
def test_the_time_served_reads_in_the_largest_units_that_fit(seconds: float, shown: str) -> None:
    assert cli._duration(seconds) == shown
