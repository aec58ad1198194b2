"""Multi-head latent attention (MLA: DeepSeek V2 and V3 and the families built on their attention) over a
cache of the compressed latent, never of expanded keys and values.

An MLA layer projects each token to a latent `c` (`kv_lora_rank` values, normed) and one rotary key `r`
(`qk_rope_head_dim` values) shared by every head; `kv_b_proj` expands the latent into each head's key
part `W_UK c` and value `W_UV c`. The model's own code hands `(c, r)` to `past_key_values.update`, expands
what that returns and calls the attention interface with the expanded keys and values. In the engine's
steps `update` is `LatentCacheWriter.update`, which writes `[c, r]` into the layer's cache, and attention
(`latent_attention`) reads that cache as one key head shared by all query heads, its rows serving as the
values too:

    cache row, one per token:   | c          (kv_lora_rank)  | r  (qk_rope_head_dim) |
    query of head h, absorbed:  | W_UK_h^T q_nope            | q_rot                 |

Per head, `q_nope . (W_UK c) = (W_UK^T q_nope) . c`, so the absorbed query scores against a cached row
exactly as the model's query scores against its expanded key; and `sum p (W_UV c) = W_UV (sum p c)`, so
the first `kv_lora_rank` columns of the softmax-weighted rows, expanded by `W_UV`, are the model's
attention output. Every attention path (CPU kernel, Triton kernel, gather) computes that weighted sum as
it computes any grouped-query attention: the latent layout needs no kernel of its own. The scale is the
model's (`scaling`, with yarn's mscale), which absorption leaves as it is; float rounding differs from the
expanded product's by the order of the sums only.

A token costs `kv_lora_rank + qk_rope_head_dim` values a layer: 576 for DeepSeek V3, against 128 heads x
(192 + 128) = 40,960 for its expanded keys and values. Up-projections are read from `kv_b_proj` at every
call, so weight updates apply at once.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.config import ContinuousBatchingConfig
from engine.errors import UnsupportedModelError
from engine.runner.attention import Kernel, PagedAttentionMetadata, attend_written, gather_written


def latent_cache_width(text_config: Any) -> int | None:
    """The width of an MLA model's cache row (latent and rotary key), or None for any other model."""
    rank = getattr(text_config, "kv_lora_rank", None)
    rope = getattr(text_config, "qk_rope_head_dim", None)
    return rank + rope if rank and rope else None


def unsupported_combination(model_config: Any, config: ContinuousBatchingConfig, tp_size: int) -> str | None:
    """Why the engine cannot serve this MLA model with this configuration (one line naming the family and
    the combination), or None when it can or the model has no latent attention."""
    if latent_cache_width(model_config.get_text_config()) is None:
        return None
    family = model_config.model_type
    if tp_size > 1:
        return (
            f"{family} under tensor parallelism: its latent cache and absorbed up-projections are not "
            "verified on sharded heads; serve it on one device"
        )
    if config.quantization != "none":
        return (
            f"{family} with quantization {config.quantization!r}: its attention absorbs kv_b_proj's "
            "full-precision weight into the queries, which a quantized layer does not keep"
        )
    if config.batch_invariant:
        return f"{family} with batch_invariant: {BATCH_INVARIANCE_GAP}"
    return None


def check_combination(model: torch.nn.Module, config: ContinuousBatchingConfig, tp_size: int) -> None:
    """Raises `UnsupportedModelError` with `unsupported_combination`'s line, if it has one."""
    reason = unsupported_combination(model.config, config, tp_size)
    if reason is not None:
        raise UnsupportedModelError(f"cbserve cannot serve {type(model).__name__}: {reason}")


# Why neither the engine's batch-invariant steps nor `trainer_exact` take latent attention.
BATCH_INVARIANCE_GAP = (
    "the absorbed up-projections are batched products outside the fixed-order kernels, and a trainer's "
    "forward expands keys and values where the engine's steps absorb them, so the bits would differ"
)


class LatentCacheWriter:
    """What an MLA model's attention modules get as `past_key_values` in the engine's steps: `update` writes
    the step's latents into the layer's cache."""

    def __init__(self, metadata: PagedAttentionMetadata) -> None:
        self.metadata = metadata

    def update(
        self, latent: torch.Tensor, rope_key: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """latent [1, 1, T, kv_lora_rank], rope_key [1, 1, T, qk_rope_head_dim] (rotated) of the step's
        packed tokens.

        The model expands what this returns and hands it to attention, which reads the cache instead: one
        token's latents keep that expansion's cost to one row."""
        metadata = self.metadata
        rows = torch.cat((latent[0, 0], rope_key[0, 0]), dim=-1).unsqueeze(1)  # [T, 1, width]
        write_slots = metadata.write_slots[metadata.layer_groups[layer_idx]]
        metadata.key_caches[layer_idx].index_copy_(0, write_slots, rows)
        return latent[:, :, :1], rope_key[:, :, :1]


def latent_attention(
    kernel: Kernel,
    module: torch.nn.Module,
    layer_index: int,
    query: torch.Tensor,
    metadata: PagedAttentionMetadata,
    scaling: float | None,
    softcap: float | None,
) -> torch.Tensor:
    """query [1, H, T, qk_nope_head_dim + qk_rope_head_dim] (rotated) -> [1, T, H, v_head_dim]: each query
    attended to its request's cached latents (written by `LatentCacheWriter.update` before this call)."""
    attention: Any = module
    nope, rank, value_width = attention.qk_nope_head_dim, attention.kv_lora_rank, attention.v_head_dim
    heads, query_width = query.shape[1], query.shape[3]
    scale = scaling if scaling is not None else query_width**-0.5
    # `kv_b_proj`'s rows are, head after head, qk_nope_head_dim key rows then v_head_dim value rows (the
    # layout the model's `expand_kv` splits).
    expansion = attention.kv_b_proj.weight.view(heads, nope + value_width, rank)
    key_expansion, value_expansion = expansion[:, :nope], expansion[:, nope:]  # [H, nope, rank], [H, v, rank]
    query_nope, query_rope = query[0].split([nope, query_width - nope], dim=-1)  # [H, T, nope], [H, T, rope]
    # [T, H, rank + rope], contiguous as the kernels' compiled form assumes of its queries.
    absorbed = (
        torch.cat((torch.bmm(query_nope, key_expansion), query_rope), dim=-1).transpose(0, 1).contiguous()
    )
    if metadata.kernel_inputs is not None:
        attended = attend_written(layer_index, absorbed, metadata, scale, softcap)
    else:
        cache = metadata.key_caches[layer_index]
        gather = gather_written if metadata.is_decode_only else _varlen_gather_written
        attended = gather(
            kernel, absorbed, cache, cache, metadata.layer_groups[layer_index], metadata, scale, softcap
        )
    latent_output = attended[..., :rank].transpose(0, 1)  # [H, T, rank]
    return torch.bmm(latent_output, value_expansion.transpose(1, 2)).transpose(0, 1).unsqueeze(0)


# As attention's own varlen gather: its batches follow each step's chunks, so it runs outside compiled graphs.
_varlen_gather_written = torch.compiler.disable(gather_written)
