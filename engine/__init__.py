"""cbserve's continuous-batching engine: a paged KV cache, a token-budget scheduler and a background loop
that run any transformers causal LM. The public API mirrors transformers' continuous batching.

Everything outside `engine/` (the service, benchmarks, examples) imports the engine from here.
"""

from engine.api import (
    continuous_batching_context_manager,
    destroy_cached_continuous_batching_manager,
    generate_batch,
    init_continuous_batching,
)
from engine.config import ContinuousBatchingConfig
from engine.engine_core import call_on_steps_thread
from engine.errors import (
    DuplicateRequestError,
    EngineBusyError,
    QueueFullError,
    UnsupportedModelError,
    WeightTransferError,
    WeightTransferTimeout,
)
from engine.families import check_model_support
from engine.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from engine.loop.commands import PauseHandle, PauseMode, PrefixCacheReset, SleepOutcome
from engine.manager import ContinuousBatchingManager
from engine.parallel import (
    check_tensor_parallel_size,
    load_sharded_model,
    tensor_parallel_size,
    torchrun_environment,
    torchrun_rank,
    torchrun_world_size,
)
from engine.quantization.gguf_blocks import load_gguf_linears
from engine.quantization.gptq import checkpoint_quantization, load_quantized_checkpoint
from engine.request import FinishReason, GenerationOutput, RequestStatus, sequence_request_id
from engine.runner.batch_invariant import BatchInvariantUnsupported, sequence_logprobs, trainer_exact
from engine.sampling.params import (
    MAX_SEQUENCES_PER_REQUEST,
    InvalidParameterError,
    LogprobsMode,
    SamplingParams,
    StructuredOutput,
    build_sampling_params,
    check_token_ids,
    default_max_new_tokens,
    sequence_seed,
)
from engine.stats import ManagerStats
from engine.system.cache_root import CACHE_DIR_ENV, cache_root
from engine.system.container_limits import default_num_threads
from engine.weights.checksum import TensorChecksum, WeightsChecksum
from engine.weights.cuda_ipc import CudaIpcHandle
from engine.weights.tensors import dtype_from_name, safetensors_files
from engine.weights.transfer import (
    DEFAULT_GROUP_NAME,
    DEFAULT_GROUP_TIMEOUT_S,
    BucketPlan,
    BucketTensor,
    JoinedGroup,
    WeightBucket,
)

__all__ = [
    "CACHE_DIR_ENV",
    "DEFAULT_GROUP_NAME",
    "DEFAULT_GROUP_TIMEOUT_S",
    "MAX_SEQUENCES_PER_REQUEST",
    "AllBlocksCleared",
    "BatchInvariantUnsupported",
    "BlockRemoved",
    "BlockStored",
    "BucketPlan",
    "BucketTensor",
    "ContinuousBatchingConfig",
    "ContinuousBatchingManager",
    "CudaIpcHandle",
    "DuplicateRequestError",
    "EngineBusyError",
    "FinishReason",
    "GenerationOutput",
    "InvalidParameterError",
    "JoinedGroup",
    "KVCacheEvent",
    "LogprobsMode",
    "ManagerStats",
    "PauseHandle",
    "PauseMode",
    "PrefixCacheReset",
    "QueueFullError",
    "RequestStatus",
    "SamplingParams",
    "SleepOutcome",
    "StructuredOutput",
    "TensorChecksum",
    "UnsupportedModelError",
    "WeightBucket",
    "WeightTransferError",
    "WeightTransferTimeout",
    "WeightsChecksum",
    "build_sampling_params",
    "cache_root",
    "call_on_steps_thread",
    "check_model_support",
    "check_tensor_parallel_size",
    "check_token_ids",
    "checkpoint_quantization",
    "continuous_batching_context_manager",
    "default_max_new_tokens",
    "default_num_threads",
    "destroy_cached_continuous_batching_manager",
    "dtype_from_name",
    "generate_batch",
    "init_continuous_batching",
    "load_gguf_linears",
    "load_quantized_checkpoint",
    "load_sharded_model",
    "safetensors_files",
    "sequence_logprobs",
    "sequence_request_id",
    "sequence_seed",
    "tensor_parallel_size",
    "torchrun_environment",
    "torchrun_rank",
    "torchrun_world_size",
    "trainer_exact",
]
