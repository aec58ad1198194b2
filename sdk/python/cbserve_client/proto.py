"""The generated protobuf and gRPC modules of the cbserve.v1 API, for servers and low-level use.

    from cbserve_client.proto import generation_pb2, generation_pb2_grpc

Generated from proto/cbserve/v1 by scripts/generate_python_stubs.sh.
"""

from cbserve_client._generated.cbserve.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    generation_pb2,
    generation_pb2_grpc,
    types_pb2,
)

__all__ = ["admin_pb2", "admin_pb2_grpc", "generation_pb2", "generation_pb2_grpc", "types_pb2"]
