"""The C kernel for linear layers on quantized weights (`quantized_linear_cpu.c`), called via ctypes.

Measured against torch's own CPU kernels on SmolLM2's shapes (bench/quantization.py): on this AVX2 CPU
`aten._weight_int8pack_mm` and `aten._weight_int4pack_mm_for_cpu` ran several times slower than `F.linear`
in float32, so neither reaches the weight-reading floor; this kernel reads the packed weights once per call
and dequantizes them a few channels at a time in cache. Built like the attention kernel
(engine.system.native_library). No compiler, no kernel: quantizing then fails with a message saying so
(dequantizing every weight on every call would be slower than not quantizing).
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import torch

from engine.system.native_library import KernelUnavailable, load_library

SOURCE = Path(__file__).with_name("quantized_linear_cpu.c")
# No -fassociative-math: each output's sum runs in the order the source writes it, so a row's result does
# not depend on how many rows share the call.
COMPILE_FLAGS = (
    "-O3",
    "-march=native",
    "-fopenmp",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-shared",
    "-fPIC",
)
FORMAT_CODES = {"int8": 0, "int4": 1}
# Rows up to which `quantize_activations` takes the integer path (INTEGER_MAX_ROWS in the source).
INTEGER_MAX_ROWS = 4
# A float32 weight in the kernel's panels (`float32_panels`, `float_linear`).
FLOAT32_CODE = 2
# Bytes of packed weight times rows that make one thread's share of a call. A call forks and joins a team
# of threads, which costs more than a second thread saves on a tiny layer. Beside busy neighbours the
# thread budget (engine.system.thread_budget) already runs eager steps on fewer threads, and every call then
# takes that many at most. On the 2-core EPYC, quiet, SmolLM2's 211 layers at one row took 41.7 ms in int8
# and 28.1 ms in int4 with this bound at 1 MiB (two threads only for the output layer and the MLP's),
# 29.1 and 20.6 ms at 64 KiB, 28.4 and 20.3 ms with two threads on every layer.
MIN_WORK_PER_THREAD = 1 << 16

_int64, _pointer = ctypes.c_int64, ctypes.c_void_p
_ARGUMENT_TYPES: list[Any] = [
    ctypes.c_int,  # format
    _pointer, _int64, _int64,  # x, rows, row stride
    _pointer, _pointer, _pointer,  # packed, scales, mins (NULL for int8; both NULL for float32)
    _int64, _int64,  # out_features, in_features
    _pointer,  # bias (NULL: none)
    _pointer, _int64,  # output, row stride
    ctypes.c_int,  # quantize activations (int8 and int4 calls of a few rows)
    ctypes.c_int,  # threads
]  # fmt: skip


_PACK_ARGUMENT_TYPES: list[Any] = [_pointer, _int64, _int64, _pointer, ctypes.c_int]


def load() -> ctypes.CDLL:
    """The built kernel; raises engine.system.native_library.KernelUnavailable when it cannot be built."""
    return load_library(
        SOURCE,
        COMPILE_FLAGS,
        {
            "quantized_linear": _ARGUMENT_TYPES,
            "pack_float32_panels": _PACK_ARGUMENT_TYPES,
            "float32_panel_channels": [],
        },
    )


def available() -> bool:
    """Whether the kernel is built or builds here (a built one is loaded once per process)."""
    try:
        load()
    except KernelUnavailable:
        return False
    return True


def panel_channels() -> int:
    """The output channels a float32 panel holds (PANEL in the source): 32 where the kernel is built for
    AVX-512, 16 for AVX2. A panelled weight has that many rows of [in, PANEL] per panel, the last panel
    padded with zero channels."""
    return int(load().float32_panel_channels())


def float32_panels_shape(out_features: int, in_features: int) -> tuple[int, int, int]:
    """The shape of a [out_features, in_features] float32 weight's panels (`float32_panels`)."""
    panel = panel_channels()
    return ((out_features + panel - 1) // panel, in_features, panel)


def float32_panels(weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 `weight` [out, in] in the kernel's panels ([ceil(out / PANEL), in, PANEL] with PANEL
    `panel_channels()`, channels past `out` zero), written into `out` when given (a tensor of that shape: a
    repack keeps the storage that callers hold pointers to)."""
    if weight.dtype != torch.float32 or weight.dim() != 2:
        raise ValueError(
            f"float32_panels: weight must be a 2-d float32 tensor, got {weight.dtype} {tuple(weight.shape)}"
        )
    out_features, in_features = weight.shape
    shape = float32_panels_shape(out_features, in_features)
    if out is None:
        out = torch.empty(shape, dtype=torch.float32)
    elif tuple(out.shape) != shape or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"float32_panels: out must be a contiguous float32 tensor of shape {shape}")
    source = weight.detach().contiguous()
    load().pack_float32_panels(
        source.data_ptr(), out_features, in_features, out.data_ptr(), torch.get_num_threads()
    )
    return out


def _pointer_of(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def quantized_matmul(
    inputs: torch.Tensor,
    weight_format: int,
    packed: torch.Tensor,
    scales: torch.Tensor | None,
    mins: torch.Tensor | None,
    bias: torch.Tensor | None,
    quantize_activations: bool = False,
    out_features: int | None = None,
) -> torch.Tensor:
    """inputs [rows, in] float32 (unit stride along in) -> [rows, out] float32: inputs @ w.T + bias, for the
    weight `packed`/`scales`/`mins` of format code `weight_format` (`FORMAT_CODES`, or `FLOAT32_CODE` with
    `packed` the weight's panels (`float32_panels`) and no scales; `out_features` then names the weight's
    rows, which the panels round up). With `quantize_activations`, an int8 or int4 call of at most
    INTEGER_MAX_ROWS rows multiplies int8 inputs in integers (see the kernel's header)."""
    library = load()
    rows, in_features = inputs.shape
    out_features = packed.shape[0] if out_features is None else out_features
    output = torch.empty(rows, out_features, dtype=torch.float32)
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        bias = bias.detach().to(torch.float32).contiguous()
    status = library.quantized_linear(
        weight_format,
        inputs.data_ptr(),
        rows,
        inputs.stride(0),
        packed.data_ptr(),
        _pointer_of(scales),
        _pointer_of(mins),
        out_features,
        in_features,
        _pointer_of(bias),
        output.data_ptr(),
        output.stride(0),
        int(quantize_activations),
        max(1, min(torch.get_num_threads(), packed.nbytes * rows // MIN_WORK_PER_THREAD)),
    )
    if status != 0:
        raise MemoryError("quantized linear: the kernel could not allocate its scratch buffers")
    return output


def float_linear(
    inputs: torch.Tensor, panels: torch.Tensor, out_features: int, bias: torch.Tensor | None
) -> torch.Tensor:
    """`F.linear(inputs, weight, bias)` for the float32 weight [out_features, in] whose panels
    (`float32_panels`) are `panels`, on the thread budget's threads; a row's result does not depend on the
    other rows of the call."""
    return on_rows(inputs, FLOAT32_CODE, panels, None, None, bias, out_features=out_features)


def on_rows(
    inputs: torch.Tensor,
    weight_format: int,
    packed: torch.Tensor,
    scales: torch.Tensor | None,
    mins: torch.Tensor | None,
    bias: torch.Tensor | None,
    quantize_activations: bool = False,
    out_features: int | None = None,
) -> torch.Tensor:
    """`quantized_matmul` on `inputs` of any leading dims and float dtype, returned in that dtype. A layer
    calls this once per step of every request, so it does no more than the call needs (no copy of inputs
    already in shape)."""
    out_features = packed.shape[0] if out_features is None else out_features
    leading = inputs.shape[:-1]
    rows = inputs.reshape(-1, inputs.shape[-1])
    if rows.dtype != torch.float32:
        rows = rows.to(torch.float32)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    matmul = quantized_matmul_op if torch.compiler.is_compiling() else quantized_matmul
    output = matmul(rows, weight_format, packed, scales, mins, bias, quantize_activations, out_features).view(
        *leading, out_features
    )
    return output if output.dtype == inputs.dtype else output.to(inputs.dtype)


# A custom op, so that compiled graphs call the kernel as one opaque node.
quantized_matmul_op = torch.library.custom_op(
    "cbserve::quantized_matmul_cpu", mutates_args=(), device_types="cpu"
)(quantized_matmul)


@quantized_matmul_op.register_fake
def _(
    inputs: torch.Tensor,
    weight_format: int,
    packed: torch.Tensor,
    scales: torch.Tensor | None,
    mins: torch.Tensor | None,
    bias: torch.Tensor | None,
    quantize_activations: bool = False,
    out_features: int | None = None,
) -> torch.Tensor:
    return inputs.new_empty(inputs.shape[0], packed.shape[0] if out_features is None else out_features)
