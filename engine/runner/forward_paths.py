"""How one step's forward pass runs: eagerly, through torch.compile, or as a CUDA graph replay.

Steps take one of two paths, as in transformers' continuous batching:

- decode: every scheduled request adds one token. Its attention is tensor operations only, so the
  whole forward compiles as one graph and can be captured in a CUDA graph. When graphs or static
  shapes are on, the step is padded (`engine.runner.inputs`) so a bounded set of shapes recurs.
- varlen: prefill chunks, possibly mixed with decode rows. On the gather path chunk count and lengths
  change every step, so attention runs outside any compiled graph (`attention._varlen_gather_attention`)
  and only the layers around it compile. On the kernel path (`max_blocks_per_request`, the CPU's default)
  one launch serves any mix of chunks, so the whole step compiles as one graph with dynamic shapes, and
  with varlen CUDA graphs on, the step is padded to a bounded set of (tokens, requests) shapes and
  replays a graph captured for its shape.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from engine.config import ContinuousBatchingConfig
from engine.runner.attention import AttentionBatch, KernelInputs, PagedAttentionMetadata, bind_step_metadata
from engine.runner.batch_invariant import BatchInvariantUnsupported, EngineForwards
from engine.runner.decoder_forward import DecoderForward, unsupported_reason
from engine.runner.inputs import BatchInputs
from engine.runner.latent_attention import LatentCacheWriter, latent_cache_width
from engine.runner.padding import Padding, padded_sizes

if TYPE_CHECKING:
    from transformers import CompileConfig

logger = logging.getLogger(__name__)

# Presets used when the config's padding intervals are 0: decode batches (and the requests of a padded
# varlen step) round to 1, 2, 4, 8, 16, then multiples of 16; key widths to multiples of 256 tokens; the
# packed tokens of a padded varlen step to powers of two below 256, then multiples of 256.
DEFAULT_ROWS_PADDING_INTERVAL = 16
DEFAULT_KEYS_PADDING_INTERVAL = 256
DEFAULT_TOKENS_PADDING_INTERVAL = 256
# Varlen steps of more tokens run without graphs: their launch overhead is small next to their compute,
# and bounding them bounds the number of shapes.
MAX_VARLEN_GRAPH_TOKENS = 512
# Graphs each path may hold; a step of a new shape past it runs without one (its shape is not captured).
MAX_GRAPHS_PER_PATH = 256
# The CPU kernel's table width when the config sets none: any request's table fits.
ANY_TABLE_WIDTH = 1 << 31
# Compilations each path may hold (torch's default is 8): one per padded shape with static shapes.
RECOMPILE_LIMIT = 256

ForwardFunction = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, PagedAttentionMetadata], torch.Tensor]


def model_forward_functions(
    model: torch.nn.Module, device: torch.device, batch_invariant: bool = False
) -> dict[str, ForwardFunction]:
    """The engine's forward for each path: packed tokens in, logits of `logits_indices` rows out ([L, V]).

    The two paths are distinct functions so that torch.compile keeps a separate cache (and recompile
    budget) for each. With `batch_invariant`, the model runs under
    `engine.runner.batch_invariant.EngineForwards`:
    its mode serves the linear layers the engine has not packed (all of them on CUDA, the sharded ones
    under tensor parallelism) and, on CUDA, the norms' means; over 3 or more tensor-parallel ranks,
    all-reduces add in rank order.
    """
    mode = EngineForwards(model) if batch_invariant else contextlib.nullcontext

    # A ready 4-D mask makes transformers skip mask creation; paged attention masks by itself.
    placeholder_mask = torch.zeros(1, 1, 0, 0, device=device)
    # Multi-head latent attention hands its latents to `past_key_values.update`, which writes them into the
    # cache (engine.runner.latent_attention); any other model's attention writes in paged attention.
    writes_latents = latent_cache_width(model.config.get_text_config()) is not None  # type: ignore[operator, union-attr]

    def run_model(
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        logits_indices: torch.Tensor,
        metadata: PagedAttentionMetadata,
    ) -> torch.Tensor:
        # Bound for layers that drop `paged_metadata` on its way down; a compiled graph cannot bind it, so
        # under torch.compile such a model's attention gets no metadata and fails the step with an error.
        binds = not torch.compiler.is_compiling()
        if binds:
            bind_step_metadata(metadata)
        try:
            with mode():
                outputs = model(
                    input_ids=input_ids,
                    position_ids=position_ids,
                    attention_mask=placeholder_mask,
                    use_cache=False,
                    past_key_values=LatentCacheWriter(metadata) if writes_latents else None,
                    logits_to_keep=logits_indices,
                    paged_metadata=metadata,
                )
        finally:
            if binds:
                bind_step_metadata(None)
        return outputs.logits[0]

    def decode_forward(
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        logits_indices: torch.Tensor,
        metadata: PagedAttentionMetadata,
    ) -> torch.Tensor:
        return run_model(input_ids, position_ids, logits_indices, metadata)

    def varlen_forward(
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        logits_indices: torch.Tensor,
        metadata: PagedAttentionMetadata,
    ) -> torch.Tensor:
        return run_model(input_ids, position_ids, logits_indices, metadata)

    return {"decode": decode_forward, "varlen": varlen_forward}


def compile_function(function: ForwardFunction, config: CompileConfig, path: str) -> ForwardFunction:
    """`torch.compile` with a transformers `CompileConfig`.

    torch.compile takes `mode` or `options`, not both: explicit options win. The varlen path always
    allows graph breaks, because on the gather path its attention runs outside the graph, and always
    compiles with dynamic shapes: its token count is not padded, so static shapes would compile once per
    count.
    """
    fullgraph, dynamic = config.fullgraph, config.dynamic
    if path == "varlen" and (fullgraph or dynamic is False):
        logger.info(
            "varlen path: compiling with fullgraph=False, dynamic=True (on the gather path its attention "
            "runs outside the graph)"
        )
        fullgraph, dynamic = False, True
    kwargs: dict[str, Any] = {"fullgraph": fullgraph, "dynamic": dynamic, "backend": config.backend}
    if config.options:
        kwargs["options"] = config.options
    else:
        kwargs["mode"] = config.mode
    compiled = torch.compile(function, **kwargs)

    def with_compile_settings(
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        logits_indices: torch.Tensor,
        metadata: PagedAttentionMetadata,
    ) -> torch.Tensor:
        # Dynamo caches compilations per code object, so every engine in the process (and, with static
        # shapes, every padded shape) draws on one budget of recompilations. Its config is per thread, so
        # the budget is raised where the forward runs.
        # Python floats (norm epsilons, softmax scales) as constants: traced as symbols, they sent dynamo
        # back to restart its analysis once per compilation (a third of the tiny model's warmup).
        # Without duck sizing: by default, sizes equal when first traced share one symbol, so a decode
        # step of two rows on a model with two KV heads made the row count as static as the head count
        # (and a block table as wide as the batch is large tied the two), and later steps compiled again.
        with (
            torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT, specialize_float=True),
            torch.fx.experimental._config.patch(use_duck_shape=False),  # type: ignore[attr-defined]
        ):
            return compiled(input_ids, position_ids, logits_indices, metadata)

    return with_compile_settings


@dataclass
class _CapturedGraph:
    graph: torch.cuda.CUDAGraph
    inputs: BatchInputs  # static buffers the graph reads
    logits: torch.Tensor  # static buffer the graph writes


def _tensors_of(inputs: BatchInputs) -> list[torch.Tensor]:
    """Every per-step tensor of a step, in a fixed order (the caches are not per-step)."""
    return [inputs.input_ids, inputs.position_ids, inputs.logits_indices, *inputs.metadata.step_tensors()]


def graph_key(inputs: BatchInputs) -> tuple[tuple[int, ...], ...]:
    """Shapes of a step's tensors: steps of one path with equal keys replay the same graph."""
    return tuple(tuple(tensor.shape) for tensor in _tensors_of(inputs))


class StepGraphs:
    """CUDA graphs of one path's padded steps, one per shape, captured on first use (decode graphs also
    by `warmup`).

    All graphs of both paths share one memory pool, and their output buffers are reused: a step's logits
    are valid until the next replay, which is as long as the runner needs them (its sampling is queued on
    the stream before the next step's forward).
    """

    def __init__(
        self, function: ForwardFunction, device: torch.device, pool: Any, path: str, max_graphs: int
    ) -> None:
        self.function = function
        self.device = device
        self.graphs: dict[tuple[tuple[int, ...], ...], _CapturedGraph] = {}
        self.pool = pool
        self.path = path
        self.max_graphs = max_graphs
        self.full = False

    def run(self, inputs: BatchInputs) -> torch.Tensor | None:
        """The step's logits from its graph; None when its shape has no graph and no more may be captured
        (the caller runs it without one)."""
        key = graph_key(inputs)
        captured = self.graphs.get(key)
        if captured is None:
            if len(self.graphs) >= self.max_graphs:
                if not self.full:
                    logger.warning(
                        "%s path: %d CUDA graphs held, the most allowed; steps of other shapes run without",
                        self.path,
                        self.max_graphs,
                    )
                    self.full = True
                return None
            captured = self.graphs[key] = self._capture(inputs)
        else:
            for static, fresh in zip(_tensors_of(captured.inputs), _tensors_of(inputs), strict=True):
                static.copy_(fresh, non_blocking=True)
        captured.graph.replay()
        return captured.logits

    def _capture(self, inputs: BatchInputs) -> _CapturedGraph:
        static = _clone_step(inputs)
        arguments = (static.input_ids, static.position_ids, static.logits_indices, static.metadata)
        # Warm-up runs on a side stream, as capture requires; they execute this very step, and writing the
        # same keys to the same slots again changes nothing.
        side_stream = torch.cuda.Stream(self.device)
        side_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side_stream):
            for _ in range(2):
                self.function(*arguments)
        torch.cuda.current_stream(self.device).wait_stream(side_stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self.function(*arguments)
        logger.debug("captured a CUDA graph of shapes %s", graph_key(inputs))
        return _CapturedGraph(graph, static, logits)


def _clone_step(inputs: BatchInputs) -> BatchInputs:
    """A copy of a step whose tensors are the graph's own (static) buffers."""
    meta = inputs.metadata
    batches = [
        AttentionBatch(
            query_rows=batch.query_rows.clone(),
            real_queries=None,
            output_rows=None,
            key_slots=[slots.clone() for slots in batch.key_slots],
            masks=[mask.clone() for mask in batch.masks],
        )
        for batch in meta.batches
    ]
    kernel_inputs = meta.kernel_inputs
    if kernel_inputs is not None:
        kernel_inputs = KernelInputs(
            block_tables=[table.clone() for table in kernel_inputs.block_tables],
            query_starts=kernel_inputs.query_starts.clone(),
            seq_lens=kernel_inputs.seq_lens.clone(),
            tile_requests=kernel_inputs.tile_requests.clone(),
            tile_offsets=kernel_inputs.tile_offsets.clone(),
            queries_per_tile=kernel_inputs.queries_per_tile,
            has_unowned_rows=kernel_inputs.has_unowned_rows,
            fixed_order=kernel_inputs.fixed_order,
        )
    metadata = replace(
        meta,
        write_slots=[slots.clone() for slots in meta.write_slots],
        batches=batches,
        kernel_inputs=kernel_inputs,
    )
    return replace(
        inputs,
        input_ids=inputs.input_ids.clone(),
        position_ids=inputs.position_ids.clone(),
        logits_indices=inputs.logits_indices.clone(),
        metadata=metadata,
    )


class ForwardPaths:
    """Picks and runs the decode or varlen forward for each step, per the config.

    `padding` is the shape padding steps get: decode-only steps with decode CUDA graphs (a graph serves
    one shape) and with static-shape compilation (`dynamic=False`, one compilation per shape); steps with
    prefill chunks on the kernel path with varlen CUDA graphs.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        config: ContinuousBatchingConfig,
        device: torch.device,
        cache_dtype: torch.dtype,
    ) -> None:
        """`cache_dtype`: the KV caches', which the attention kernel reads."""
        self.attention_kernel, self.max_blocks_per_request = load_attention_kernel(
            config, device, cache_dtype
        )
        eager = model_forward_functions(model, device, config.batch_invariant)
        serves_decoder = self._decoder_forward_serves(model, config, device, cache_dtype)
        self.compile_configs = {path: config.compile_config_for(path) for path in ("varlen", "decode")}
        self.functions: dict[str, ForwardFunction] = {
            path: (DecoderForward(model, eager[path]) if serves_decoder else eager[path])
            if compile_config is None
            else compile_function(eager[path], compile_config, path)
            for path, compile_config in self.compile_configs.items()
        }
        if config.batch_invariant and self.attention_kernel is None:
            raise BatchInvariantUnsupported(
                "batch_invariant needs the attention kernel, which is unavailable here (the log says why); "
                "gathered keys would be attended in an order that follows the batch"
            )
        varlen_graphs, decode_graphs = use_cuda_graphs(
            config, device, model, self.attention_kernel is not None
        )
        pool = torch.cuda.graph_pool_handle() if varlen_graphs or decode_graphs else None
        self.decode_graphs = (
            StepGraphs(self.functions["decode"], device, pool, "decode", MAX_GRAPHS_PER_PATH)
            if decode_graphs
            else None
        )
        self.varlen_graphs = (
            StepGraphs(self.functions["varlen"], device, pool, "varlen", MAX_GRAPHS_PER_PATH)
            if varlen_graphs
            else None
        )
        decode_compile = self.compile_configs["decode"]
        static_shapes = decode_compile is not None and decode_compile.dynamic is False
        pads_decode = decode_graphs or static_shapes
        self.padding = (
            Padding(
                rows_interval=config.q_padding_interval_size or DEFAULT_ROWS_PADDING_INTERVAL,
                keys_interval=config.kv_padding_interval_size or DEFAULT_KEYS_PADDING_INTERVAL,
                tokens_interval=config.q_padding_interval_size or DEFAULT_TOKENS_PADDING_INTERVAL,
                decode=pads_decode,
                varlen=varlen_graphs,
                varlen_max_tokens=MAX_VARLEN_GRAPH_TOKENS,
            )
            if pads_decode or varlen_graphs
            else None
        )

    def _decoder_forward_serves(
        self,
        model: torch.nn.Module,
        config: ContinuousBatchingConfig,
        device: torch.device,
        cache_dtype: torch.dtype,
    ) -> bool:
        """Whether eager steps run the engine's own forward (engine.runner.decoder_forward): on the CPU's
        attention kernel over float32 caches, outside batch-invariant mode (whose forwards run under
        `EngineForwards`), for a model it serves. Otherwise steps run the model's own forward."""
        if device.type != "cpu" or config.batch_invariant or self.attention_kernel is None:
            return False
        if cache_dtype != torch.float32:
            return False
        reason = unsupported_reason(model)
        if reason is not None:
            logger.info(
                "steps run the model's own forward: the engine's decoder forward does not serve it (%s)",
                reason,
            )
            return False
        logger.info("steps run the engine's decoder forward (engine.runner.decoder_forward)")
        return True

    @property
    def decode_runs_eagerly(self) -> bool:
        """Whether decode steps run the model as it is: neither compiled nor replayed from a graph."""
        return self.decode_graphs is None and self.compile_configs["decode"] is None

    def drop_cuda_graphs(self) -> None:
        """Forgets every captured graph: they hold raw addresses of the KV cache and the weights, which
        change when sleep frees their memory. Graphs are captured again on first use."""
        for graphs in (self.decode_graphs, self.varlen_graphs):
            if graphs is not None:
                graphs.graphs.clear()
                graphs.full = False

    def capture_decode_graphs(self, build: Callable[[Padding, int], BatchInputs], max_rows: int) -> int:
        """Captures a decode graph for every row count up to `max_rows`, at the narrowest key width, from
        steps of padding rows alone (`build(padding, rows)`), so early real steps replay instead of
        capturing. Returns the number of graphs held."""
        if self.decode_graphs is None or self.padding is None:
            return 0
        assert self.padding.decode
        for rows in padded_sizes(max_rows, self.padding.rows_interval):
            self.run(build(self.padding, rows))
        return len(self.decode_graphs.graphs)

    @torch.inference_mode()
    def run(self, inputs: BatchInputs) -> torch.Tensor:
        """Logits [L, V] of the rows in `inputs.logits_indices`."""
        graphs = self.decode_graphs if inputs.is_decode_only else self.varlen_graphs
        if graphs is not None and inputs.is_padded:
            logits = graphs.run(inputs)
            if logits is not None:
                return logits
        function = self.functions["decode" if inputs.is_decode_only else "varlen"]
        return function(inputs.input_ids, inputs.position_ids, inputs.logits_indices, inputs.metadata)


def use_cuda_graphs(
    config: ContinuousBatchingConfig, device: torch.device, model: torch.nn.Module, has_attention_kernel: bool
) -> tuple[bool, bool]:
    """Whether (varlen, decode) steps replay CUDA graphs.

    Only an explicit request turns them on (None means off; bench/RESULTS.md, "GPU", says what has run
    on a GPU). They need CUDA, and the model must not be sharded: collectives inside graphs are
    not supported here. Varlen graphs also need the attention kernel (`max_blocks_per_request`): the
    gather path's shapes follow each step's chunks.
    """
    varlen, decode = (bool(flag) for flag in config.cuda_graph_flags())
    if not (varlen or decode):
        return False, False
    if device.type != "cuda":
        logger.warning(
            "use_cuda_graph: CUDA graphs need a CUDA device, the model is on %s; running without", device
        )
        return False, False
    if getattr(model, "tp_size", None) not in (None, 1):
        logger.warning("use_cuda_graph: not supported under tensor parallelism; running without")
        return False, False
    if varlen and not (has_attention_kernel and config.max_blocks_per_request):
        # batch_invariant runs the kernel without a width, but a padded step's tables are that wide.
        logger.warning(
            "use_cuda_graph: varlen CUDA graphs need the attention kernel and max_blocks_per_request set; "
            "steps with prefill chunks run without"
        )
        varlen = False
    return varlen, decode


def load_attention_kernel(
    config: ContinuousBatchingConfig, device: torch.device, dtype: torch.dtype
) -> tuple[Callable[..., torch.Tensor] | None, int]:
    """The paged attention kernel for this device, when there is one, and the widest block table it takes.

    On the CPU it is the C kernel (`paged_attention_cpu`), on unless `max_blocks_per_request` is 0, and
    taking tables of any width unless the config gives one. Elsewhere it is the Triton kernel
    (`paged_attention_kernel`), which only a positive `max_blocks_per_request` turns on (or, taking any
    width, `batch_invariant` on CUDA); it runs on CUDA, and on the CPU under TRITON_INTERPRET=1 when asked
    for by a positive width (how its tests run it).
    """
    width = config.max_blocks_per_request
    if width == 0:
        return None, 0
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if device.type == "cpu" and not (interpreted and width):
        from engine.runner import paged_attention_cpu

        kernel = paged_attention_cpu.load(dtype)
        return (kernel, width or ANY_TABLE_WIDTH) if kernel is not None else (None, 0)
    if not width:
        if not (config.batch_invariant and device.type == "cuda"):
            return None, 0
        width = ANY_TABLE_WIDTH
    if device.type != "cuda" and not interpreted:
        logger.warning(
            "max_blocks_per_request: the Triton attention kernel needs CUDA (or TRITON_INTERPRET=1); the "
            "model is on %s, so steps gather their keys",
            device,
        )
        return None, 0
    try:
        from engine.runner.paged_attention_kernel import paged_attention
    except ImportError as error:
        logger.warning("max_blocks_per_request: Triton is not usable (%s); steps gather their keys", error)
        return None, 0
    return paged_attention, width
