"""Batch-invariant mode: a request's bits do not depend on what else runs with it, and a trainer holding
the same model computes the same bits (`trainer_exact`).

What varies in the default mode, measured with `bench/batch_invariance.py` (2-core AMD EPYC, AVX2,
torch 2.15, fp32; SmolLM2-135M and the tiny Llama's shapes): a token's row of a linear layer through
the BLAS (MKL) changes bits with the number of rows in the call, at every count from 2 to 2048; through
oneDNN on a plain weight, one row takes another kernel than two or more; through oneDNN on a weight
packed for it, never (1 to 3000 rows), and two or more rows on a plain weight give the packed bits. The
attention kernel computed a query's scores in a decode tile another way than in a prefill tile, and with
a sliding window started its chunks of keys at the tile's first key. RMSNorm, the activation, RoPE's
cos/sin, log_softmax and the sampler's reductions gave every row the same bits at every count. (The
default mode has since moved float32 linear layers to the engine's own kernel, whose panels give a row
the same bits at every count too: there, attention is what still varies.)

So this mode changes exactly those: every linear layer runs with a fixed order per row, float32 ones on
the engine's kernel's panels, others on oneDNN (the engine's packed weights, `engine.runner.packed_linear`;
elsewhere the same panels packed from the trainer's weights, or oneDNN on the plain weight with at least
two rows, `invariant_linear`), and attention runs on the kernel path with `fixed_order`. On CUDA, where
cuBLAS picks kernels (and split-K) by shape and torch's reductions split a row across threads when few
rows are reduced, the linear layers and the norms' means run on Triton kernels with one fixed tiling
(`engine.runner.batch_invariant_cuda`), and the attention kernel uses one tile shape for every step.

Under tensor parallelism, each rank's shard of a linear layer runs the same kernels, and the row-parallel
layers' partial sums are added across ranks: 2 ranks add once, which is exact whatever the collective's
algorithm, but over 3 or more a ring or tree all-reduce sums in an order that follows the message's size,
so there `all_reduce_in_rank_order` gathers every rank's part and adds them in rank order.

One condition holds for the models here but not for every model: torch's vector loops hand the elements
past a thread's last full vector to scalar code, which rounds transcendental functions (SiLU, GELU, cos)
differently, so those stay invariant while a row is a multiple of 16 floats wide (32 with two threads).

Trainer side: `trainer_exact(model)` routes a plain forward of the same model through the same kernels,
with gradients (the backward passes use ordinary matmuls and an eager attention), and
`sequence_logprobs` computes the per-token logprobs the engine returned for given sequences.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from engine.parallel import tensor_parallel_size
from engine.quantization import kernel as linear_kernel
from engine.runner.latent_attention import BATCH_INVARIANCE_GAP, latent_cache_width
from engine.runner.packed_linear import PanelledWeight

logger = logging.getLogger(__name__)

# Row counts the startup check compares with one row alone (`check_linear_invariance`), and the shapes
# (out, in, dtype, device type, packed) that passed it in this process.
CHECKED_ROW_COUNTS = (2, 3, 5, 16, 33)
_checked_shapes: set[tuple[int, int, torch.dtype, str, bool]] = set()
# Rows a plain-weight oneDNN call needs for the packed kernels' bits: one row takes another kernel.
MIN_ONEDNN_ROWS = 2


class BatchInvariantUnsupported(RuntimeError):
    """The batch-invariant kernels cannot serve this model here (its dtype, its device)."""


# The panels of the float32 weights `_fixed_order_linear` multiplied, by the weight's storage address and
# shape, with the tensor they were last asked for (weakly: an entry whose tensor is gone is dropped).
_PANELS: dict[tuple[int, torch.Size], tuple[weakref.ref[torch.Tensor], PanelledWeight]] = {}


def runs_on_panels(weight: torch.Tensor) -> bool:
    """Whether fixed-order linear layers of `weight` run on the engine's kernel's panels (float32 on the
    CPU, the kernel built), as the engine's packed layers do (engine.runner.packed_linear); else oneDNN."""
    return weight.dtype == torch.float32 and weight.device.type == "cpu" and linear_kernel.available()


def _panel_linear(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The engine's float32 kernel on `weight`'s panels, packed again only when the weight changed (a
    trainer's optimizer step moves its version)."""
    key = (weight.data_ptr(), weight.shape)
    entry = _PANELS.get(key)
    if entry is None or entry[0]() is None:
        for stale in [stale for stale, (source, _) in _PANELS.items() if source() is None]:
            del _PANELS[stale]
        entry = _PANELS[key] = (weakref.ref(weight), PanelledWeight())
    return linear_kernel.float_linear(rows, entry[1].current(weight), weight.shape[0], bias)


def _onednn_linear(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's inner product of [M, K] rows (M >= 1) with a plain [N, K] weight, in the packed kernels'
    order: a single row is padded to two."""
    if rows.shape[0] >= MIN_ONEDNN_ROWS:
        return torch.ops.mkldnn._linear_pointwise(rows, weight, bias, "none", [], "")
    padded = torch.cat([rows, rows.new_zeros((MIN_ONEDNN_ROWS - rows.shape[0], rows.shape[1]))])
    return torch.ops.mkldnn._linear_pointwise(padded, weight, bias, "none", [], "")[: rows.shape[0]]


def _fixed_order_linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear` with a reduction order per row that does not depend on the other rows (no autograd)."""
    rows = input.reshape(-1, input.shape[-1])
    if input.device.type == "cuda":
        from engine.runner.batch_invariant_cuda import matmul

        output = matmul(rows, weight, bias)
    elif input.device.type == "cpu" and input.dtype == weight.dtype and runs_on_panels(weight):
        # The weight itself, not a detached alias made anew each call: the panels are cached by tensor.
        output = _panel_linear(rows, weight, None if bias is None else bias.detach())
    elif input.device.type == "cpu":
        if input.dtype != weight.dtype or not torch.backends.mkldnn.is_available():
            raise BatchInvariantUnsupported(
                f"batch_invariant: a linear layer got {input.dtype} rows for a {weight.dtype} weight, or "
                "torch was built without oneDNN; the mode needs matching dtypes and oneDNN"
            )
        try:
            output = _onednn_linear(
                rows.contiguous(), weight.detach(), None if bias is None else bias.detach()
            )
        except RuntimeError as error:
            raise BatchInvariantUnsupported(
                f"batch_invariant: oneDNN cannot run a {weight.dtype} linear layer on this CPU ({error}); "
                "load the model in float32"
            ) from error
    else:
        raise BatchInvariantUnsupported(f"batch_invariant: no fixed-order linear kernel for {input.device}")
    return output.view(*input.shape[:-1], weight.shape[0])


class _FixedOrderLinear(torch.autograd.Function):
    """The fixed-order forward, with the ordinary backward of a linear layer (its bits do not matter)."""

    @staticmethod
    def forward(
        ctx: Any, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        ctx.save_for_backward(input, weight)
        ctx.has_bias = bias is not None
        return _fixed_order_linear(input, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        input, weight = ctx.saved_tensors
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_input = grad_output @ weight
        if ctx.needs_input_grad[1]:
            grad_weight = grad_output.reshape(-1, grad_output.shape[-1]).T @ input.reshape(
                -1, input.shape[-1]
            )
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(0)
        return grad_input, grad_weight, grad_bias


def invariant_linear(
    input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`F.linear(input, weight, bias)` whose every row has the same bits whatever the other rows are, and
    the same bits as the engine's batch-invariant steps; differentiable."""
    needs_grad = torch.is_grad_enabled() and any(
        tensor is not None and tensor.requires_grad for tensor in (input, weight, bias)
    )
    if needs_grad:
        return _FixedOrderLinear.apply(input, weight, bias)
    return _fixed_order_linear(input, weight, bias)


def _is_last_dim(dim: Any, ndim: int) -> bool:
    if isinstance(dim, (tuple, list)):
        if len(dim) != 1:
            return False
        dim = dim[0]
    return isinstance(dim, int) and dim in (-1, ndim - 1)


class BatchInvariantMode(TorchFunctionMode):
    """While active (on the thread that entered it), `F.linear` runs `invariant_linear`, and on CUDA a
    floating mean over the last dimension (the norms' `pow(2).mean(-1)`) runs a Triton kernel that reduces
    each row in one fixed order. Every other function runs as it is. `served` counts the calls it took."""

    def __init__(self) -> None:
        super().__init__()
        self.served = 0

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.linear:
            self.served += 1
            return invariant_linear(*args, **kwargs)
        if func in (torch.mean, torch.Tensor.mean) and args:
            reduced = self._row_mean(args, kwargs)
            if reduced is not None:
                self.served += 1
                return reduced
        return func(*args, **kwargs)

    @staticmethod
    def _row_mean(args: Sequence[Any], kwargs: dict[str, Any]) -> torch.Tensor | None:
        tensor = args[0]
        if (
            not isinstance(tensor, torch.Tensor)
            or tensor.device.type != "cuda"
            or not tensor.is_floating_point()
        ):
            return None
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
        if not _is_last_dim(dim, tensor.dim()) or kwargs.get("dtype") is not None or "out" in kwargs:
            return None
        from engine.runner.batch_invariant_cuda import row_mean

        return row_mean(tensor, keepdim=bool(keepdim))


_all_reduce_state = threading.local()
_plain_all_reduce: Callable[..., Any] | None = None
_patch_lock = threading.Lock()


def _all_reduce(
    tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None, async_op: bool = False
) -> Any:
    """`torch.distributed.all_reduce`; inside `all_reduce_in_rank_order` on this thread, a floating sum is
    gathered and added in rank order instead."""
    assert _plain_all_reduce is not None
    if (
        getattr(_all_reduce_state, "depth", 0) == 0
        or async_op
        or op != dist.ReduceOp.SUM
        or not tensor.is_floating_point()
    ):
        return _plain_all_reduce(tensor, op=op, group=group, async_op=async_op)
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    tensor.copy_(total)
    return None


@contextlib.contextmanager
def all_reduce_in_rank_order() -> Iterator[None]:
    """Within the block, on this thread, `torch.distributed.all_reduce` sums floating tensors in rank order:
    ((rank 0 + rank 1) + rank 2) + ..., the same bits on every rank and for every message size. It gathers
    every rank's part (world size times the data of one part), so it is for batch-invariant mode only.

    transformers' tensor-parallel layers call `torch.distributed.all_reduce` through the module, so the
    function is replaced there once, process-wide; outside such a block it is the plain collective."""
    global _plain_all_reduce
    with _patch_lock:
        if _plain_all_reduce is None:
            _plain_all_reduce = dist.all_reduce
            dist.all_reduce = _all_reduce
    _all_reduce_state.depth = getattr(_all_reduce_state, "depth", 0) + 1
    try:
        yield
    finally:
        _all_reduce_state.depth -= 1


@contextlib.contextmanager
def batch_invariant_forward(model: torch.nn.Module, mode: BatchInvariantMode | None = None) -> Iterator[None]:
    """What a batch-invariant forward of `model` runs under: `BatchInvariantMode` (`mode`, else a new one),
    and over 3 or more tensor-parallel ranks `all_reduce_in_rank_order`."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(mode if mode is not None else BatchInvariantMode())
        if tensor_parallel_size(model) > 2:
            stack.enter_context(all_reduce_in_rank_order())
        yield


class EngineForwards:
    """The context of each of the engine's forwards in batch-invariant mode.

    On the CPU the engine packs every linear layer (engine.runner.packed_linear), whose packed forwards
    already run the mode's kernels; the mode then only adds Python dispatch to every torch call (about 10 %
    of SmolLM2's steps). So on an unsharded CPU model the first forward runs under the mode and counts the
    calls it had to serve (an `F.linear` outside the packed layers); when there were none, later forwards
    run without it. Elsewhere (CUDA, where the norms' means need it too; a sharded model) every forward
    runs under it.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        on_cpu = next(model.parameters()).device.type == "cpu"
        # None: not known until the first forward.
        self.needed: bool | None = None if on_cpu and tensor_parallel_size(model) == 1 else True

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        if self.needed is False:
            yield
            return
        mode = BatchInvariantMode()
        with batch_invariant_forward(self.model, mode):
            yield
        if self.needed is None:
            self.needed = mode.served > 0
            logger.debug("batch_invariant: the first forward's mode served %d calls", mode.served)


def check_linear_invariance(model: torch.nn.Module, packed: bool) -> None:
    """Raises BatchInvariantUnsupported unless each distinct linear shape of `model` gives a row the same
    bits alone and among 2 to 33 rows, through the kernels the engine uses (`packed`: the engine's kernel
    on float32 panels, oneDNN on other packed weights; on CUDA the Triton matmul) and those `trainer_exact`
    uses (`invariant_linear`, which runs the same panels). Measured on
    one machine, checked on every one: another CPU may pick other kernels. A shape passes once per process
    (SmolLM2's five take 1.7 s on 2 cores, its vocabulary-wide head most). Sharded weights (tensor
    parallelism) are not checked."""
    shapes: dict[tuple[int, int, torch.dtype, torch.device], torch.Tensor] = {}
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and type(module.weight.detach()) is torch.Tensor:
            weight = module.weight
            shapes.setdefault((weight.shape[0], weight.shape[1], weight.dtype, weight.device), weight)
    generator = torch.Generator().manual_seed(0)
    for (out_features, in_features, dtype, device), weight in shapes.items():
        key = (out_features, in_features, dtype, device.type, packed)
        if key in _checked_shapes:
            continue
        rows = torch.randn(max(CHECKED_ROW_COUNTS), in_features, generator=generator).to(device, dtype)
        weight = weight.detach()
        kernels = {"invariant_linear": lambda x, w=weight: _fixed_order_linear(x, w, None)}
        if packed and device.type == "cpu" and not runs_on_panels(weight):
            try:
                packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, None)
            except RuntimeError as error:
                raise BatchInvariantUnsupported(
                    f"batch_invariant: oneDNN cannot pack a {dtype} weight on this CPU ({error}); "
                    "load the model in float32"
                ) from error
            kernels["packed oneDNN"] = lambda x, w=packed_weight: torch.ops.mkldnn._linear_pointwise(
                x, w, None, "none", [], ""
            )
        with torch.inference_mode():
            alone = _fixed_order_linear(rows[:1], weight, None)
            for name, kernel in kernels.items():
                for count in (1, *CHECKED_ROW_COUNTS):
                    first = kernel(rows[:count])[:1]
                    if not torch.equal(first, alone):
                        raise BatchInvariantUnsupported(
                            f"batch_invariant: on this machine, {name} gives a row of a {in_features}->"
                            f"{out_features} {dtype} linear layer other bits among {count} rows than alone "
                            f"(largest difference {(first - alone).abs().max().item():.3g}); the mode "
                            "cannot run here"
                        )
        _checked_shapes.add(key)


def check_table_width(config: Any, max_model_len: int | None) -> None:
    """Raises ValueError when a request could hold more blocks than the attention kernel takes
    (`max_blocks_per_request`): its steps would gather its keys, in another order. `max_model_len` None:
    the model states no bound, so only an unbounded width will do."""
    width = config.max_blocks_per_request
    if not width:
        return
    if max_model_len is None:
        raise ValueError(
            f"batch_invariant: max_blocks_per_request={width} bounds a request to "
            f"{width * config.page_size} tokens, but the model states no maximum length; leave it None"
        )
    if width * config.page_size < max_model_len:
        raise ValueError(
            f"batch_invariant: max_blocks_per_request={width} covers {width * config.page_size} tokens, "
            f"but a request may hold {max_model_len}; leave it None or set it to at least "
            f"{-(-max_model_len // config.page_size)}, so that every step runs the attention kernel"
        )


class _ExactForward:
    """What `trainer_exact` changed on one model, undone on exit."""

    def __init__(self, model: torch.nn.Module) -> None:
        from engine.runner.exact_attention import EXACT_ATTENTION, register_exact_attention

        register_exact_attention()
        self.model = model
        current = model.config._attn_implementation  # type: ignore[union-attr]
        # While the engine owns the model (its paged attention is set), switching the implementation would
        # change the engine's own steps: its paged attention serves plain forwards by the exact kernel
        # instead, on this thread only.
        self.shared_with_engine = isinstance(current, str) and current.startswith("cbserve|")
        self.previous = current
        if not self.shared_with_engine and current != EXACT_ATTENTION:
            model.set_attn_implementation(EXACT_ATTENTION)  # type: ignore[operator]

    def restore(self) -> None:
        if not self.shared_with_engine and self.previous != self.model.config._attn_implementation:  # type: ignore[union-attr]
            self.model.set_attn_implementation(self.previous)  # type: ignore[operator]


@contextlib.contextmanager
def trainer_exact(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Within the block, forwards of `model` on this thread compute what the engine computes in
    batch-invariant mode, bit for bit: linear layers through `invariant_linear`, attention through the
    engine's attention kernel in its fixed order (`engine.runner.exact_attention`), the rest as the model
    writes it. Gradients flow (the backward passes use ordinary matmuls and an eager attention), so a
    trainer's importance ratio against the server's logprobs is exactly 1 for the policy that sampled.

    The model must be the one the server runs (same weights, dtype and device type) and its forward a
    whole-sequence one: no KV cache, sequences unpadded or right-padded without an attention mask (a
    causal query never sees the padding after it). Dropout must be off (`model.eval()`, or a dropout of 0).
    Take logprobs as the engine does: `torch.log_softmax(logits.float(), dim=-1)`; `sequence_logprobs`
    does all of it.

        with engine.trainer_exact(model):
            logits = model(input_ids).logits
    """
    from engine.runner.exact_attention import exact_forward

    text_config = model.config.get_text_config()  # type: ignore[operator, union-attr]
    if latent_cache_width(text_config) is not None:
        raise BatchInvariantUnsupported(
            f"trainer_exact: {text_config.model_type} is not served in batch-invariant mode: "
            f"{BATCH_INVARIANCE_GAP}"
        )
    changed = _ExactForward(model)
    try:
        with exact_forward(), batch_invariant_forward(model):
            yield model
    finally:
        changed.restore()


def sequence_logprobs(
    model: torch.nn.Module, sequences: Sequence[Sequence[int]], prompt_lengths: Sequence[int]
) -> list[torch.Tensor]:
    """For each sequence (prompt + generated tokens), the logprob of every token after its first
    `prompt_lengths[i]` tokens: what the engine returned for those tokens in batch-invariant mode (raw
    logprobs), bit for bit, as [len - prompt_length] fp32 tensors. Differentiable: call it with grad
    enabled to train on them. One forward, the sequences right-padded to the longest."""
    if len(sequences) != len(prompt_lengths):
        raise ValueError(f"{len(sequences)} sequences but {len(prompt_lengths)} prompt lengths")
    for index, (sequence, prompt_length) in enumerate(zip(sequences, prompt_lengths, strict=True)):
        if not 1 <= prompt_length <= len(sequence):
            raise ValueError(
                f"sequence {index}: prompt length {prompt_length} must be in [1, {len(sequence)}], its length"
            )
    if not sequences:
        return []
    device = next(model.parameters()).device
    longest = max(len(sequence) for sequence in sequences)
    input_ids = torch.zeros(len(sequences), longest, dtype=torch.long, device=device)
    for row, sequence in enumerate(sequences):
        input_ids[row, : len(sequence)] = torch.tensor(list(sequence), dtype=torch.long)
    with trainer_exact(model):
        logits = model(input_ids=input_ids).logits
    results = []
    for row, (sequence, prompt_length) in enumerate(zip(sequences, prompt_lengths, strict=True)):
        # Logits at position p give the logprob of token p + 1.
        log_probs = torch.log_softmax(logits[row, prompt_length - 1 : len(sequence) - 1].float(), dim=-1)
        targets = input_ids[row, prompt_length : len(sequence)]
        results.append(log_probs.gather(1, targets.unsqueeze(1)).squeeze(1))
    return results
