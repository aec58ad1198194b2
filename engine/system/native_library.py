"""C kernels built by the machine's own compiler on first use, cached per machine, loaded with ctypes.

The compiler is `$CC`, else `cc`, and the flags include `-march=native`, so a library is specific to the
CPU that built it: it lands in `<cache root>/kernels/`, named by a hash of the source, the flags, the
compiler's version and the CPU's feature flags, so a cache shared by different CPUs never hands one a
library built for another. Without a working compiler, `load_library` raises `KernelUnavailable` and the
caller falls back to its torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from engine.system.cache_root import cache_root

logger = logging.getLogger(__name__)

BUILD_TIMEOUT_S = 120


class KernelUnavailable(RuntimeError):
    """A kernel cannot be built or loaded here."""


def compiler() -> str:
    """The path of `$CC`, else of `cc`."""
    name = os.environ.get("CC") or "cc"
    path = shutil.which(name)
    if path is None:
        raise KernelUnavailable(f"no C compiler: {name!r} is not on PATH (set CC to one)")
    return path


def _cpu_features() -> str:
    """The CPU's feature flags, which decide what -march=native emits."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            lines = cpuinfo.readlines()
    except OSError:  # not Linux: the processor's name is the best there is
        return platform.processor()
    return next((line for line in lines if line.startswith(("flags", "Features"))), platform.processor())


# `#include "name.h"`: a header beside the source, part of what the library is built from.
_LOCAL_INCLUDE = re.compile(rb'^\s*#include\s+"([^"]+)"', re.MULTILINE)


def _source_and_headers(source: Path) -> bytes:
    """The source's bytes, then those of each local header it includes, so that changing a header names
    a new library."""
    text = source.read_bytes()
    headers = [(source.parent / name.decode()).read_bytes() for name in _LOCAL_INCLUDE.findall(text)]
    return b"\0".join([text, *headers])


def library_path(source: Path, flags: Sequence[str], compiler_path: str) -> Path:
    """Where the library built from `source` with `flags` by `compiler_path` for this CPU lives."""
    try:
        version = subprocess.run(
            [compiler_path, "--version"], capture_output=True, text=True, timeout=30, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired) as error:
        raise KernelUnavailable(f"{compiler_path} --version failed: {error}") from error
    digest = hashlib.sha256()
    flag_bytes = " ".join(flags).encode()
    for part in (_source_and_headers(source), flag_bytes, version.encode(), _cpu_features().encode()):
        digest.update(part)
        digest.update(b"\0")
    return cache_root() / "kernels" / f"{source.stem}-{platform.machine()}-{digest.hexdigest()[:16]}.so"


def _build(compiler_path: str, source: Path, flags: Sequence[str], target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built beside the target, then renamed: a process loading the library never sees half a file.
    handle, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(handle)
    try:
        result = subprocess.run(
            [compiler_path, *flags, str(source), "-o", partial],
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT_S,
            check=False,
        )
        if result.returncode != 0:
            raise KernelUnavailable(
                f"{compiler_path} failed ({result.returncode}): {result.stderr.strip()[-2000:]}"
            )
        os.replace(partial, target)
    except subprocess.TimeoutExpired as error:
        raise KernelUnavailable(f"{compiler_path} took over {BUILD_TIMEOUT_S} s") from error
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


# Libraries already loaded in this process, by source and flags: callers load on every use, and a kernel
# call must not pay for hashing the source and asking the compiler its version.
_loaded: dict[tuple[Path, tuple[str, ...]], ctypes.CDLL] = {}


def load_library(source: Path, flags: Sequence[str], signatures: Mapping[str, Sequence[Any]]) -> ctypes.CDLL:
    """The library of `source` built with `flags` (loaded once per process: from the cache, else built into
    it first), with each function of `signatures` given its argument types and an int status as its result."""
    key = (source, tuple(flags))
    if key in _loaded:
        return _loaded[key]
    compiler_path = compiler()
    path = library_path(source, flags, compiler_path)
    if not path.exists():
        logger.info("building %s with %s into %s", source.name, compiler_path, path)
        _build(compiler_path, source, flags, path)
    try:
        library = ctypes.CDLL(str(path))
    except OSError as error:
        raise KernelUnavailable(f"cannot load {path}: {error}") from error
    for name, argument_types in signatures.items():
        function = getattr(library, name)
        function.argtypes = list(argument_types)
        function.restype = ctypes.c_int
    _loaded[key] = library
    return library
