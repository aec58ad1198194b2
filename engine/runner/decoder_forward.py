"""The engine's own forward for the Llama family of decoders on the CPU, without transformers' per-module
Python.

A step through the model's own modules pays, per layer, for a dozen module calls with their keyword
plumbing, six torch operators per RMSNorm, about a dozen for the rotary embedding, and the attention
interface's transposes: on SmolLM2-135M (30 layers), one request's decode step on the 2-core EPYC spent
about 14 ms of its 35 ms (int4 weights) outside the linear layers. `DecoderForward` runs the same layers
from the same modules and weights, calling each linear layer as it is installed (packed, quantized or
plain), with the norms, rotary embedding and gated activation as one C call each
(engine.runner.fused_ops) and the attention kernel fed directly.

Invariant: it computes what the model's own forward computes, up to the order in which the norms sum
their squares. It serves only the models whose layers it reproduces exactly (`unsupported_reason`:
Llama, Mistral, Qwen2 and Qwen3 with RMSNorm, SiLU gates and full rotary embeddings, float32), and only
on the attention kernel's path (engine.runner.forward_paths decides); every other model runs its own
forward.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from engine.runner import fused_ops
from engine.runner.attention import PagedAttentionMetadata, write_and_attend
from engine.runner.decoder_layers import DecoderLayers
from engine.system.native_library import KernelUnavailable

logger = logging.getLogger(__name__)

# Models whose decoder layers, MLPs and norms have transformers' Llama code, with attention that differs
# from Llama's at most by norms on the queries and keys (Qwen3) or biases (Qwen2).
SUPPORTED_MODELS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")
_SILU = ("SiLU", "SiLUActivation")  # torch's and transformers' (the latter what `ACT2FN["silu"]` builds)
_DECODER_LAYERS = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer")


def unsupported_reason(model: Any) -> str | None:
    """Why `DecoderForward` cannot serve `model`, or None when it can."""
    name = type(model).__name__
    if name not in SUPPORTED_MODELS:
        return f"{name} is not one of {', '.join(SUPPORTED_MODELS)}"
    config = model.config
    if getattr(config, "partial_rotary_factor", 1.0) != 1.0:
        return "its rotary embedding covers part of each head"
    if getattr(model, "tp_size", None) not in (None, 1):
        return "it is sharded over tensor-parallel ranks"
    inner = model.model
    if inner.embed_tokens.weight.dtype != torch.float32:
        return f"its weights are {inner.embed_tokens.weight.dtype}, not float32"
    if type(inner.norm).__name__ not in _NORMS:
        return f"its final norm is {type(inner.norm).__name__}"
    for layer in inner.layers:
        if type(layer).__name__ not in _DECODER_LAYERS:
            return f"a layer is {type(layer).__name__}"
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        norms += [
            getattr(layer.self_attn, name) for name in ("q_norm", "k_norm") if hasattr(layer.self_attn, name)
        ]
        if any(type(norm).__name__ not in _NORMS for norm in norms):
            return "a layer's norm is not an RMSNorm of the Llama family"
        if type(layer.mlp.act_fn).__name__ not in _SILU:
            return f"its MLP's activation is {type(layer.mlp.act_fn).__name__}, not SiLU"
    try:
        fused_ops.load()
    except KernelUnavailable as error:
        return f"the fused operations are unavailable ({error})"
    return None


def _rows(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """`tensor` as [rows, width] with unit stride along the width, what the fused operations read."""
    rows = tensor.reshape(-1, width)
    return rows if rows.stride(1) == 1 else rows.contiguous()


class DecoderForward:
    """One step of a supported model (`unsupported_reason`): packed tokens in, logits of the
    `logits_indices` rows out, with attention on the kernel path (`metadata.kernel_inputs`).

    The layers run in one C call (engine.runner.decoder_layers) when every linear layer of the step runs
    on the engine's linear kernel (quantized layers; float32 layers on its panels), else as a loop here
    over the layers' modules, which calls each linear layer as installed (packed, quantized or plain).
    Both give the same bits. `layers_in_one_call=False` keeps every step on the loop.

    A step whose requests' block tables are too wide for the kernel (`max_blocks_per_request`) gathers its
    keys instead: it runs `own_forward`, the model's own forward. The loop looks modules up on every call;
    the one-call plan reads them once, on the first step (after quantization has replaced its modules)."""

    def __init__(
        self,
        model: torch.nn.Module,
        own_forward: Callable[..., torch.Tensor],
        layers_in_one_call: bool = True,
    ) -> None:
        self.model = model
        self.own_forward = own_forward
        self._layers_in_one_call = layers_in_one_call
        self._one_call: DecoderLayers | None = None

    def _layers_of(self, metadata: PagedAttentionMetadata) -> DecoderLayers | None:
        """The one-call plan when it serves the step, else None."""
        if self._layers_in_one_call and self._one_call is None:
            self._one_call = DecoderLayers.build(self.model)
            if self._one_call is None:
                logger.info(
                    "decoder layers run one module at a time: some linear layer does not run on the "
                    "engine's linear kernel"
                )
                self._layers_in_one_call = False
        one_call = self._one_call
        serves = one_call is not None and one_call.serves(metadata.attention_kernel)
        return one_call if serves else None

    def __call__(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        logits_indices: torch.Tensor,
        metadata: PagedAttentionMetadata,
    ) -> torch.Tensor:
        if metadata.kernel_inputs is None:
            return self.own_forward(input_ids, position_ids, logits_indices, metadata)
        # transformers' modules, typed loosely: their submodules are attributes set at run time.
        model: Any = self.model
        inner = model.model
        hidden = inner.embed_tokens(input_ids[0])  # [T, hidden], a fresh tensor the residuals add into
        cos, sin = (angles[0] for angles in inner.rotary_emb(hidden[None], position_ids))
        one_call = self._layers_of(metadata)
        if one_call is not None:
            one_call.run(hidden, _rows(cos, cos.shape[-1]), _rows(sin, sin.shape[-1]), metadata)
        else:
            self._layer_loop(hidden, cos, sin, metadata)
        kept = hidden[logits_indices]
        return model.lm_head(fused_ops.rms_norm(kept, inner.norm.weight, inner.norm.variance_epsilon))

    def _layer_loop(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, metadata: PagedAttentionMetadata
    ) -> None:
        """Every layer on `hidden` [T, width], in place, one module call at a time."""
        model: Any = self.model
        width = hidden.shape[1]
        # The output of the layer before, not yet added to `hidden`: each norm adds it on its way in.
        pending: torch.Tensor | None = None
        for index, layer in enumerate(model.model.layers[: model.config.num_hidden_layers]):
            norm = layer.input_layernorm
            normed = fused_ops.rms_norm(hidden, norm.weight, norm.variance_epsilon, pending)
            attended = self._attention(index, layer.self_attn, normed, cos, sin, metadata)
            norm = layer.post_attention_layernorm
            normed = fused_ops.rms_norm(hidden, norm.weight, norm.variance_epsilon, attended)
            mlp = layer.mlp
            gate, up = (
                _rows(mlp.gate_proj(normed), mlp.intermediate_size),
                _rows(mlp.up_proj(normed), mlp.intermediate_size),
            )
            pending = _rows(mlp.down_proj(fused_ops.silu_and_mul(gate, up)), width)
        if pending is not None:
            hidden += pending

    @staticmethod
    def _attention(
        index: int,
        attention: Any,
        normed: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        metadata: PagedAttentionMetadata,
    ) -> torch.Tensor:
        """The layer's attention block on `normed` [T, hidden]: its output projection's result [T, hidden]."""
        tokens, head_dim = normed.shape[0], attention.head_dim
        queries = _rows(attention.q_proj(normed), head_dim)
        keys = _rows(attention.k_proj(normed), head_dim)
        values = _rows(attention.v_proj(normed), head_dim)
        q_norm = getattr(attention, "q_norm", None)
        if q_norm is not None:  # Qwen3: a norm over each head, before the rotation
            queries = fused_ops.rms_norm(queries, q_norm.weight, q_norm.variance_epsilon)
            keys = fused_ops.rms_norm(keys, attention.k_norm.weight, attention.k_norm.variance_epsilon)
        queries, keys = queries.view(tokens, -1, head_dim), keys.view(tokens, -1, head_dim)
        fused_ops.rotary(queries, cos, sin)
        fused_ops.rotary(keys, cos, sin)
        attended = write_and_attend(
            index, queries, keys, values.view(tokens, -1, head_dim), metadata, attention.scaling, None
        )
        return _rows(attention.o_proj(attended.view(tokens, -1)), normed.shape[1])
