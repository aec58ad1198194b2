"""What every attention adapter shares: the step an adapter serves, and paged attention over the queries,
keys and values it computed.

An adapter's `forward` runs only inside the engine's eager forwards (`attention.bound_step_metadata`
is set); a plain forward of the same model (`model.generate`, a trainer) runs the module's own forward
(engine.runner.own_attention.registry).
"""

from __future__ import annotations

import torch

from engine.runner.attention import PagedAttentionMetadata, paged_sdpa_attention


def attend(
    module: torch.nn.Module,
    metadata: PagedAttentionMetadata,
    layer_index: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """query [1, T, H, D], key/value [1, T, H_kv, D] of the step's packed tokens -> [1, T, H * D]: each
    token attended to its own request's cached keys (with the layer's cache group's window), after this
    step's keys and values are written, with ALiBi's bias when `alibi_slopes` [H] are given
    (engine.runner.own_attention.alibi).

    key and value carry each KV head once, as many as the cache holds (engine.families.num_key_value_heads):
    the query heads that share one read it through the kernels' grouped-query folding."""
    attended, _ = paged_sdpa_attention(
        module,
        query.transpose(1, 2),
        key.transpose(1, 2),
        value.transpose(1, 2),
        None,
        scaling=scale,
        paged_metadata=metadata,
        layer_index=layer_index,
        alibi_slopes=alibi_slopes,
    )
    return attended.reshape(1, query.shape[1], -1)
