"""The CPU kernel for paged attention (`paged_attention_cpu.c`), built on first use and called via ctypes.

On the CPU the gather path (`attention.attend`) is memory-bound three times over: it copies every key and
value of the step into dense tensors, reads the copies again in SDPA, and builds a mask as large as the
scores. This kernel reads each request's keys once, in place, through its block table, with the same
contract as the Triton kernel (`paged_attention_kernel.paged_attention`), so it plugs into the kernel
path (`attention.KernelInputs`) unchanged.

It is C compiled by the machine's own compiler with `-march=native`, once per machine
(engine.system.native_library). Without a working compiler, `load` returns None and steps gather their
keys, as before.
"""

from __future__ import annotations

import ctypes
import logging
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine.runner.attention import kernel_queries_and_output
from engine.system.native_library import KernelUnavailable, load_library

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_attention_cpu.c")
# -fopenmp links libgomp.so.1, which resolves to the copy torch has already loaded: one worker team.
# The math flags let reductions reassociate; no -ffast-math, which would assume no infinities (the
# softmax starts from -inf) and, linked into a shared library, set flush-to-zero for the whole process.
# GCC's loop interchange and unroll-and-jam turn the vectorised accumulator loop into a scalar one.
# On x86, GCC keeps to 256-bit vectors on some AVX-512 CPUs unless told otherwise (an x86-only flag).
_VECTOR_WIDTH_FLAGS = ("-mprefer-vector-width=512",) if platform.machine() in ("x86_64", "AMD64") else ()
COMPILE_FLAGS = (
    "-O3",
    "-march=native",
    *_VECTOR_WIDTH_FLAGS,
    "-fopenmp",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-fno-loop-interchange",
    "-fno-loop-unroll-and-jam",
    "-shared",
    "-fPIC",
)
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}

_int64, _pointer = ctypes.c_int64, ctypes.c_void_p
_ARGUMENT_TYPES: list[Any] = [
    ctypes.c_int,  # dtype
    _pointer, _int64, _int64,  # queries, row and head strides
    _pointer, _pointer, _int64, _int64,  # key and value caches, slot and head strides
    _pointer, _int64,  # block table, row stride
    _pointer, _pointer, _pointer, _pointer, _int64,  # query starts, seq lens, tile requests, offsets, count
    _pointer, _int64, _int64,  # output, row and head strides
    _int64, _int64, _int64, _int64, _int64,  # kv heads, group size, head dim, queries per tile, page size
    ctypes.c_float, ctypes.c_float, _int64, _int64,  # scale, softcap (<= 0: none), sliding window, chunk
    ctypes.c_int, _pointer, _pointer, ctypes.c_int,  # fixed order, sinks, ALiBi slopes (NULL: none), threads
]  # fmt: skip
# Stands for "no sliding window": larger than any position.
NO_WINDOW = 1 << 62


def kernel_library() -> ctypes.CDLL:
    """The built kernel; raises engine.system.native_library.KernelUnavailable when it cannot be built."""
    return load_library(SOURCE, COMPILE_FLAGS, {"paged_attention": _ARGUMENT_TYPES})


def load(dtype: torch.dtype) -> Callable[..., torch.Tensor] | None:
    """The kernel for caches of `dtype`, or None (logged) when it cannot serve them here."""
    if dtype not in DTYPE_CODES:
        logger.info(
            "the CPU attention kernel takes float32 and bfloat16, not %s; steps gather their keys", dtype
        )
        return None
    try:
        kernel_library()
    except (KernelUnavailable, OSError) as error:
        logger.warning("the CPU attention kernel is unavailable (%s); steps gather their keys", error)
        return None
    return paged_attention


def paged_attention(*args: Any, **kwargs: Any) -> torch.Tensor:
    """`attend_in_place`, as the engine's forwards call it: inside a compiled graph through the custom op
    (one opaque node); run eagerly, directly, without the op's dispatch, which costs about 25 us a call
    (once per layer and step: 0.1 s of an eager SmolLM2 benchmark's 15 s)."""
    if torch.compiler.is_compiling():
        return paged_attention_op(*args, **kwargs)
    return attend_in_place(*args, **kwargs)


def attend_in_place(
    queries: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_starts: torch.Tensor,
    seq_lens: torch.Tensor,
    tile_requests: torch.Tensor,
    tile_offsets: torch.Tensor,
    queries_per_tile: int,
    page_size: int,
    scale: float,
    softcap: float | None,
    sliding_window: int | None,
    has_unowned_rows: bool = False,
    fixed_order: bool = False,
    sinks: torch.Tensor | None = None,
    attention_chunk: int | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """queries [T, H, D] -> [T, H, D]; the contract of `paged_attention_kernel.paged_attention`.

    Caches are [num_slots, H_kv, D] with unit stride along D; index tensors are int32 and contiguous.
    With `fixed_order`, each query's output has the same bits whatever tile serves it (batch-invariant
    mode; see the kernel's header).
    """
    library = kernel_library()
    if value_cache.stride() != key_cache.stride() or key_cache.stride(2) != 1 or block_table.stride(1) != 1:
        raise ValueError("paged attention: caches need equal strides and unit stride along head_dim")
    num_heads, head_dim = queries.shape[1], queries.shape[2]
    num_kv_heads = key_cache.shape[1]
    queries, output = kernel_queries_and_output(queries, has_unowned_rows)
    # Read as float32 whatever the model's dtype; held here until the call returns.
    sink_logits = sinks.float().contiguous() if sinks is not None else None
    slopes = alibi_slopes.float().contiguous() if alibi_slopes is not None else None
    status = library.paged_attention(
        DTYPE_CODES[queries.dtype],
        queries.data_ptr(),
        queries.stride(0),
        queries.stride(1),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        key_cache.stride(0),
        key_cache.stride(1),
        block_table.data_ptr(),
        block_table.stride(0),
        query_starts.data_ptr(),
        seq_lens.data_ptr(),
        tile_requests.data_ptr(),
        tile_offsets.data_ptr(),
        tile_requests.shape[0],
        output.data_ptr(),
        output.stride(0),
        output.stride(1),
        num_kv_heads,
        num_heads // num_kv_heads,
        head_dim,
        queries_per_tile,
        page_size,
        scale,
        softcap if softcap is not None else 0.0,
        sliding_window if sliding_window is not None else NO_WINDOW,
        attention_chunk if attention_chunk is not None else NO_WINDOW,
        int(fixed_order),
        sink_logits.data_ptr() if sink_logits is not None else None,
        slopes.data_ptr() if slopes is not None else None,
        torch.get_num_threads(),
    )
    if status != 0:
        raise MemoryError("paged attention: a worker thread could not allocate its scratch buffers")
    return output


# A custom op, so that compiled graphs (even fullgraph ones) call it as one opaque node.
paged_attention_op = torch.library.custom_op(
    "cbserve::paged_attention_cpu", mutates_args=(), device_types="cpu"
)(attend_in_place)


@paged_attention_op.register_fake
def _(queries: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return torch.empty_like(queries, memory_format=torch.contiguous_format)
