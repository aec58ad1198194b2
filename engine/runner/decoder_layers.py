"""Every decoder layer of a step in one C call (`decoder_layers` in `fused_ops_cpu.c`), for
`engine.runner.decoder_forward`.

Run from Python, a layer of the Llama family is fifteen kernel calls (norms, seven linear layers, rotary
embeddings, the cache write, attention, the gated activation), each paying ctypes' argument conversion,
an output tensor and the Python around it, and each waking the OpenMP team anew after the interpreter
ran alone: on SmolLM2-135M (30 layers, 450 calls a step) on the 2-core EPYC, one request's decode step
(`EngineCore.step`) took 19.9 ms with int4 weights and 37.5 ms in float32 with the layers run from
Python, and 9.2 and 21.6 ms in one call; four requests' 32.5 and 44.9 ms, against 22.1 and 32.0.
`DecoderLayers` describes the layers' weights to the C code once (a `Layer` struct per layer, pointers
to the tensors the kernels read) and then runs each step's layers in one call, with every intermediate in
one scratch buffer that lives from step to step.

It serves a step when the linear kernel (engine.quantization.kernel) computes every linear layer of it
the way the layer's own call would: quantized layers, and float32 layers on the kernel's panels
(engine.runner.packed_linear), at any row count. The results are those of `DecoderForward`'s layer loop
bit for bit: same kernels, same operations, same order, same threads.

Invariant: the layers' modules and the storage of their tensors do not change while an engine serves
the model. Quantization replaces modules before the engine's first step; weight updates write in place
(engine.weights). The plan holds references to every tensor it points to, so a tensor can never be freed
under it. The one exception is a float32 layer's panels, which follow its weight: before each step the
plan asks each for its current panels (repacked in place after a weight update or a wake-up: the
engine's panels keep their storage, `PanelArena`; others are allocated anew after sleep freed them) and
points at those.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import torch

from engine.quantization import kernel as linear_kernel
from engine.quantization.linear import QuantizedLinear
from engine.runner import fused_ops, packed_linear, paged_attention_cpu
from engine.runner.attention import PagedAttentionMetadata
from engine.system.native_library import KernelUnavailable

_int64, _pointer, _double = ctypes.c_int64, ctypes.c_void_p, ctypes.c_double
# The attention function the runner hands a step on the CPU kernel (engine.runner.forward_paths).
_CPU_ATTENTION = paged_attention_cpu.paged_attention


class _Linear(ctypes.Structure):
    _fields_ = [
        ("format", _int64),
        ("quantize_activations", _int64),
        ("out_features", _int64),
        ("in_features", _int64),
        ("weight_bytes", _int64),
        ("packed", _pointer),
        ("scales", _pointer),
        ("mins", _pointer),
        ("bias", _pointer),
    ]


_PROJECTIONS = ("query", "key", "value", "output", "gate", "up", "down")


class _Layer(ctypes.Structure):
    _fields_ = [
        *[(name, _Linear) for name in _PROJECTIONS],
        ("input_norm", _pointer),
        ("post_attention_norm", _pointer),
        ("query_norm", _pointer),
        ("key_norm", _pointer),
        ("input_norm_eps", _double),
        ("post_attention_norm_eps", _double),
        ("query_norm_eps", _double),
        ("key_norm_eps", _double),
        ("scale", _double),
    ]


class _Decoder(ctypes.Structure):
    _fields_ = [
        ("num_layers", _int64),
        ("width", _int64),
        ("heads", _int64),
        ("kv_heads", _int64),
        ("head_dim", _int64),
        ("intermediate", _int64),
        ("min_work_per_thread", _int64),
        ("linear", _pointer),
        ("attention", _pointer),
    ]


class _StepInputs(ctypes.Structure):
    _fields_ = [
        ("rows", _int64),
        ("hidden", _pointer),
        ("cos", _pointer),
        ("sin", _pointer),
        ("angle_stride", _int64),
        ("key_caches", _pointer),
        ("value_caches", _pointer),
        ("layer_groups", _pointer),
        ("num_slots", _int64),
        ("write_slots", _pointer),
        ("block_tables", _pointer),
        ("table_strides", _pointer),
        ("sliding_windows", _pointer),
        ("query_starts", _pointer),
        ("seq_lens", _pointer),
        ("tile_requests", _pointer),
        ("tile_offsets", _pointer),
        ("num_tiles", _int64),
        ("queries_per_tile", _int64),
        ("page_size", _int64),
        ("has_unowned_rows", _int64),
        ("threads", _int64),
        ("scratch", _pointer),
    ]


def _is_float32_rows(tensor: torch.Tensor) -> bool:
    return tensor.dtype == torch.float32 and tensor.device.type == "cpu" and tensor.is_contiguous()


class _Plan:
    """The pointers and sizes `decoder_layers` reads, and the tensors behind them (kept alive here)."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        # The float32 layers: the struct that points at the panels, the layer, its panels.
        self.panelled: list[tuple[_Linear, Any, packed_linear.PanelledWeight]] = []

    def pointer(self, tensor: torch.Tensor | None) -> int | None:
        if tensor is None:
            return None
        self.tensors.append(tensor)
        return tensor.data_ptr()

    def linear(self, module: Any) -> _Linear | None:
        """`module` as the kernel reads it, or None when its call does not run on the kernel."""
        if isinstance(module, QuantizedLinear):
            bias = module.bias
            if module.weight_format not in linear_kernel.FORMAT_CODES or (
                bias is not None and not _is_float32_rows(bias)
            ):
                return None  # fp8 runs through torch's scaled matmul, not this kernel
            return _Linear(
                linear_kernel.FORMAT_CODES[module.weight_format],
                int(module.quantize_activations),
                module.out_features,
                module.in_features,
                module.packed.nbytes,
                self.pointer(module.packed),
                self.pointer(module.scales),
                self.pointer(module.mins),
                self.pointer(bias),
            )
        panelled = packed_linear.panelled_weight(module)
        if panelled is None:
            return None
        weight, bias = module.weight, module.bias
        if weight.dtype != torch.float32 or (bias is not None and not _is_float32_rows(bias)):
            return None
        panels = panelled.current(weight)
        return _Linear(
            linear_kernel.FLOAT32_CODE,
            0,
            module.out_features,
            module.in_features,
            panels.nbytes,
            panels.data_ptr(),
            None,
            None,
            self.pointer(None if bias is None else bias.detach()),
        )

    def point_at_current_panels(self) -> None:
        """Points every float32 layer at its panels as they are now (see the module's invariant)."""
        for described, module, panelled in self.panelled:
            described.packed = panelled.current(module.weight).data_ptr()

    def norm(self, module: Any) -> int | None:
        weight = module.weight.detach()
        return self.pointer(weight) if _is_float32_rows(weight) else None


def _pointers(tensors: list[torch.Tensor]) -> ctypes.Array[ctypes.c_void_p]:
    return (_pointer * len(tensors))(*(tensor.data_ptr() for tensor in tensors))


def _integers(values: list[int]) -> ctypes.Array[ctypes.c_int64]:
    return (_int64 * len(values))(*values)


class DecoderLayers:
    """Runs every decoder layer of a supported model's step in one C call (see the module docstring).

    `build` returns None for a model some of whose layers the C code cannot run as their own calls would;
    `serves` says whether a step runs here.

    The steps' intermediates live in one scratch tensor kept from step to step, grown to the largest step
    so far (at most `max_batch_tokens` rows: SmolLM2 needs 23 KB a row, 47 MB at 2,048 rows)."""

    def __init__(
        self, decoder: _Decoder, layers: ctypes.Array[_Layer], plan: _Plan, scratch_floats_per_row: int
    ) -> None:
        self._decoder = decoder
        self._layers = layers
        self._plan = plan
        self._scratch_floats_per_row = scratch_floats_per_row
        self._scratch = torch.empty(0, dtype=torch.float32)

    @classmethod
    def build(cls, model: Any) -> DecoderLayers | None:
        """The plan for `model`, a model `decoder_forward.unsupported_reason` accepts, or None when one of
        its linear layers does not run on the linear kernel (neither quantized nor installed by
        `PackedLinears` with the kernel on: wrapped by another library, say), a weight the kernel cannot
        read as it lies, or the kernels cannot be built."""
        config, inner = model.config, model.model
        decoder_layers = inner.layers[: config.num_hidden_layers]
        plan = _Plan()
        layers = (_Layer * len(decoder_layers))()
        for layer, target in zip(decoder_layers, layers, strict=True):
            attention, mlp = layer.self_attn, layer.mlp
            modules = (
                attention.q_proj,
                attention.k_proj,
                attention.v_proj,
                attention.o_proj,
                mlp.gate_proj,
                mlp.up_proj,
                mlp.down_proj,
            )
            for name, module in zip(_PROJECTIONS, modules, strict=True):
                described = plan.linear(module)
                if described is None:
                    return None
                setattr(target, name, described)
                panelled = packed_linear.panelled_weight(module)
                if panelled is not None:
                    # The field, not `described`: setattr copied the struct into the layer's.
                    plan.panelled.append((getattr(target, name), module, panelled))
            norms = [
                ("input_norm", layer.input_layernorm),
                ("post_attention_norm", layer.post_attention_layernorm),
            ]
            if hasattr(attention, "q_norm"):
                norms += [("query_norm", attention.q_norm), ("key_norm", attention.k_norm)]
            for name, norm in norms:
                pointer = plan.norm(norm)
                if pointer is None:
                    return None
                setattr(target, name, pointer)
                setattr(target, f"{name}_eps", norm.variance_epsilon)
            target.scale = attention.scaling
        try:
            linear_function = linear_kernel.load().quantized_linear
            attention_function = paged_attention_cpu.kernel_library().paged_attention
        except KernelUnavailable:
            return None
        decoder = _Decoder(
            len(decoder_layers),
            config.hidden_size,
            decoder_layers[0].self_attn.config.num_attention_heads,
            decoder_layers[0].self_attn.config.num_key_value_heads,
            decoder_layers[0].self_attn.head_dim,
            decoder_layers[0].mlp.intermediate_size,
            linear_kernel.MIN_WORK_PER_THREAD,
            ctypes.cast(linear_function, _pointer).value,
            ctypes.cast(attention_function, _pointer).value,
        )
        try:
            scratch_floats_per_row = fused_ops.load().decoder_scratch_floats(ctypes.addressof(decoder))
        except KernelUnavailable:
            return None
        return cls(decoder, layers, plan, scratch_floats_per_row)

    def serves(self, attention_kernel: Callable[..., torch.Tensor] | None) -> bool:
        """Whether a step attending through `attention_kernel` runs here: the C code calls the CPU kernel
        itself, so a step on another (Triton's, a wrapper) runs the loop."""
        return attention_kernel is _CPU_ATTENTION

    def run(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, metadata: PagedAttentionMetadata
    ) -> None:
        """Every layer on `hidden` [T, width] (the embeddings, contiguous), in place: afterwards it holds
        the residual stream the final norm reads. `cos` and `sin` [T, head_dim] are the rows' rotary
        angles, unit stride along head_dim; `metadata` is on the kernel path."""
        inputs = metadata.kernel_inputs
        assert inputs is not None and hidden.is_contiguous(), "the C code reads rows of `width` floats"
        self._plan.point_at_current_panels()
        scratch_floats = hidden.shape[0] * self._scratch_floats_per_row
        if self._scratch.numel() < scratch_floats:
            self._scratch = torch.empty(scratch_floats, dtype=torch.float32)
        num_layers = len(self._layers)
        key_caches, value_caches = metadata.key_caches[:num_layers], metadata.value_caches[:num_layers]
        block_tables = [
            table if table.stride(1) == 1 else table.contiguous() for table in inputs.block_tables
        ]
        # Every array the step points to stays referenced by a local until the call returns.
        key_pointers, value_pointers = _pointers(key_caches), _pointers(value_caches)
        layer_groups = _integers(metadata.layer_groups[:num_layers])
        write_slots, table_pointers = _pointers(metadata.write_slots), _pointers(block_tables)
        table_strides = _integers([table.stride(0) for table in block_tables])
        sliding_windows = _integers(
            [
                paged_attention_cpu.NO_WINDOW if window is None else window
                for window in metadata.sliding_windows
            ]
        )
        step = _StepInputs(
            hidden.shape[0],
            hidden.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            cos.stride(0),
            ctypes.addressof(key_pointers),
            ctypes.addressof(value_pointers),
            ctypes.addressof(layer_groups),
            key_caches[0].shape[0],
            ctypes.addressof(write_slots),
            ctypes.addressof(table_pointers),
            ctypes.addressof(table_strides),
            ctypes.addressof(sliding_windows),
            inputs.query_starts.data_ptr(),
            inputs.seq_lens.data_ptr(),
            inputs.tile_requests.data_ptr(),
            inputs.tile_offsets.data_ptr(),
            inputs.tile_requests.shape[0],
            inputs.queries_per_tile,
            metadata.page_size,
            int(inputs.has_unowned_rows),
            torch.get_num_threads(),
            self._scratch.data_ptr(),
        )
        status = fused_ops.load().decoder_layers(
            ctypes.addressof(self._decoder), ctypes.addressof(self._layers), ctypes.addressof(step)
        )
        if status == 1:
            raise MemoryError("decoder layers: a kernel could not allocate its scratch buffers")
        if status != 0:
            raise IndexError("decoder layers: a write slot lies outside the KV caches")
