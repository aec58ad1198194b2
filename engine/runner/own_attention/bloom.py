"""Bloom's attention (`BloomAttention`) on the engine's paged attention, with its ALiBi bias.

Bloom fuses queries, keys and values into one projection, per head its query, key and value; it has no
rotary embedding and scales scores by 1 / sqrt(head_dim) before adding slope * key position, its
geometric slopes (engine.runner.own_attention.alibi). Its attention module adds the residual itself.

`BloomModel.forward` builds that bias from a 2-D attention mask, which the engine's steps do not pass
(their placeholder mask is 4-D), so inside a step the model's `build_alibi_tensor` builds nothing
(`install_model_hooks`): the adapter adds the bias itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from engine.runner.attention import PagedAttentionMetadata, bound_step_metadata
from engine.runner.own_attention.adapter import attend
from engine.runner.own_attention.alibi import geometric_slopes

ATTENTION_CLASSES = ("BloomAttention",)


def _output_projection(module: Any, attended: torch.Tensor) -> torch.Tensor:
    """The module's `dense`, in the slices its checkpoint's pretraining tensor parallelism summed them in
    when `slow_but_exact` asks for those bits."""
    if module.pretraining_tp <= 1 or not module.slow_but_exact:
        return module.dense(attended)
    width = module.hidden_size / module.pretraining_tp
    output = torch.zeros_like(attended)
    for part in range(module.pretraining_tp):
        columns = slice(int(part * width), int((part + 1) * width))
        output = output + F.linear(attended[:, :, columns], module.dense.weight[:, columns])
    return output


def forward(
    module: Any,
    metadata: PagedAttentionMetadata,
    hidden_states: torch.Tensor,
    residual: torch.Tensor,
    **unused: object,
) -> tuple[torch.Tensor, None]:
    """`BloomAttention.forward` for one packed step: ([1, T, hidden], None), the residual added."""
    heads = (1, hidden_states.shape[1], module.num_heads, 3, module.head_dim)
    fused = module.query_key_value(hidden_states).view(heads)
    query, key, value = fused[..., 0, :], fused[..., 1, :], fused[..., 2, :]
    slopes = geometric_slopes(module.num_heads, hidden_states.device)
    attended = attend(
        module, metadata, module.layer_idx, query, key, value, module.inv_norm_factor, alibi_slopes=slopes
    )
    return residual + _output_projection(module, attended), None


def install_model_hooks(model: torch.nn.Module) -> Callable[[], None]:
    """Makes every `BloomModel`'s `build_alibi_tensor` build nothing inside the engine's steps (outside
    them it is the model's own); returns what takes that off again."""
    base_models: list[Any] = [module for module in model.modules() if type(module).__name__ == "BloomModel"]
    for base_model in base_models:
        own = base_model.build_alibi_tensor

        def build_alibi_tensor(*args: Any, own: Callable[..., Any] = own, **kwargs: Any) -> Any:
            return None if bound_step_metadata() is not None else own(*args, **kwargs)

        base_model.build_alibi_tensor = build_alibi_tensor

    def restore() -> None:
        for base_model in base_models:
            base_model.__dict__.pop("build_alibi_tensor", None)

    return restore
