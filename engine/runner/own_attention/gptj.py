"""GPT-J's attention (`GPTJAttention`) on the engine's paged attention.

GPT-J rotates interleaved pairs of dimensions (0 with 1, 2 with 3, ...) over the first `rotary_dim`
dimensions of each head (all of them when None), with angles from a sinusoid table it indexes by
`position_ids`, which are the engine's positions. CodeGen rotates the same way
(engine.runner.own_attention.codegen).
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from engine.runner.attention import PagedAttentionMetadata
from engine.runner.own_attention.adapter import attend

ATTENTION_CLASSES = ("GPTJAttention",)


def rotate_leading_dims(
    module: Any, query: torch.Tensor, key: torch.Tensor, position_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """query and key [1, T, heads, D] rotated at `position_ids` [1, T] as the module rotates them: its
    own sinusoid table and its modeling module's `apply_rotary_pos_emb`, on the first `rotary_dim`
    dimensions."""
    table = module.embed_positions.to(position_ids.device)
    sin, cos = torch.chunk(table[position_ids].to(key.dtype), 2, dim=-1)
    rotate = sys.modules[type(module).__module__].apply_rotary_pos_emb
    dims = module.rotary_dim or query.shape[-1]

    def rotated(tensor: torch.Tensor) -> torch.Tensor:
        return torch.cat([rotate(tensor[..., :dims], sin, cos), tensor[..., dims:]], dim=-1)

    return rotated(query), rotated(key)


def rotated_attention(
    module: Any,
    metadata: PagedAttentionMetadata,
    projected: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    position_ids: torch.Tensor,
) -> tuple[torch.Tensor, None]:
    """The attention block from the step's projected query, key and value [1, T, H, D]: rotated, attended
    with GPT-J's scale (1 / sqrt(head_dim)) and projected out, ([1, T, hidden], None)."""
    query, key, value = projected
    query, key = rotate_leading_dims(module, query, key, position_ids)
    attended = attend(module, metadata, module.layer_idx, query, key, value, 1.0 / module.scale_attn)
    return module.out_proj(attended), None


def forward(
    module: Any,
    metadata: PagedAttentionMetadata,
    hidden_states: torch.Tensor,
    position_ids: torch.Tensor,
    **unused: object,
) -> tuple[torch.Tensor, None]:
    """`GPTJAttention.forward` for one packed step: ([1, T, hidden], None)."""
    heads = (1, hidden_states.shape[1], module.num_attention_heads, module.head_dim)
    query, key, value = (
        projection(hidden_states).view(heads) for projection in (module.q_proj, module.k_proj, module.v_proj)
    )
    return rotated_attention(module, metadata, (query, key, value), position_ids)
