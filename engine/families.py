"""Which model families the engine serves exactly, decided at load: a family it cannot serve is refused
before any cache exists, with one line naming the family and the layer kind or feature it lacks.

The engine runs a model's own modules and puts its paged attention in place of the model's attention
(engine.runner.attention). That gives `model.generate`'s tokens exactly when every layer is attention of
a kind the paged kernels compute (full or sliding window, with the model's own scale and soft-cap) and
nothing else in the forward needs state across steps or a mask the model builds itself. A model that
breaks either rule does not fail loudly: it yields fluent, wrong tokens. So families are admitted by
name, never on trust:

- `SERVED_FAMILIES`: the model types that tests/engine/test_model_families.py serves with greedy parity
  on a tiny random model, one prompt alone and several batched with one longer than any window;
- `REFUSED_FAMILIES`: every other model type of the installed transformers' causal-LM mapping, with what
  the engine lacks to serve it;
- a model type in neither (a newer transformers, remote code) is refused as unverified.

Within a served family, a config may still turn on what the engine lacks (`layer_types` naming another
layer kind): `refusal_reason` checks those too. docs/model-families.md is generated from
these tables (scripts/generate_family_table.py).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from engine.errors import UnsupportedModelError
from engine.kv.layer_groups import CACHED_LAYER_KINDS, STATE_LAYER_SPECS

# Verified by the conformance test: greedy parity with model.generate in fp32.
SERVED_FAMILIES = frozenset(
    {
        "afmoe",
        "apertus",
        "arcee",
        "aria_text",
        "axk1",
        "beam",
        "biogpt",
        "bitnet",
        "bloom",
        "codegen",
        "cohere",
        "cohere2",
        "cohere2_moe",
        "ctrl",
        "cwm",
        "deepseek_v2",
        "deepseek_v3",
        "ernie4_5",
        "ernie4_5_moe",
        "exaone4",
        "exaone_moe",
        "falcon",
        "flex_olmo",
        "gemma",
        "gemma2",
        "gemma3_text",
        "glm",
        "glm4",
        "glm4_moe",
        "glm4_moe_lite",
        "gpt-sw3",
        "gpt2",
        "gpt_bigcode",
        "gpt_neo",
        "gpt_neox",
        "gpt_oss",
        "gptj",
        "granite",
        "granitemoe",
        "granitemoeshared",
        "helium",
        "hrm_text",
        "hunyuan_v1_dense",
        "hunyuan_v1_moe",
        "hy_v3",
        "hyperclovax",
        "internlm3",
        "iquestcoder",
        "jais2",
        "kolibri1",
        "laguna",
        "lfm2",
        "lfm2_moe",
        "llama",
        "llama4_text",
        "longcat_flash",
        "mellum",
        "minicpm3",
        "minimax_m2",
        "minimax_m3_vl_text",
        "ministral",
        "ministral3",
        "mistral",
        "mixtral",
        "modernbert-decoder",
        "mpt",
        "nanochat",
        "nemotron",
        "olmo",
        "olmo2",
        "olmo3",
        "olmoe",
        "opt",
        "persimmon",
        "phi",
        "phi3",
        "phimoe",
        "qwen2",
        "qwen2_moe",
        "qwen3",
        "qwen3_moe",
        "seed_oss",
        "smollm3",
        "solar_open",
        "stablelm",
        "starcoder2",
        "vaultgemma",
        "youtu",
    }
)

# What the engine lacks, one line per kind ("the kind: what is missing"); the families below name them.
ATTENTION_SINKS = (
    "attention sinks (a learned logit per head in every softmax): the paged kernels do not add them"
)
CHUNKED_ATTENTION = (
    "chunked local attention (tokens attend within their chunk only): the paged kernels do not bound it"
)
SPARSE_ATTENTION = (
    "sparse attention (a learned top-k selection of keys): the paged kernels attend to every key"
)
PER_LAYER_SHAPES = (
    "attention layers of different head counts or widths: the paged cache has one shape for all layers"
)
PER_LAYER_CACHE_SHARING = (
    "layers that read another layer's keys and values: the paged cache gives each layer its own"
)
DIFFERENTIAL_ATTENTION = (
    "differential attention (two softmaxes subtracted per head): the paged kernels compute one"
)
MAMBA = "Mamba (selective state-space) layers: the engine holds no per-request recurrent state"
LINEAR_ATTENTION = (
    "linear-attention layers (gated DeltaNet and kin): the engine holds no per-request recurrent state"
)
SHORT_CONVOLUTION = (
    "short-convolution layers of another family than LFM2's: the engine holds their convolution state, "
    "and computes it, for LFM2's short-convolution modules only"
)
RECURRENT_ONLY = "recurrent layers only: the engine's cache needs at least one attention layer"
RECURRENT = "recurrent layers (RWKV, xLSTM, RG-LRU): the engine holds no per-request recurrent state"
OWN_ATTENTION = (
    "attention computed in the model's own code, not through transformers' attention interface, with no "
    "adapter of the engine's to stand in for it (engine.runner.own_attention)"
)
UNVERIFIED_ATTENTION = (
    "an attention variant the paged kernels do not reproduce: its greedy tokens differ from model.generate's"
)
ENCODER = (
    "encoder layers (bidirectional attention, optional cross-attention): the engine serves decoder-only "
    "causal LMs"
)
ENCODER_DECODER = (
    "the decoder of an encoder-decoder model: its cross-attention reads encoder states the engine has not"
)
MULTIMODAL = (
    "a multimodal generation class (image, audio or video inputs): serve its text model's family instead"
)
UNTESTED = (
    "a configuration the conformance test cannot build a tiny model of yet, so its tokens are unverified"
)
UNVERIFIED_FAMILY = (
    "a family cbserve has not verified to give model.generate's greedy tokens (docs/model-families.md lists "
    "those it serves)"
)

REFUSED_FAMILIES: dict[str, str] = {
    "axk2": SPARSE_ATTENTION,
    "bailing_hybrid": LINEAR_ATTENTION,
    "bamba": MAMBA,
    "bart": ENCODER_DECODER,
    "bert": ENCODER,
    "bert-generation": ENCODER,
    "big_bird": ENCODER,
    "bigbird_pegasus": ENCODER_DECODER,
    "blenderbot": ENCODER_DECODER,
    "blenderbot-small": ENCODER_DECODER,
    "blt": MULTIMODAL,
    "camembert": ENCODER,
    "cohere_compass_text": UNTESTED,
    "cpmant": UNVERIFIED_ATTENTION,
    "data2vec-text": ENCODER,
    "dbrx": UNTESTED,
    "deepseek_v32": SPARSE_ATTENTION,
    "deepseek_v4": SPARSE_ATTENTION,
    "diffllama": DIFFERENTIAL_ATTENTION,
    "doge": OWN_ATTENTION,
    "dots1": UNTESTED,
    "dots3_note": MULTIMODAL,
    "dots3_note_text": PER_LAYER_SHAPES,
    "electra": ENCODER,
    "emu3": MULTIMODAL,
    "ernie": ENCODER,
    "falcon_h1": MAMBA,
    "falcon_mamba": MAMBA,
    "flint": UNVERIFIED_ATTENTION,
    "fuyu": MULTIMODAL,
    "gemma3": MULTIMODAL,
    "gemma3n": MULTIMODAL,
    "gemma3n_text": PER_LAYER_CACHE_SHARING,
    "gemma4": MULTIMODAL,
    "gemma4_assistant": PER_LAYER_CACHE_SHARING,
    "gemma4_text": PER_LAYER_SHAPES,
    "gemma4_unified": MULTIMODAL,
    "gemma4_unified_assistant": PER_LAYER_CACHE_SHARING,
    "gemma4_unified_text": PER_LAYER_SHAPES,
    "git": MULTIMODAL,
    "glm_moe_dsa": SPARSE_ATTENTION,
    "got_ocr2": MULTIMODAL,
    "gpt_neox_japanese": OWN_ATTENTION,
    "granite_swa": UNVERIFIED_ATTENTION,
    "granitemoe_swa": UNVERIFIED_ATTENTION,
    "granitemoehybrid": MAMBA,
    "hy_v4": OWN_ATTENTION,
    "inkling2_text": UNVERIFIED_ATTENTION,
    "inkling_text": UNVERIFIED_ATTENTION,
    "jamba": MAMBA,
    "jetmoe": OWN_ATTENTION,
    "kimi_linear": LINEAR_ATTENTION,
    "lfm3": LINEAR_ATTENTION,
    "llama4": MULTIMODAL,
    "mamba": MAMBA,
    "mamba2": MAMBA,
    "marian": ENCODER_DECODER,
    "mbart": ENCODER_DECODER,
    "megatron-bert": ENCODER,
    "mimo_v2_flash": PER_LAYER_SHAPES,
    "minimax": LINEAR_ATTENTION,
    "mllama": MULTIMODAL,
    "moshi": MULTIMODAL,
    "moss_transcribe_diarize": MULTIMODAL,
    "musicgen": MULTIMODAL,
    "musicgen_melody": MULTIMODAL,
    "mvp": ENCODER_DECODER,
    "nemotron_h": MAMBA,
    "olmo_hybrid": LINEAR_ATTENTION,
    "openai-gpt": OWN_ATTENTION,
    "pegasus": ENCODER_DECODER,
    "phi4_multimodal": MULTIMODAL,
    "plbart": ENCODER_DECODER,
    "prophetnet": ENCODER_DECODER,
    "qwen3_5": LINEAR_ATTENTION,
    "qwen3_5_moe": LINEAR_ATTENTION,
    "qwen3_5_moe_text": LINEAR_ATTENTION,
    "qwen3_5_text": LINEAR_ATTENTION,
    "qwen3_next": LINEAR_ATTENTION,
    "qwen4_exp": MULTIMODAL,
    "qwen4_exp_text": LINEAR_ATTENTION,
    "recurrent_gemma": RECURRENT,
    "reformer": OWN_ATTENTION,
    "rembert": ENCODER,
    "roberta": ENCODER,
    "roberta-prelayernorm": ENCODER,
    "roc_bert": ENCODER,
    "roformer": ENCODER,
    "rwkv": RECURRENT,
    "trocr": ENCODER_DECODER,
    "whisper": ENCODER_DECODER,
    "xglm": OWN_ATTENTION,
    "xlm": ENCODER,
    "xlm-roberta": ENCODER,
    "xlm-roberta-xl": ENCODER,
    "xlnet": ENCODER,
    "xlstm": RECURRENT,
    "xmod": ENCODER,
    "zamba": MAMBA,
    "zamba2": MAMBA,
    "zaya": UNTESTED,
}

# `layer_types` names of layers the engine holds no state for, and what each kind lacks.
LAYER_KIND_REASONS = {
    "chunked_attention": CHUNKED_ATTENTION,
    "linear_attention": LINEAR_ATTENTION,
    "mamba": MAMBA,
    "mamba2": MAMBA,
    "conv": SHORT_CONVOLUTION,
    "short_conv": SHORT_CONVOLUTION,
}


def layer_kind_counts(text_config: Any) -> str:
    """The model's layers by kind, such as `24 full_attention, 24 sliding_attention` (the line the server
    logs at load)."""
    kinds = getattr(text_config, "layer_types", None)
    if not kinds:
        window = getattr(text_config, "sliding_window", None)
        sliding = window is not None and getattr(text_config, "use_sliding_window", True)
        kinds = ["sliding_attention" if sliding else "full_attention"] * text_config.num_hidden_layers
    return ", ".join(f"{count} {kind}" for kind, count in Counter(kinds).items())


# The families whose recurrent layers of each kind the engine computes (engine.runner.recurrent), verified
# by the conformance test as SERVED_FAMILIES are: a layer kind keeps its name across families that compute
# it differently.
STATE_LAYER_FAMILIES = {"conv": frozenset({"lfm2", "lfm2_moe"})}


def _layer_kind_reason(text_config: Any) -> str | None:
    """What a served family's config turns on that the engine lacks, if anything: a layer kind it keeps no
    cache for, or computes for other families only."""
    kinds = getattr(text_config, "layer_types", None) or ()
    if kinds and all(kind in STATE_LAYER_SPECS for kind in kinds):
        return RECURRENT_ONLY
    for kind in kinds:
        if kind in STATE_LAYER_SPECS and text_config.model_type in STATE_LAYER_FAMILIES.get(kind, ()):
            continue
        if kind not in CACHED_LAYER_KINDS:
            return LAYER_KIND_REASONS.get(
                kind,
                f"layers of kind {kind!r}: the engine computes {' and '.join(CACHED_LAYER_KINDS)} only",
            )
    return None


# Falcon's ALiBi variant rounds each slope * key position to bf16 (engine.runner.own_attention.falcon): the
# engine's bias equals it while the slopes are powers of two (1, 2, 4 or 8 heads) and positions stay below
# 256 (8 significant bits); with other head counts it differs by up to 2^-9, which can change tokens.
FALCON_ALIBI_EXACT_HEADS = (1, 2, 4, 8)
FALCON_ALIBI_EXACT_POSITIONS = 256


def _is_falcon_alibi(text_config: Any) -> bool:
    return text_config.model_type == "falcon" and bool(getattr(text_config, "alibi", False))


def _falcon_alibi_reason(text_config: Any) -> str | None:
    num_heads = text_config.num_attention_heads
    if not _is_falcon_alibi(text_config) or num_heads in FALCON_ALIBI_EXACT_HEADS:
        return None
    exact = ", ".join(str(count) for count in FALCON_ALIBI_EXACT_HEADS)
    return (
        f"Falcon's ALiBi variant with {num_heads} heads: the model rounds each slope x key position to "
        f"bfloat16, which the engine's per-head slopes reproduce only with {exact} heads"
    )


def exact_length_limit(text_config: Any) -> int | None:
    """The longest sequence (and step) the engine computes exactly for this config, when it is shorter
    than the model's own limit; None otherwise.

    Llama 4's layers without rotary embeddings scale their queries by log1p(floor((position + 1) /
    floor_scale)) * attn_scale + 1, with the position taken from the token's index in the forward's input,
    not from position_ids. The engine packs many requests' tokens into one input, so that index is not the
    token's position; the scale is 1 for both while every position and every step's token count stays
    below floor_scale - 1 (8191 tokens for Llama 4 Scout and Maverick).

    Falcon's ALiBi variant, where served (`FALCON_ALIBI_EXACT_HEADS`), is exact below 256 positions."""
    if _is_falcon_alibi(text_config):
        return FALCON_ALIBI_EXACT_POSITIONS
    rope_layers = getattr(text_config, "no_rope_layers", None) or ()
    if getattr(text_config, "attn_temperature_tuning", False) and not all(rope_layers):
        return int(text_config.floor_scale) - 1
    return None


def num_key_value_heads(text_config: Any) -> int:
    """The key (and value) heads each attention layer of this config computes, which is what the cache holds
    per token: `num_key_value_heads` where the config has one, else the family's own fields. Falcon has
    none: its new decoder architecture (40B and later) has `num_kv_heads` groups, its multi-query layout
    (7B) one head every query head reads, its oldest layout one key head per query head."""
    num_heads: int = text_config.num_attention_heads
    if text_config.model_type == "falcon":
        if text_config.new_decoder_architecture:
            return int(text_config.num_kv_heads)
        return 1 if text_config.multi_query else num_heads
    return getattr(text_config, "num_key_value_heads", None) or num_heads


def refusal_reason(config: Any) -> str | None:
    """Why the engine refuses a model with this config, or None when it serves it exactly."""
    model_type: str = getattr(config, "model_type", "") or ""
    if model_type in REFUSED_FAMILIES:
        return REFUSED_FAMILIES[model_type]
    if model_type not in SERVED_FAMILIES:
        return UNVERIFIED_FAMILY
    text_config = config.get_text_config()
    return _layer_kind_reason(text_config) or _falcon_alibi_reason(text_config)


def check_model_support(config: Any, class_name: str) -> None:
    """Raises `UnsupportedModelError` naming the family and what the engine lacks when the engine cannot
    serve a model of class `class_name` with this config exactly. The engine checks the model it is
    given before it builds anything; a server checks the folder's config before it loads any weights."""
    reason = refusal_reason(config)
    if reason is not None:
        raise UnsupportedModelError(
            f"cbserve cannot serve {class_name} (model type {config.model_type!r}): {reason}"
        )
