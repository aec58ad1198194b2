"""cbserve's continuous-batching engine: a paged KV cache, a token-budget scheduler and a background loop
that run any transformers causal LM. The public API mirrors transformers' continuous batching."""

from engine.api import (
    continuous_batching_context_manager,
    destroy_cached_continuous_batching_manager,
    generate_batch,
    init_continuous_batching,
)
from engine.config import ContinuousBatchingConfig
from engine.errors import QueueFullError
from engine.manager import ContinuousBatchingManager, ManagerStats, PauseHandle
from engine.request import FinishReason, GenerationOutput, RequestStatus, SamplingParams

__all__ = [
    "ContinuousBatchingConfig",
    "ContinuousBatchingManager",
    "FinishReason",
    "GenerationOutput",
    "ManagerStats",
    "PauseHandle",
    "QueueFullError",
    "RequestStatus",
    "SamplingParams",
    "continuous_batching_context_manager",
    "destroy_cached_continuous_batching_manager",
    "generate_batch",
    "init_continuous_batching",
]
