"""bench/gpu_check.sh writes its one JSON file whatever becomes of its steps (run here on the CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.sh"
BUDGET_S = 20


def test_steps_past_the_budget_are_recorded_as_out_of_time_and_fail_the_check(tmp_path):
    out = tmp_path / "out"
    env = {
        **os.environ,
        "OUT": str(out),
        "TMPDIR": str(tmp_path),
        "PYTHON": sys.executable,
        "GPU_CHECK_DEVICE": "cpu",
        "GPU_CHECK_SMALL": "1",
        # Enough for the env step alone: every later step would start with under its 15 s minimum.
        "GPU_CHECK_BUDGET_S": str(BUDGET_S),
        "GPU_CHECK_WHEELS": str(tmp_path / "no-wheels"),
    }
    done = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120)
    output = f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    result = json.loads((out / "gpu_check.json").read_text())
    statuses = {step["name"]: step["status"] for step in result["steps"]}
    assert done.returncode == 1, output
    assert result["state"] == "finished", result
    assert list(statuses) == ["wheels", "env", "parity", "paths", "async", "bench", "sampling"], statuses
    assert statuses["wheels"] == "skipped", statuses
    # A loaded machine may need longer than the env step's share of the budget; either outcome is recorded.
    assert statuses["env"] in ("passed", "timed_out"), statuses
    later_steps = ("parity", "paths", "async", "bench", "sampling")
    assert [statuses[name] for name in later_steps] == ["out_of_time"] * 5, statuses
    assert result["summary"]["all_passed"] is False, result["summary"]
    assert (out / "gpu_check.log").exists()
