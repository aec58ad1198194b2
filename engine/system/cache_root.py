"""Where cbserve keeps what it builds once per machine: the converted default model, compiled kernels."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR_ENV = "CBSERVE_CACHE_DIR"


def cache_root() -> Path:
    """`$CBSERVE_CACHE_DIR`, else `${XDG_CACHE_HOME:-~/.cache}/cbserve`."""
    configured = os.environ.get(CACHE_DIR_ENV)
    if configured:
        return Path(configured).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "cbserve"
