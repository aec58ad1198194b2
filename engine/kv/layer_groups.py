"""KV cache groups: which layers share a block pool, derived from the model config.

Full-attention layers keep every token of a request; sliding-window layers only need the last
`sliding_window` tokens. Those are the only layer kinds the engine keeps a cache for: any other
`layer_types` entry (linear attention, convolutions, chunked attention, ...) raises here, so no layer is
ever cached as something it is not (engine.families refuses such models first, with the family's name).

The two kinds cannot share block tables (a sliding table drops pages a full table keeps), so each kind
is one group with its own pool, tables and tensors. A model with one kind of layer has one group; a
hybrid model (Gemma 2: alternating sliding and full layers) has both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# The `layer_types` names of the layers a group can hold. Chunked layers (Llama 4: a query attends within
# its chunk of `attention_chunk_size` positions) keep every token in the full group, so their blocks are
# never freed early and prefix caching stays exact; the attention kernels bound the chunk.
CACHED_LAYER_KINDS = ("full_attention", "sliding_attention", "chunked_attention")


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """The layers of one group and their attention span (`sliding_window` None: full attention)."""

    layer_indices: tuple[int, ...]
    sliding_window: int | None

    @property
    def name(self) -> str:
        return "full" if self.sliding_window is None else "sliding"


def attention_chunks(text_config: Any) -> list[int | None]:
    """Per layer, the chunk its queries attend within (`chunked_attention` layers), else None."""
    chunk: int | None = getattr(text_config, "attention_chunk_size", None)
    kinds = getattr(text_config, "layer_types", None) or ()
    if "chunked_attention" in kinds and not chunk:
        raise ValueError("the model config has chunked_attention layers but no attention_chunk_size")
    return [chunk if kind == "chunked_attention" else None for kind in kinds]


# GPT-Neo's names for its layers (`attention_layers`), whose local layers see the last `window_size` keys.
GPT_NEO_LAYER_KINDS = {"global": "full_attention", "local": "sliding_attention"}


def layer_types_and_window(text_config: Any) -> tuple[list[str] | None, int | None]:
    """The config's `layer_types` and `sliding_window`, or what GPT-Neo's config says in their place."""
    if getattr(text_config, "model_type", None) == "gpt_neo":
        kinds = [GPT_NEO_LAYER_KINDS[kind] for kind in text_config.attention_layers]
        return kinds, text_config.window_size
    return getattr(text_config, "layer_types", None), getattr(text_config, "sliding_window", None)


def kv_cache_groups(text_config: Any) -> list[KVCacheGroupSpec]:
    """The model's groups, the full-attention group first when there is one.

    `layer_types` ("sliding_attention" / "full_attention" per layer) wins when the config has it;
    otherwise `sliding_window` (unless `use_sliding_window` is False) makes every layer sliding.
    """
    unknown = sorted(set(getattr(text_config, "layer_types", None) or ()) - set(CACHED_LAYER_KINDS))
    if unknown:
        raise ValueError(
            f"the model config has layers of kind {', '.join(map(repr, unknown))}; the KV cache holds "
            f"only {' and '.join(CACHED_LAYER_KINDS)} layers"
        )
    num_layers: int = text_config.num_hidden_layers
    layer_types, window = layer_types_and_window(text_config)
    if layer_types:
        sliding = [index for index, kind in enumerate(layer_types) if kind == "sliding_attention"]
    elif window is not None and getattr(text_config, "use_sliding_window", True):
        sliding = list(range(num_layers))
    else:
        sliding = []
    if sliding and window is None:
        raise ValueError("the model config has sliding_attention layers but no sliding_window")
    full = [index for index in range(num_layers) if index not in set(sliding)]
    groups = []
    if full:
        groups.append(KVCacheGroupSpec(tuple(full), None))
    if sliding:
        groups.append(KVCacheGroupSpec(tuple(sliding), window))
    return groups
