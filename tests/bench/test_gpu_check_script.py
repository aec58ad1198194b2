"""bench/gpu_check.sh writes its one JSON file whatever becomes of its steps (run here on the CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.sh"
# The script keeps 5 s back for its last merge and starts no step with under 15 s: with 19 s in all, no
# step can start however fast or slow the machine is, so the statuses below do not race the clock.
BUDGET_S = 19


def test_steps_past_the_budget_are_recorded_as_out_of_time_and_fail_the_check(tmp_path):
    out = tmp_path / "out"
    env = {
        **os.environ,
        "OUT": str(out),
        "TMPDIR": str(tmp_path),
        "PYTHON": sys.executable,
        "GPU_CHECK_DEVICE": "cpu",
        "GPU_CHECK_SMALL": "1",
        "GPU_CHECK_BUDGET_S": str(BUDGET_S),
        "GPU_CHECK_WHEELS": str(tmp_path / "no-wheels"),
    }
    done = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120)
    output = f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    result = json.loads((out / "gpu_check.json").read_text())
    statuses = {step["name"]: step["status"] for step in result["steps"]}
    assert done.returncode == 1, output
    assert result["state"] == "finished", result
    assert list(statuses) == [
        "wheels",
        "env",
        "parity",
        "paths",
        "async",
        "quantization",
        "batch_invariant",
        "batch_invariance_probe",
        "bench",
        "sampling",
        "cuda_ipc",
        "weight_sync",
    ], statuses
    assert statuses["wheels"] == "skipped", statuses
    timed_steps = (
        "env",
        "parity",
        "paths",
        "async",
        "quantization",
        "batch_invariant",
        "batch_invariance_probe",
        "bench",
        "sampling",
        "cuda_ipc",
        "weight_sync",
    )
    assert [statuses[name] for name in timed_steps] == ["out_of_time"] * len(timed_steps), statuses
    assert result["summary"]["all_passed"] is False, result["summary"]
    assert (out / "gpu_check.log").exists()
