"""The wire API's hygiene: committed stubs match proto/, buf lint passes, every element is documented."""

from __future__ import annotations

import pathlib
import re
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROTO_FILES = sorted((ROOT / "proto" / "cbserve" / "v1").glob("*.proto"))
BUF = ROOT / "proto" / "node_modules" / ".bin" / "buf"

# Declarations that must carry a leading comment: messages, enums, services, oneofs, rpcs,
# fields and enum values.
DECLARATION = re.compile(
    r"^\s*(message|enum|service|oneof)\s+\w+\s*\{"
    r"|^\s*rpc\s+\w+"
    r"|^\s*(optional\s+|repeated\s+)?[\w.<>, ]+\s+\w+\s*=\s*\d+\s*(\[.*\])?;"
    r"|^\s*[A-Z][A-Z0-9_]*\s*=\s*\d+\s*(\[.*\])?;"
)


def test_proto_files_exist() -> None:
    assert [p.name for p in PROTO_FILES] == ["admin.proto", "generation.proto", "types.proto"]


@pytest.mark.parametrize("path", PROTO_FILES, ids=lambda p: p.name)
def test_every_proto_element_is_documented(path: pathlib.Path) -> None:
    undocumented = []
    previous = ""
    for number, line in enumerate(path.read_text().splitlines(), 1):
        stripped = line.strip()
        if not stripped:
            continue
        if DECLARATION.match(line) and not previous.startswith("//"):
            undocumented.append(f"{path.name}:{number}: {stripped}")
        previous = stripped
    assert not undocumented, "undocumented proto elements:\n" + "\n".join(undocumented)


def test_generated_python_stubs_are_current() -> None:
    script = ROOT / "scripts" / "generate_python_stubs.sh"
    result = subprocess.run(["bash", str(script), "--check"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]


def test_buf_lint_and_format() -> None:
    assert BUF.exists(), "buf is not installed: run `npm ci --prefix proto` (scripts/test.sh does)"
    assert shutil.which("node"), "buf's npm wrapper needs node"
    for args in (["lint", "proto"], ["format", "-d", "--exit-code", "proto"]):
        result = subprocess.run([str(BUF), *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, f"buf {' '.join(args)}:\n{result.stdout}{result.stderr}"


def test_buf_generate_template_matches_the_script(tmp_path: pathlib.Path) -> None:
    """proto/buf.gen.yaml (incl. its grpc_python adapter) yields the same gRPC stubs as the script."""
    assert BUF.exists(), "buf is not installed: run `npm ci --prefix proto` (scripts/test.sh does)"
    result = subprocess.run(
        [str(BUF), "generate", "proto", "--template", "proto/buf.gen.yaml", "--output", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    generated = tmp_path / "gen" / "python" / "cbserve" / "v1"
    committed = ROOT / "sdk" / "python" / "cbserve_client" / "_generated" / "cbserve" / "v1"
    grpc_modules = sorted(p.name for p in committed.glob("*_pb2_grpc.py"))
    assert grpc_modules == ["admin_pb2_grpc.py", "generation_pb2_grpc.py"]
    for name in grpc_modules:
        raw = (generated / name).read_text()
        rewritten = re.sub(
            r"^from cbserve\.v1 import ", "from cbserve_client._generated.cbserve.v1 import ", raw, flags=re.M
        )
        assert rewritten == (committed / name).read_text(), name
