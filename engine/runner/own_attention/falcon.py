"""Falcon's attention (`FalconAttention`) on the engine's paged attention, for its rotary variants.

Falcon packs queries, keys and values into one projection, laid out one of three ways:

- new decoder architecture (Falcon 40B and later): per KV head, its group of query heads, then its key,
  then its value;
- multi-query (Falcon 7B): every query head, then the one key and the one value all heads share;
- otherwise: per head, its query, key and value.

Its rotary embedding covers whole heads (Llama's layout), from the angles the model computes once per
forward from `position_ids`, which are the engine's positions. ALiBi configs are refused
(engine.families), so `alibi` is always None here.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from engine.runner.attention import PagedAttentionMetadata
from engine.runner.own_attention.adapter import attend

ATTENTION_CLASSES = ("FalconAttention",)


def split_heads(module: Any, fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused projection [1, T, width] -> query [1, T, H, D] and key and value [1, T, H_kv, D], each
    KV head once (the model's own split repeats them for every query head of their group)."""
    tokens, heads, head_dim = fused.shape[1], module.num_heads, module.head_dim
    if module.new_decoder_architecture:
        per_kv_head = fused.view(1, tokens, module.num_kv_heads, heads // module.num_kv_heads + 2, head_dim)
        query = per_kv_head[:, :, :, :-2].flatten(2, 3)
        return query, per_kv_head[:, :, :, -2], per_kv_head[:, :, :, -1]
    if module.multi_query:
        shared = fused.view(1, tokens, heads + 2, head_dim)
        return shared[:, :, :heads], shared[:, :, heads : heads + 1], shared[:, :, heads + 1 :]
    per_head = fused.view(1, tokens, heads, 3, head_dim)
    return per_head[..., 0, :], per_head[..., 1, :], per_head[..., 2, :]


def forward(
    module: Any,
    metadata: PagedAttentionMetadata,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    **unused: object,
) -> tuple[torch.Tensor, None]:
    """`FalconAttention.forward` for one packed step: ([1, T, hidden], None)."""
    query, key, value = split_heads(module, module.query_key_value(hidden_states))
    cos, sin = position_embeddings
    rotate = sys.modules[type(module).__module__].apply_rotary_pos_emb
    query, key = rotate(query.transpose(1, 2), key.transpose(1, 2), cos, sin)
    attended = attend(
        module,
        metadata,
        module.layer_idx,
        query.transpose(1, 2),
        key.transpose(1, 2),
        value,
        module.inv_norm_factor,
    )
    return module.dense(attended), None
