"""MPT's attention (`MptAttention`) on the engine's paged attention, with its ALiBi bias.

MPT splits one projection into queries, keys and values (each all heads wide), clamps it first where
`clip_qkv` says, scales scores by `softmax_scale` (1 / sqrt(head_dim) unless set) and adds its slopes
(engine.runner.own_attention.alibi.mpt_slopes) times the key's position relative to the last key, which
`MptModel` computes once per forward, for `max_seq_len` positions; the adapter adds the bias itself, so
the model's needs no adapting.

transformers' `MptModel` builds its slopes with alibi_bias_max 8 whatever `attn_config.alibi_bias_max`
says; the adapter computes what the model computes.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.runner.attention import PagedAttentionMetadata
from engine.runner.own_attention.adapter import attend
from engine.runner.own_attention.alibi import mpt_slopes

ATTENTION_CLASSES = ("MptAttention",)
# The alibi_bias_max transformers' MptModel builds its bias with (its `build_mpt_alibi_tensor` default).
MODEL_ALIBI_BIAS_MAX = 8


def forward(
    module: Any,
    metadata: PagedAttentionMetadata,
    hidden_states: torch.Tensor,
    **unused: object,
) -> tuple[torch.Tensor, None]:
    """`MptAttention.forward` for one packed step: ([1, T, hidden], None)."""
    fused = module.Wqkv(hidden_states)
    if module.clip_qkv:
        fused = fused.clamp(min=-module.clip_qkv, max=module.clip_qkv)
    heads = (1, hidden_states.shape[1], module.n_heads, module.head_dim)
    query, key, value = (part.reshape(heads) for part in fused.chunk(3, dim=2))
    slopes = mpt_slopes(module.n_heads, MODEL_ALIBI_BIAS_MAX, hidden_states.device)
    attended = attend(
        module, metadata, module.layer_idx, query, key, value, module.softmax_scale, alibi_slopes=slopes
    )
    return module.out_proj(attended), None
