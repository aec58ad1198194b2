"""The weights checksum's one definition (`cbserve_checksum`, "xxh3-128"): the shared test vectors that
the Go and Java SDKs check too, the definition in the module's docstring, and the rule that lets the
engine import it (no grpc, no cbserve_client, torch only when a digest runs)."""

from __future__ import annotations

import ast
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import xxhash
from cbserve_checksum import ALGORITHM, TensorDigester, combined_digest

ROOT = Path(__file__).resolve().parents[2]
VECTORS = json.loads((ROOT / "tests/data/weights_checksum_vectors.json").read_text())
DTYPES = {
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "I64": torch.int64,
    "U8": torch.uint8,
}


def vector_tensor(vector: dict) -> torch.Tensor:
    dtype = DTYPES[vector["dtype"]]
    num_bytes = math.prod(vector["shape"]) * dtype.itemsize
    data = bytearray((i * 131 + vector["seed"]) % 256 for i in range(num_bytes))
    if not data:
        return torch.empty(vector["shape"], dtype=dtype)
    return torch.frombuffer(data, dtype=dtype).reshape(vector["shape"])


@pytest.mark.parametrize("vector", VECTORS["tensors"], ids=lambda vector: vector["name"])
def test_each_tensor_of_the_shared_vectors_has_its_digest(vector: dict) -> None:
    digest = TensorDigester().digest(vector_tensor(vector))
    assert digest == vector["digest"], f"{vector['name']}: {digest} computed, {vector['digest']} expected"


def test_the_models_digest_of_the_shared_vectors() -> None:
    digests = {vector["name"]: vector["digest"] for vector in VECTORS["tensors"]}
    assert VECTORS["algorithm"] == ALGORITHM
    assert combined_digest(digests) == VECTORS["digest"]


def test_a_tensors_digest_is_xxh3_128_of_its_header_and_bytes() -> None:
    weights = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    expected = xxhash.xxh3_128(b"BF16:2,3:12:" + weights.view(torch.uint8).numpy().tobytes()).hexdigest()
    assert TensorDigester().digest(weights) == f"xxh3-128:{expected}"


def test_the_models_digest_is_xxh3_128_of_its_lines_in_name_order() -> None:
    digests = {"b": "xxh3-128:02", "a": "xxh3-128:01"}
    expected = xxhash.xxh3_128(b"a\txxh3-128:01\nb\txxh3-128:02\n").hexdigest()
    assert combined_digest(digests) == f"xxh3-128:{expected}"


def test_every_digest_names_its_algorithm_so_an_old_one_never_matches() -> None:
    old_style = "ab" * 32  # cbserve-wsum-v1's digests were bare SHA-256 hex
    digest = TensorDigester().digest(torch.zeros(3))
    assert digest.startswith("xxh3-128:") and len(digest) == len("xxh3-128:") + 32
    assert digest != old_style


def test_the_module_imports_neither_grpc_nor_the_client_and_torch_only_when_digesting() -> None:
    """The engine imports it, and the engine never imports grpc (tests/engine/test_layering.py)."""
    source = ROOT / "sdk/python/cbserve_checksum/__init__.py"
    top_level = {
        alias.name.split(".")[0]
        for node in ast.parse(source.read_text()).body
        if isinstance(node, ast.Import)
        for alias in node.names
    } | {
        node.module.split(".")[0]
        for node in ast.parse(source.read_text()).body
        if isinstance(node, ast.ImportFrom) and node.module
    }
    assert top_level <= {"__future__", "collections", "typing", "xxhash"}, top_level
    loaded = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, cbserve_checksum;"
            " print(sorted({'grpc', 'torch', 'cbserve_client'} & set(sys.modules)))",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert loaded == "[]", f"importing cbserve_checksum loaded {loaded}"
