"""Entry points that work on any transformers causal LM: `generate_batch`, `init_continuous_batching`,
`continuous_batching_context_manager` (transformers' `ContinuousMixin` calls, as functions)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from tqdm.auto import tqdm

from engine.config import ContinuousBatchingConfig
from engine.manager import ContinuousBatchingManager
from engine.request import GenerationOutput, sequence_request_id


def init_continuous_batching(
    model: torch.nn.Module,
    generation_config: Any = None,
    continuous_batching_config: ContinuousBatchingConfig | None = None,
) -> ContinuousBatchingManager:
    """A manager for `model`; reuses one kept with `stop(keep_for_next_session=True)` when present."""
    cached: ContinuousBatchingManager | None = getattr(model, "_cbserve_cached_manager", None)
    if cached is not None and not cached._destroyed:
        if generation_config is not None:
            cached.generation_config = generation_config
        return cached
    return ContinuousBatchingManager(model, generation_config, continuous_batching_config)


def destroy_cached_continuous_batching_manager(model: torch.nn.Module) -> None:
    cached: ContinuousBatchingManager | None = getattr(model, "_cbserve_cached_manager", None)
    if cached is not None:
        cached.destroy()


@contextmanager
def continuous_batching_context_manager(
    model: torch.nn.Module,
    generation_config: Any = None,
    continuous_batching_config: ContinuousBatchingConfig | None = None,
    block: bool = True,
    timeout: float | None = None,
    persistent_manager: bool = False,
    warmup: bool = True,
) -> Iterator[ContinuousBatchingManager]:
    """A started manager; on exit it is stopped, and destroyed unless `persistent_manager`."""
    manager = init_continuous_batching(model, generation_config, continuous_batching_config)
    if warmup:
        manager.warmup()
    manager.start()
    try:
        yield manager
    finally:
        manager.stop(block=block, timeout=timeout, keep_for_next_session=persistent_manager)
        if not persistent_manager:
            manager.destroy()


def generate_batch(
    model: torch.nn.Module,
    inputs: list[list[int]],
    generation_config: Any = None,
    continuous_batching_config: ContinuousBatchingConfig | None = None,
    record_timestamps: bool = False,
    progress_bar: bool = False,
    persistent_manager: bool = False,
    warmup: bool = True,
    **kwargs: Any,
) -> dict[str, GenerationOutput]:
    """Generates for every prompt and returns `{request_id: output}` in input order.

    Keyword arguments are per-request generation parameters (max_new_tokens, temperature, ...). With
    `num_return_sequences` > 1 (an argument, or the generation config's), every sequence of a prompt has
    its entry, in order: the request's id, then `{request_id}__child#0`, ... as in transformers.
    """
    if not inputs:
        return {}
    max_new_tokens = kwargs.pop("max_new_tokens", None)
    config = continuous_batching_config or ContinuousBatchingConfig()
    if config.max_requests_per_batch is None:
        # As in transformers: a batch never holds more requests than were submitted, which also bounds
        # the decode CUDA graphs warmup captures.
        config = dataclasses.replace(config, max_requests_per_batch=len(inputs))
    results: dict[str, GenerationOutput] = {}
    with continuous_batching_context_manager(
        model,
        generation_config,
        config,
        persistent_manager=persistent_manager,
        warmup=warmup,
    ) as manager:
        num_sequences = manager.sampling_params(max_new_tokens=max_new_tokens, **kwargs).n
        ids = [
            sequence_request_id(request_id, index)
            for request_id in manager.add_requests(
                inputs, max_new_tokens=max_new_tokens, record_timestamps=record_timestamps, **kwargs
            )
            if request_id is not None
            for index in range(num_sequences)
        ]
        pending = set(ids)
        with tqdm(total=len(pending), disable=not progress_bar, desc="generate_batch", unit="req") as bar:
            while pending:
                output = manager.get_result(timeout=1.0)
                if output is None:
                    if not manager.is_running():
                        raise RuntimeError("the generation loop stopped before every request finished")
                    continue
                if output.is_finished() and output.request_id in pending:
                    pending.discard(output.request_id)
                    results[output.request_id] = output
                    bar.update(1)
    return {request_id: results[request_id] for request_id in ids if request_id in results}
