"""GPT-Neo's attention (`GPTNeoSelfAttention`) on the engine's paged attention.

GPT-Neo has no rotary embedding (its positions are learned embeddings added to the tokens' by the
model, at the engine's positions) and does not scale its scores: the softmax reads q . k as it is, a
scale of 1. Its local layers see the last `window_size` keys; the engine's cache groups take them as
sliding-window layers of that window (engine.kv.layer_groups), so the layer's cache group applies it.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.runner.attention import PagedAttentionMetadata
from engine.runner.own_attention.adapter import attend

ATTENTION_CLASSES = ("GPTNeoSelfAttention",)
# GPT-Neo's scores are q . k, unscaled.
SCORE_SCALE = 1.0


def forward(
    module: Any,
    metadata: PagedAttentionMetadata,
    hidden_states: torch.Tensor,
    **unused: object,
) -> tuple[torch.Tensor, None]:
    """`GPTNeoSelfAttention.forward` for one packed step: ([1, T, hidden], None)."""
    heads = (1, hidden_states.shape[1], module.num_heads, module.head_dim)
    query = module.q_proj(hidden_states).view(heads)
    key = module.k_proj(hidden_states).view(heads)
    value = module.v_proj(hidden_states).view(heads)
    attended = attend(module, metadata, module.layer_id, query, key, value, SCORE_SCALE)
    return module.out_proj(attended), None
