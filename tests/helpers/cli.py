"""`cbserve` as users run it, `python -m service ...` in a subprocess, for the CLI's tests."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.helpers.servers import REPO_ROOT

CLI_TIMEOUT_S = 120


def run_cli(
    *args: str, env: dict[str, str] | None = None, prelude: str = ""
) -> subprocess.CompletedProcess[str]:
    """`python -m service ARGS`; `prelude` is Python run first in the same process (to hide a package)."""
    command = [sys.executable, "-m", "service", *args]
    if prelude:
        command = [
            sys.executable,
            "-c",
            f"{prelude}\nimport sys\nfrom service.cli import main\nsys.exit(main())",
        ]
        command += list(args)
    return subprocess.run(
        command,
        cwd=REPO_ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
    )
