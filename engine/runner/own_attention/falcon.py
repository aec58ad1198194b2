"""Falcon's attention (`FalconAttention`) on the engine's paged attention, rotary and ALiBi variants.

Falcon packs queries, keys and values into one projection, laid out one of three ways:

- new decoder architecture (Falcon 40B and later): per KV head, its group of query heads, then its key,
  then its value;
- multi-query (Falcon 7B): every query head, then the one key and the one value all heads share;
- otherwise: per head, its query, key and value.

Its rotary embedding covers whole heads (Llama's layout), from the angles the model computes once per
forward from `position_ids`, which are the engine's positions.

Its ALiBi variant (`alibi=True`, no rotary embedding) adds the geometric slopes
(engine.runner.own_attention.alibi), rounded to bf16, times the key position to the unscaled scores, so
the engine's slopes are those times the score scale. The model rounds each slope * position product to
bf16 too, which a per-head slope cannot: that product is exact while it fits bf16's 8 significant bits,
as it does at every position below 256 where the slopes are powers of two (2, 4 or 8 heads); elsewhere
the engine's bias is the exact product, within 2^-9 of the model's. `FalconModel.forward` builds that
bias from a 2-D attention mask, which the engine's steps do not pass (their placeholder is 4-D), so
inside a step its `build_alibi_tensor` builds nothing (`install_model_hooks`) and the adapter adds the
bias itself.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch

from engine.runner.attention import PagedAttentionMetadata, bound_step_metadata
from engine.runner.own_attention.adapter import attend
from engine.runner.own_attention.alibi import geometric_slopes

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
    if module.config.alibi:
        scale = module.inv_norm_factor
        slopes = _scaled_alibi_slopes(module.num_heads, scale, hidden_states.device)
        attended = attend(module, metadata, module.layer_idx, query, key, value, scale, alibi_slopes=slopes)
        return module.dense(attended), None
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


@functools.cache
def _scaled_alibi_slopes(num_heads: int, scale: float, device: torch.device) -> torch.Tensor:
    """The bias per unit of key distance after the score scale: the model's bf16 slopes times `scale`."""
    return geometric_slopes(num_heads, device).bfloat16().float() * scale


def install_model_hooks(model: torch.nn.Module) -> Callable[[], None]:
    """For the ALiBi variant, makes the modeling module's `build_alibi_tensor` build nothing inside the
    engine's steps, for good: outside them it is the function itself, so plain forwards of every Falcon
    model are what they were. Returns what takes the hooks off (nothing to take off)."""
    if getattr(model.config, "alibi", False):
        modeling: Any = sys.modules[type(model).__module__]
        if not getattr(modeling.build_alibi_tensor, "builds_nothing_in_steps", False):
            modeling.build_alibi_tensor = _nothing_inside_steps(modeling.build_alibi_tensor)
    return lambda: None


def _nothing_inside_steps(own: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(own)
    def build_alibi_tensor(*args: Any, **kwargs: Any) -> Any:
        return None if bound_step_metadata() is not None else own(*args, **kwargs)

    build_alibi_tensor.builds_nothing_in_steps = True  # type: ignore[attr-defined]
    return build_alibi_tensor
