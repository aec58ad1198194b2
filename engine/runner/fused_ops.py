"""The norms, rotary embedding and gated activation of a decoder layer as one C call each
(`fused_ops_cpu.c`), for `engine.runner.decoder_forward`.

Run as torch operators, an RMSNorm is six of them and a rotary embedding about a dozen, each a few
microseconds of dispatch for a one-token row of a few hundred floats: on SmolLM2-135M (30 layers) they
took about 3 ms of a 35 ms decode step on the 2-core EPYC. One call each does the same arithmetic in
about 2 us. Float32 only, built like the other kernels (engine.system.native_library).
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import torch

from engine.system.native_library import load_library

SOURCE = Path(__file__).with_name("fused_ops_cpu.c")
# No contraction into fused multiply-adds: torch rounds each product and each sum (see the source).
COMPILE_FLAGS = (
    "-O3",
    "-march=native",
    "-fopenmp",
    "-ffp-contract=off",
    "-fno-math-errno",
    # No trapping on floating-point exceptions (nothing here traps): lets the silu's selects vectorise.
    "-fno-trapping-math",
    "-shared",
    "-fPIC",
)

_int64, _pointer, _float, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
_SIGNATURES: dict[str, list[Any]] = {
    # hidden and stride, addend and stride (NULL: none), weight, rows, width, eps, out and stride, threads
    "rms_norm": [_pointer, _int64, _pointer, _int64, _pointer,
                 _int64, _int64, _float, _pointer, _int64, _int],
    # x, rows, heads, row and head strides, head_dim, cos, sin, their row stride, threads
    "rotary": [_pointer, _int64, _int64, _int64, _int64, _int64, _pointer, _pointer, _int64, _int],
    # gate and stride, up and stride, rows, width, out and stride, threads
    "silu_and_mul": [_pointer, _int64, _pointer, _int64, _int64, _int64, _pointer, _int64, _int],
    # the Decoder, its Layer array and the StepInputs (engine.runner.decoder_layers)
    "decoder_layers": [_pointer, _pointer, _pointer],
    # the Decoder: floats of scratch per row decoder_layers needs
    "decoder_scratch_floats": [_pointer],
}  # fmt: skip


def load() -> ctypes.CDLL:
    """The built library; raises engine.system.native_library.KernelUnavailable when it cannot be built."""
    return load_library(SOURCE, COMPILE_FLAGS, _SIGNATURES)


def rms_norm(
    hidden: torch.Tensor, weight: torch.Tensor, eps: float, addend: torch.Tensor | None = None
) -> torch.Tensor:
    """`weight * (hidden * rsqrt(mean(hidden^2) + eps))` over the last axis of a [rows, width] `hidden`;
    with `addend`, `hidden += addend` first, in place (the residual connection feeding the norm)."""
    rows, width = hidden.shape
    output = torch.empty(rows, width, dtype=torch.float32)
    load().rms_norm(
        hidden.data_ptr(),
        hidden.stride(0),
        None if addend is None else addend.data_ptr(),
        0 if addend is None else addend.stride(0),
        weight.data_ptr(),
        rows,
        width,
        eps,
        output.data_ptr(),
        output.stride(0),
        torch.get_num_threads(),
    )
    return output


def rotary(vectors: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotates `vectors` [rows, heads, head_dim] in place by the rows' `cos` and `sin` [rows, head_dim]
    (transformers' `apply_rotary_pos_emb` on one of query or key)."""
    rows, heads, head_dim = vectors.shape
    load().rotary(
        vectors.data_ptr(),
        rows,
        heads,
        vectors.stride(0),
        vectors.stride(1),
        head_dim,
        cos.data_ptr(),
        sin.data_ptr(),
        cos.stride(0),
        torch.get_num_threads(),
    )


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` for [rows, width] `gate` and `up`."""
    rows, width = gate.shape
    output = torch.empty(rows, width, dtype=torch.float32)
    load().silu_and_mul(
        gate.data_ptr(),
        gate.stride(0),
        up.data_ptr(),
        up.stride(0),
        rows,
        width,
        output.data_ptr(),
        output.stride(0),
        torch.get_num_threads(),
    )
    return output
