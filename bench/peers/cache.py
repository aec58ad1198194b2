"""Where the peers are installed, and how a setup step runs: a cache folder of their own, never the project's
environment, and every build or install under `nice -n 19`, so that the other work on a shared machine keeps
its cores."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from engine.system.cache_root import cache_root

# The lowest scheduling priority: a 16-minute build must not slow the tests others run beside it.
NICE = ("nice", "-n", "19")
LOG_TAIL_CHARS = 3000


class SetupError(RuntimeError):
    """A peer could not be set up; the message says which step failed and ends with its log's tail."""


@dataclass(frozen=True)
class PeerCache:
    """The peers' folder (`<cbserve cache>/peers` unless given): downloads, sources, builds, virtual
    environments, converted weights and the logs of every step."""

    root: Path

    @classmethod
    def default(cls) -> PeerCache:
        return cls(cache_root() / "peers")

    @property
    def downloads(self) -> Path:
        return self.root / "downloads"

    @property
    def sources(self) -> Path:
        return self.root / "src"

    @property
    def weights(self) -> Path:
        return self.root / "weights"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def make_folders(self) -> None:
        for folder in (self.downloads, self.sources, self.weights, self.logs):
            folder.mkdir(parents=True, exist_ok=True)


def say(message: str) -> None:
    """What setup does, on stderr (stdout carries the benchmark's JSON)."""
    print(f"peers setup: {message}", file=sys.stderr, flush=True)


def log_tail(path: Path, limit: int = LOG_TAIL_CHARS) -> str:
    try:
        return path.read_text(errors="replace")[-limit:]
    except OSError:
        return ""


def run_step(
    description: str,
    command: Sequence[str | os.PathLike[str]],
    log_name: str,
    cache: PeerCache,
    cwd: Path | None = None,
    environment: Mapping[str, str] | None = None,
) -> None:
    """Runs `command` under `nice -n 19`, its output appended to `logs/<log_name>.log`; a failure raises
    `SetupError` with the log's tail."""
    log_path = cache.logs / f"{log_name}.log"
    say(f"{description} (log: {log_path})")
    with open(log_path, "ab") as log:
        log.write(f"$ {' '.join(map(str, command))}\n".encode())
        log.flush()
        completed = subprocess.run(
            [*NICE, *map(str, command)],
            cwd=cwd,
            env={**os.environ, **(environment or {})},
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            check=False,
        )
    if completed.returncode != 0:
        raise SetupError(
            f"{description} failed (exit {completed.returncode}); end of {log_path}:\n{log_tail(log_path)}"
        )
