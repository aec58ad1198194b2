"""Python client of cbserve, a continuous-batching LLM inference service (gRPC).

    from cbserve_client import Client

    with Client("localhost:50051") as client:
        print(client.generate("The capital of France is", max_new_tokens=8).text)

Public API: :class:`Client` (sync; :meth:`Client.session` for many requests on one stream, as a
:class:`GenerateSession`), :class:`AsyncClient` (asyncio), :class:`AdminClient` (pause, as a
:class:`PauseLease`; stop/start, status, weight updates, sleep/wake-up, prefix-cache reset, weight
checksum), :class:`AdminFleet` (the same on every replica of a deployment at once, and
:meth:`AdminFleet.check_weights`), :class:`WeightSyncGroup` (a trainer's weight push over NCCL or gloo),
:func:`weights_checksum` (a trainer's own digest of what it pushed), the result dataclasses, and the
exceptions of :mod:`cbserve_client.errors`. The raw protobuf modules are in :mod:`cbserve_client.proto`.
Importing the package never imports torch: the weight-sync and CUDA IPC calls import it when they run.
"""

from cbserve_client._buckets import BucketTensor, WeightBucket, plan_buckets
from cbserve_client._convert import Prompt
from cbserve_client._pause import PauseLease
from cbserve_client._types import (
    Chunk,
    Completion,
    ModelInfo,
    PauseInfo,
    PrefixCacheReset,
    PromptLogprob,
    SleepResult,
    Status,
    StopResult,
    TensorChecksum,
    Timings,
    TokenLogprob,
    TopLogprob,
    Usage,
    WeightsChecksum,
    WeightsTransferReady,
    WeightsUpdate,
    WeightsUpdateGroupInfo,
)
from cbserve_client._weights_transfer import WeightsTransfer
from cbserve_client.admin import AdminClient
from cbserve_client.aio import AsyncChunkStream, AsyncClient
from cbserve_client.aio_session import AsyncGenerateSession, AsyncSessionStream
from cbserve_client.checksum import weights_checksum
from cbserve_client.client import ChunkStream, Client
from cbserve_client.errors import (
    AbortedError,
    AlreadyExistsError,
    CancelledError,
    CbserveError,
    DeadlineExceededError,
    FailedPreconditionError,
    FleetError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    OutOfRangeError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
    UnimplementedError,
    WeightsMismatchError,
)
from cbserve_client.fleet import AdminFleet, replica_targets
from cbserve_client.session import GenerateSession, SessionStream
from cbserve_client.trainer import LogprobsCheck, PushReport, check_logprobs, push_and_verify
from cbserve_client.weight_sync import WeightSyncGroup

__version__ = "0.1.0"

__all__ = [
    "AbortedError",
    "AdminClient",
    "AdminFleet",
    "AlreadyExistsError",
    "AsyncChunkStream",
    "AsyncClient",
    "AsyncGenerateSession",
    "AsyncSessionStream",
    "BucketTensor",
    "CancelledError",
    "CbserveError",
    "Chunk",
    "ChunkStream",
    "Client",
    "Completion",
    "DeadlineExceededError",
    "FailedPreconditionError",
    "FleetError",
    "GenerateSession",
    "InternalError",
    "InvalidArgumentError",
    "LogprobsCheck",
    "ModelInfo",
    "NotFoundError",
    "OutOfRangeError",
    "PauseInfo",
    "PauseLease",
    "PermissionDeniedError",
    "PrefixCacheReset",
    "Prompt",
    "PromptLogprob",
    "PushReport",
    "ResourceExhaustedError",
    "SessionStream",
    "SleepResult",
    "Status",
    "StopResult",
    "TensorChecksum",
    "Timings",
    "TokenLogprob",
    "TopLogprob",
    "UnauthenticatedError",
    "UnavailableError",
    "UnimplementedError",
    "Usage",
    "WeightBucket",
    "WeightSyncGroup",
    "WeightsChecksum",
    "WeightsMismatchError",
    "WeightsTransfer",
    "WeightsTransferReady",
    "WeightsUpdate",
    "WeightsUpdateGroupInfo",
    "__version__",
    "check_logprobs",
    "plan_buckets",
    "push_and_verify",
    "replica_targets",
    "weights_checksum",
]
