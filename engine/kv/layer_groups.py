"""KV cache groups: which layers share a block pool, derived from the model config, and what each layer
keeps per request.

Full-attention layers keep every token of a request; sliding-window layers only need the last
`sliding_window` tokens. Recurrent layers keep no tokens at all but a fixed-size state per request
(`StateGroupSpec`: a short convolution's last inputs), held in one slot per running request
(engine.kv.state_slots). Those are the only layer kinds the engine keeps a cache for: any other
`layer_types` entry (linear attention, Mamba, ...) raises here, so no layer is ever cached as something it
is not (engine.families refuses such models first, with the family's name).

The two kinds cannot share block tables (a sliding table drops pages a full table keeps), so each kind
is one group with its own pool, tables and tensors. A model with one kind of layer has one group; a
hybrid model (Gemma 2: alternating sliding and full layers) has both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# The `layer_types` names of the layers a group can hold. Chunked layers (Llama 4: a query attends within
# its chunk of `attention_chunk_size` positions) keep every token in the full group, so their blocks are
# never freed early and prefix caching stays exact; the attention kernels bound the chunk.
CACHED_LAYER_KINDS = ("full_attention", "sliding_attention", "chunked_attention")


@dataclass(frozen=True)
class ConvStateSpec:
    """What a short-convolution layer keeps per request: the last `kernel_size - 1` inputs of each of its
    `channels`, which the next token's convolution reads (LFM2's `conv` layers)."""

    kernel_size: int
    channels: int

    @property
    def state_shape(self) -> tuple[int, int]:
        """One request's state of one layer: (kernel_size - 1, channels), oldest input first."""
        return (self.kernel_size - 1, self.channels)


def conv_state_spec(text_config: Any) -> ConvStateSpec:
    kernel_size = int(text_config.conv_L_cache)
    if kernel_size < 2:
        raise ValueError(f"the model config's conv_L_cache is {kernel_size}; a short convolution needs >= 2")
    return ConvStateSpec(kernel_size, int(text_config.hidden_size))


# `layer_types` names of the layers that keep a state per request, and how each reads its spec from the
# config: one row per recurrent layer kind (its engine forward is engine.runner.recurrent's row).
STATE_LAYER_SPECS: dict[str, Callable[[Any], ConvStateSpec]] = {"conv": conv_state_spec}


@dataclass(frozen=True)
class StateGroupSpec:
    """Layers of one kind that keep the same state per request (`spec`), in one slot per running request."""

    layer_indices: tuple[int, ...]
    kind: str
    spec: ConvStateSpec


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """The layers of one group and their attention span (`sliding_window` None: full attention)."""

    layer_indices: tuple[int, ...]
    sliding_window: int | None

    @property
    def name(self) -> str:
        return "full" if self.sliding_window is None else "sliding"


def state_group(text_config: Any) -> StateGroupSpec | None:
    """The model's recurrent layers, or None for a model of attention layers only."""
    layer_types = getattr(text_config, "layer_types", None) or ()
    kinds = [kind for kind in STATE_LAYER_SPECS if kind in layer_types]
    if not kinds:
        return None
    if len(kinds) > 1:
        raise ValueError(f"the model config has recurrent layers of kinds {kinds}; the engine holds one kind")
    (kind,) = kinds
    indices = tuple(index for index, name in enumerate(layer_types) if name == kind)
    return StateGroupSpec(indices, kind, STATE_LAYER_SPECS[kind](text_config))


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
    """The model's paged groups (its attention layers), the full-attention group first when there is one.

    `layer_types` ("sliding_attention" / "full_attention" per layer) wins when the config has it;
    otherwise `sliding_window` (unless `use_sliding_window` is False) makes every layer sliding.
    """
    known = {*CACHED_LAYER_KINDS, *STATE_LAYER_SPECS}
    unknown = sorted(set(getattr(text_config, "layer_types", None) or ()) - known)
    if unknown:
        raise ValueError(
            f"the model config has layers of kind {', '.join(map(repr, unknown))}; the KV cache holds "
            f"only {' and '.join(sorted(known))} layers"
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
    # Recurrent layers keep a state per request instead of pages (`state_group`).
    recurrent = state_group(text_config)
    not_paged = {*sliding, *(recurrent.layer_indices if recurrent is not None else ())}
    full = [index for index in range(num_layers) if index not in not_paged]
    groups = []
    if full:
        groups.append(KVCacheGroupSpec(tuple(full), None))
    if sliding:
        groups.append(KVCacheGroupSpec(tuple(sliding), window))
    return groups
