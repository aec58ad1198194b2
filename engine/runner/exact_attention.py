"""Attention for a plain forward that computes what the engine's batch-invariant steps compute
(`engine.trainer_exact`): the engine's own attention kernel with `fixed_order`, over the forward's keys
laid out as one page per sequence, and an eager backward.

In batch-invariant mode a query's output depends on its own keys and values alone, not on the tile that
serves it or the cache's layout, so a whole-sequence forward through the same kernel gives every
position the bits the engine gave it, whether that position came in a prefill chunk or a decode step.
The backward recomputes attention with ordinary tensor operations: gradients need no particular bits.

Registered in transformers' attention and mask interfaces as `cbserve|exact`. While the engine owns the
model (its paged attention is set), `trainer_exact` leaves the implementation alone and the paged
attention's plain-forward path calls `exact_attention` on the thread inside `exact_forward()`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from engine.runner.attention import PREFILL_QUERIES_PER_TILE

EXACT_ATTENTION = "cbserve|exact"

_state = threading.local()


@contextlib.contextmanager
def exact_forward() -> Iterator[None]:
    """Marks forwards on this thread as exact ones (nestable)."""
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1


def exact_forward_active() -> bool:
    return getattr(_state, "depth", 0) > 0


def _kernel(device: torch.device, dtype: torch.dtype) -> Callable[..., torch.Tensor]:
    if device.type == "cuda":
        from engine.runner.paged_attention_kernel import paged_attention

        return paged_attention
    from engine.runner import paged_attention_cpu

    kernel = paged_attention_cpu.load(dtype)
    if kernel is None:
        raise RuntimeError(
            f"trainer_exact needs the engine's CPU attention kernel for {dtype}, which is unavailable here "
            "(the log says why: no C compiler, or a dtype other than float32 and bfloat16)"
        )
    return kernel


def _kernel_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    softcap: float | None,
    sliding_window: int | None,
) -> torch.Tensor:
    """query [B, H, S, D], key/value [B, H_kv, S, D] -> [B, S, H, D], causal per sequence.

    Sequence b is request b of one kernel call; its keys are page b, `S` slots long."""
    batch, num_heads, length, head_dim = query.shape
    num_kv_heads = key.shape[1]
    device = query.device
    rows = query.transpose(1, 2).reshape(batch * length, num_heads, head_dim).contiguous()
    keys = key.transpose(1, 2).reshape(batch * length, num_kv_heads, head_dim).contiguous()
    values = value.transpose(1, 2).reshape(batch * length, num_kv_heads, head_dim).contiguous()
    offsets = list(range(0, length, PREFILL_QUERIES_PER_TILE))

    def int32(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)

    output = _kernel(device, query.dtype)(
        rows,
        keys,
        values,
        torch.arange(batch, dtype=torch.int32, device=device).unsqueeze(1),
        int32([sequence * length for sequence in range(batch + 1)]),
        int32([length] * batch),
        int32([sequence for sequence in range(batch) for _ in offsets]),
        int32(offsets * batch),
        PREFILL_QUERIES_PER_TILE,
        length,
        scale,
        softcap,
        sliding_window,
        False,
        True,
    )
    return output.view(batch, length, num_heads, head_dim)


def _eager_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    softcap: float | None,
    sliding_window: int | None,
) -> torch.Tensor:
    """The same attention in ordinary (differentiable) tensor operations, in fp32: [B, S, H, D]."""
    group_size = query.shape[1] // key.shape[1]
    keys = key.float().repeat_interleave(group_size, dim=1)
    values = value.float().repeat_interleave(group_size, dim=1)
    scores = torch.matmul(query.float(), keys.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    length = query.shape[2]
    positions = torch.arange(length, device=query.device)
    allowed = positions[None, :] <= positions[:, None]
    if sliding_window is not None:
        allowed &= positions[None, :] > positions[:, None] - sliding_window
    scores = scores.masked_fill(~allowed, float("-inf"))
    attended = torch.matmul(torch.softmax(scores, dim=-1), values)
    return attended.transpose(1, 2).to(query.dtype)


class _ExactAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float,
        softcap: float | None,
        sliding_window: int | None,
    ) -> torch.Tensor:
        ctx.save_for_backward(query, key, value)
        ctx.settings = (scale, softcap, sliding_window)
        return _kernel_attention(query, key, value, scale, softcap, sliding_window)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        inputs = [
            tensor.detach().requires_grad_(needed)
            for tensor, needed in zip(ctx.saved_tensors, ctx.needs_input_grad[:3], strict=True)
        ]
        with torch.enable_grad():
            output = _eager_attention(*inputs, *ctx.settings)
        wanted = [tensor for tensor in inputs if tensor.requires_grad]
        grads = iter(torch.autograd.grad(output, wanted, grad_output))
        return (*(next(grads) if tensor.requires_grad else None for tensor in inputs), None, None, None)


def exact_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: query [B, H, S, D], key/value [B, H_kv, S, D] ->
    ([B, S, H, D], None). Causal over each whole sequence (with the layer's sliding window and softcap);
    `attention_mask` is not read (`exact_mask` refuses padding masks)."""
    if dropout:
        raise ValueError(f"trainer_exact: attention dropout must be off, got {dropout}; call model.eval()")
    if kwargs.get("s_aux") is not None:
        raise ValueError("trainer_exact does not compute attention sinks (gpt-oss): its backward has none")
    layer_kinds = getattr(getattr(module, "config", None), "layer_types", None) or ()
    if "chunked_attention" in layer_kinds:
        raise ValueError("trainer_exact does not compute chunked attention (Llama 4): it attends causally")
    if key.shape[2] != query.shape[2]:
        raise ValueError(
            f"trainer_exact computes whole sequences without a KV cache: {query.shape[2]} queries against "
            f"{key.shape[2]} keys; pass the full sequences and use_cache=False"
        )
    scale = scaling if scaling is not None else query.shape[3] ** -0.5
    if torch.is_grad_enabled() and any(tensor.requires_grad for tensor in (query, key, value)):
        output = _ExactAttention.apply(query, key, value, scale, softcap, sliding_window)
    else:
        output = _kernel_attention(query, key, value, scale, softcap, sliding_window)
    return output, None


def exact_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Any = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> None:
    """The mask function of `cbserve|exact`: no mask (the kernel is causal by itself); a padding mask
    with zeros is refused, since a left-padded sequence's positions would not be the engine's."""
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError(
            "trainer_exact takes sequences without padding masks: right-pad them and pass no "
            "attention_mask (a causal query never sees the padding after it), or use "
            "engine.sequence_logprobs, which does"
        )
    return None


def register_exact_attention() -> None:
    """Registers `cbserve|exact` in transformers' attention and mask interfaces (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(EXACT_ATTENTION, exact_attention)
    AttentionMaskInterface.register(EXACT_ATTENTION, exact_mask)
