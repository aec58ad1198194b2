#!/usr/bin/env python3
"""protoc plugin `grpc_python` for buf, backed by grpcio-tools.

grpcio-tools links the grpc_python generator into its own protoc (`python -m grpc_tools.protoc
--grpc_python_out=...`) and ships no standalone protoc-gen-grpc_python, which buf's `local:`
plugins need. This adapter reads the CodeGeneratorRequest from stdin, runs grpc_tools.protoc on
the same descriptors (--descriptor_set_in) and answers with the files it wrote.
"""

from __future__ import annotations

import pathlib
import sys
import tempfile

from google.protobuf import descriptor_pb2
from google.protobuf.compiler import plugin_pb2
from grpc_tools import protoc


def main() -> int:
    request = plugin_pb2.CodeGeneratorRequest.FromString(sys.stdin.buffer.read())
    response = plugin_pb2.CodeGeneratorResponse(
        supported_features=plugin_pb2.CodeGeneratorResponse.FEATURE_PROTO3_OPTIONAL
    )
    with tempfile.TemporaryDirectory() as tmp:
        fds = descriptor_pb2.FileDescriptorSet(file=request.proto_file)
        fds_path = pathlib.Path(tmp, "input.binpb")
        fds_path.write_bytes(fds.SerializeToString())
        out = pathlib.Path(tmp, "out")
        out.mkdir()
        opt = f"{request.parameter}:" if request.parameter else ""
        argv = [
            "grpc_tools.protoc",
            f"--descriptor_set_in={fds_path}",
            f"--grpc_python_out={opt}{out}",
            *request.file_to_generate,
        ]
        if protoc.main(argv) != 0:
            response.error = "grpc_tools.protoc failed (see stderr)"
        else:
            for path in sorted(p for p in out.rglob("*") if p.is_file()):
                response.file.add(name=path.relative_to(out).as_posix(), content=path.read_text())
    sys.stdout.buffer.write(response.SerializeToString())
    return 0


if __name__ == "__main__":
    sys.exit(main())
