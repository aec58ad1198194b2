"""CodeGen's attention (`CodeGenAttention`) on the engine's paged attention.

CodeGen is GPT-J's attention (engine.runner.own_attention.gptj: the same rotary embedding) with one fused
projection, laid out for the 4-way model parallelism it was trained with: four parts, each holding a
quarter of the heads' queries, then values, then keys.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.runner.attention import PagedAttentionMetadata
from engine.runner.own_attention.gptj import rotated_attention

ATTENTION_CLASSES = ("CodeGenAttention",)
# The parts CodeGen's checkpoints fuse their projection into (the model's own code fixes it too).
MODEL_PARALLEL_PARTS = 4


def forward(
    module: Any,
    metadata: PagedAttentionMetadata,
    hidden_states: torch.Tensor,
    position_ids: torch.Tensor,
    **unused: object,
) -> tuple[torch.Tensor, None]:
    """`CodeGenAttention.forward` for one packed step: ([1, T, hidden], None)."""
    tokens = hidden_states.shape[1]
    parts = module.qkv_proj(hidden_states).view(1, tokens, MODEL_PARALLEL_PARTS, -1)
    heads = (1, tokens, module.num_attention_heads, module.head_dim)
    query, value, key = (part.reshape(heads) for part in torch.chunk(parts, 3, dim=-1))
    return rotated_attention(module, metadata, (query, key, value), position_ids)
