"""Structured-output requests for the engine and end-to-end tests: JSON schemas, a started manager with
room for a batch of them, and their results."""

from __future__ import annotations

import json
from typing import Any

import torch

from engine import ContinuousBatchingConfig, ContinuousBatchingManager, GenerationOutput, StructuredOutput

RESULT_TIMEOUT_S = 120
STRUCTURED_OUTPUT_CONFIG = dict(page_size=16, num_blocks=512, max_batch_tokens=512, max_requests_per_batch=64)


def started_manager(
    model: torch.nn.Module, tokenizer: Any = None, **overrides: Any
) -> ContinuousBatchingManager:
    """A started manager of `model` (the tokenizer compiles the grammars), `overrides` on
    `STRUCTURED_OUTPUT_CONFIG`; the caller destroys it."""
    config = ContinuousBatchingConfig(**{**STRUCTURED_OUTPUT_CONFIG, **overrides})
    manager = ContinuousBatchingManager(model, continuous_batching_config=config, tokenizer=tokenizer)
    manager.start()
    return manager


def results(manager: ContinuousBatchingManager, ids: list[str | None]) -> list[GenerationOutput]:
    """The final output of every request, in order; a request with none within the timeout fails."""
    outputs = []
    for request_id in ids:
        assert request_id is not None
        output = manager.get_result(request_id, timeout=RESULT_TIMEOUT_S)
        assert output is not None, f"{request_id}: no result in {RESULT_TIMEOUT_S} s"
        outputs.append(output)
    return outputs


def object_schema(
    properties: dict[str, Any], required: list[str] | None = None, **extra: Any
) -> dict[str, Any]:
    """A JSON schema of an object with `properties` (and `required`, `extra` keywords)."""
    schema: dict[str, Any] = {"type": "object", "properties": properties, **extra}
    if required is not None:
        schema["required"] = required
    return schema


def json_schema_output(schema: dict[str, Any]) -> StructuredOutput:
    return StructuredOutput("json_schema", json.dumps(schema))
