"""Configuration of the continuous-batching engine.

`ContinuousBatchingConfig` mirrors the field names, defaults and meaning of transformers'
`ContinuousBatchingConfig`, so a config written for one works with the other, but it validates every field
eagerly and exposes the runtime defaults (safety margin, memory fraction, compile configs) as pure helpers.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.sampling.params import check_logprobs_mode

if TYPE_CHECKING:
    from transformers import CompileConfig

__all__ = ["DEFAULT_SAFETY_MARGIN", "QUANTIZATION_CHOICES", "SCHEDULER_TYPES", "ContinuousBatchingConfig"]

SCHEDULER_TYPES: tuple[str, ...] = ("fifo", "prefill_first", "priority")
# Weight-only quantization of the linear layers (engine.quantization); "none" keeps the model's own weights.
QUANTIZATION_CHOICES: tuple[str, ...] = ("none", "int8", "int4", "fp8", "fp8_tensor")
DEFAULT_SAFETY_MARGIN: dict[str, float] = {"fifo": 0.15, "prefill_first": 0.0, "priority": 0.15}

_DEFAULT_PAGE_SIZE = 256
_MIN_PAGE_SIZE = 4
_MAX_COMPILE_LEVEL = 3
_MAX_MEMORY_PERCENT = 0.9
# Logits processors materialise vocabulary-sized temporaries per request, which need room outside the cache.
_MAX_MEMORY_PERCENT_WITH_LOGIT_PROCESSING = 0.8
_COMPILE_PATHS = ("varlen", "decode")
_COMPILE_CONFIG_FIELDS = ("varlen_compile_config", "decode_compile_config")
_DEPRECATED_FIELDS = ("use_default_compile_configs", "max_cached_graphs", "block_size")


@dataclass
class ContinuousBatchingConfig:
    """Settings of the continuous-batching engine, validated on construction and by `validate()`.

    Fields and their meaning:

    page_size: tokens one page holds for one layer. A KV-cache block is made of one page per layer, so a
    block covers `page_size` tokens of one request across the whole model. At least 4; larger pages mean
    fewer, bigger copies and a smaller block table.

    num_blocks: number of blocks in the KV cache. None sizes the cache from free memory: system RAM when the
    model runs on the CPU, device memory when it runs on a GPU.

    max_batch_tokens: most tokens (prefill and decode together) scheduled in one forward pass. None infers
    it from free memory the same way as `num_blocks`.

    max_memory_percent: fraction of free memory, measured after the model is loaded, that the KV cache may
    take, in (0, 1]. None resolves to 0.9, or to 0.8 when logits processing is on, because processors
    allocate vocabulary-sized temporaries (see `resolved_max_memory_percent`); on the CPU, None also caps
    the cache at 4 GiB, since it shares RAM with the rest of the host.

    kv_cache_memory: GiB the auto-sized KV cache may take at most, > 0 (vLLM's kv_cache_memory_bytes, in
    GiB as `cpu_offload_space` is). It caps the budget `max_memory_percent` gives, and on the CPU takes the
    place of the 4 GiB default cap: the one knob a shared host needs. Not with `num_blocks`, which sizes the
    cache itself.

    max_requests_per_batch: most requests in one batch; bounds the logits tensor, which grows with the
    vocabulary. None infers it from workload hints, falling back to 1024.

    max_blocks_per_request: the kernel path, where a kernel reads each request's keys in place through its
    block table, for decode-only steps and steps with prefill chunks alike (where transformers uses
    `flash_attn_with_kvcache` for decode steps); steps whose requests hold more blocks than this gather
    their keys. On the CPU the kernel is cbserve's C kernel (engine.runner.paged_attention_cpu, fp32 and
    bf16, built with the machine's C compiler on first use): None turns it on for every step, a positive
    value bounds it, 0 keeps the gather path. On CUDA it is cbserve's Triton kernel
    (engine.runner.paged_attention_kernel): a positive value turns it on, 0 or None keeps it off. Both work
    with sliding-window layers and softcapping.

    allow_block_sharing: enable prefix caching, where requests with a common prefix share its full blocks.
    It is a permission, not an order: it is only honoured for models whose layers all use full attention.

    use_async_batching: launch each step before the previous one's tokens are back, so the host schedules
    and prepares step N+1 while the device runs step N (engine.engine_core). Input copies go through
    pinned buffers that live until their copy has run (about twice the input buffers). True turns it on;
    None and False keep it off. It works without CUDA graphs; on the CPU results are the same and nothing
    overlaps.

    use_cuda_graph: capture and replay CUDA graphs. A bool applies to both execution paths, a tuple
    `(varlen, decode)` sets each path on its own; None keeps them off.
    Graphs need CUDA and an unsharded model; varlen graphs (steps with prefill chunks) also need the
    kernel path (`max_blocks_per_request`), whose launch shape does not depend on the chunks.

    q_padding_interval_size, kv_padding_interval_size: granularity, in tokens, to which query and KV lengths
    are padded so that a bounded number of CUDA graphs covers every batch shape: decode rows and the
    requests of a varlen step, and the packed tokens of a varlen step, round to powers of two below the
    query interval and to multiples of it above; key widths to multiples of the KV interval. 0 uses the
    built-in presets (queries: 16 for rows and requests, 256 for packed tokens; keys: 256).

    varlen_compile_config, decode_compile_config: explicit `transformers.CompileConfig` for the varlen
    (prefill and mixed) path and the decode path. A dict is accepted and converted, so configs shipped
    through `to_dict()` come back intact.

    default_compile_level: compile preset used for a path without an explicit config, 0 to 3. Higher levels
    trade longer warmup for throughput: 0 does not compile; 1 uses mode "default" with dynamic=True; 2 uses
    "max-autotune-no-cudagraphs" with dynamic=True; 3 uses "max-autotune-no-cudagraphs" with dynamic=False
    (see `compile_config_for`).

    scheduler_type: "fifo" serves requests in arrival order and schedules decode steps before new prefills;
    "prefill_first" admits waiting prefills first, which lowers time to first token; "priority" is fifo
    ordered by each request's `priority` (smaller first, ties first-come): waiting requests are admitted in
    that order, and when memory runs out the lowest-priority running request is preempted first.

    safety_margin: fraction of the cache, in [0, 1], kept free for the decode steps of running requests;
    once free blocks fall below it, no new prefill is admitted. None resolves per scheduler: 0.15 for fifo
    and priority, 0.0 for prefill_first (see `resolved_safety_margin`).

    return_logprobs: return the log-probability of each generated token, of the distribution `logprobs_mode`
    names.

    logprobs_mode: the default of requests that set none (engine.sampling.params.LogprobsMode; vLLM's
    names): "raw_logprobs", log_softmax of the model's logits, or "processed_logprobs", of the distribution
    the token was drawn from (after logit bias, penalties, temperature, top-k, top-p and min-p).

    seed: seed of the sampling generator; None draws a random one.

    auto_switch_to_flash: accepted and validated so that configs written for transformers load, and changes
    nothing: cbserve has no flash-attention kernel. Every model runs cbserve's paged SDPA (or paged eager)
    attention, and its Triton kernel on the kernel path (`max_blocks_per_request`).

    cpu_offload_space: GiB of pinned host memory reserved for KV blocks of preempted requests, which are
    copied there instead of being recomputed later. 0 disables offloading; None sizes the pool from
    `cpu_offload_space_safety_threshold` alone.

    cpu_offload_space_safety_threshold: cap on the offload pool as a fraction of total system RAM, in
    (0, 1]; a larger request is clamped to it. 1.0 disables the cap.

    max_queue_size: most requests waiting to be scheduled before new ones are rejected; 0 means unbounded.

    per_request_processors: in cbserve every request always carries its own sampling parameters
    (temperature, top_k, top_p, seed, penalties, logit_bias), batched on the device. True only lowers the
    default `max_memory_percent`, as transformers does when it processes logits per request.

    drop_unsupported_processors: remove logits processors the engine cannot batch, with a warning, instead
    of raising.

    disable_nccl_graph_mixing: accepted and validated for transformers' configs, and changes nothing: cbserve
    captures CUDA graphs only of unsharded models, so no collective is ever graph-captured.

    cpu_group_timeout: seconds after which a collective on the CPU process group fails, so a lost rank is
    detected quickly instead of after the backend's default of 30 minutes; None waits forever. Under tensor
    parallelism (engine.parallel) it bounds the driver's per-iteration tick and, once loading is done, the
    model's own collectives.

    num_threads: intra-op threads of the thread that runs the engine's steps (torch.set_num_threads there);
    None: as many as torch uses in the thread that builds the engine. Steps never run on the caller's
    thread (warmup included): on the CPU, a caller's thread that had run them kept an OpenMP team whose
    idle workers slowed the loop thread's own (measured 1.5x slower steps on 2 cores).

    pack_cpu_weights: on the CPU, run the linear layers on copies of their weights packed once, instead
    of letting the BLAS repack them on every call (engine.runner.packed_linear): float32 layers on the
    engine's own kernel's panels, bf16 layers of 2**18 elements and more for oneDNN where it can pack them
    (CPUs with AVX-512 or AVX-NE-CONVERT). Applies to eager steps of an unsharded model; the copies cost
    those layers' weight memory a second time, which False saves. A layer repacks by itself after an
    in-place write to its weight.

    populate_kv_cache: on the CPU, back the KV cache's pages ahead of their first writes, on a thread of
    the engine's own at the scheduler's idle priority, from the start and again after each `wake_up`. A
    first write faults, about 4-8 us a page on a VM: 64 new requests on the 2-core Xeon faulted about
    100,000 times (0.8 s of a 12 s workload), on the steps' path. The cache becomes resident within seconds
    of idle time, as vLLM's is from its start. `cbserve serve` turns it on (`--lazy-kv-cache` turns it
    off).

    batch_invariant: compute every request's tokens and logprobs with bits that do not depend on what else
    is scheduled with it: not on the other requests of its steps, how its prompt was split into chunks,
    a prefix-cache hit, a preemption (recompute or offload), async batching or its n > 1 siblings; seeded
    sampling included. Every linear layer runs on kernels whose reduction order is fixed per row (the
    engine's float32 panels or oneDNN's packed weights on the CPU, a fixed-tile Triton matmul on CUDA)
    and attention on the kernel path with a fixed order (engine.runner.batch_invariant has the
    measurements and the causes). A trainer holding
    the same model gets the same bits under `engine.trainer_exact`. Needs eager forwards (no compile
    config, `default_compile_level` 0) and the attention kernel (`max_blocks_per_request` not 0, and
    wide enough for the longest request; on CUDA, None turns the Triton kernel on for any width); on the
    CPU, float32 weights (on the engine's kernel) or bf16 ones oneDNN can pack (CPUs with AVX-512). Its
    cost is in bench/RESULTS.md ("Batch-invariant mode's cost").

    quantization: serve the linear layers from quantized weights (engine.quantization): on the CPU
    weight-only "int8" (a scale per 32 weights) or "int4" (a scale and a min per 32 weights), read packed
    by the engine's kernel; on an H100/H200-class GPU "fp8" (e4m3 weights with a scale per output channel,
    inputs rounded to fp8 with a scale per row in each call, cuBLASLt's fp8 matmul; it runs on the CPU too,
    slowly, which is how it is tested), "fp8_tensor" (one scale for the weight and one for each call's
    inputs: what GPUs of compute capability 8.9 run) or "int4" (tinygemm's kernel, bfloat16 inputs); or
    "none" (the
    default: the model's own weights). The engine quantizes the model's full-precision linear layers in
    place when it starts (the model stays quantized after it stops) and keeps layers already loaded
    quantized, such as a GGUF file's own blocks. Weight updates stay full precision on the wire and are
    quantized as they are applied. Not with `batch_invariant`.

    quantize_activations: with `quantization` "int8" or "int4", a linear layer called on at most 4 rows
    (the decode of one request or a few) quantizes its inputs to int8, a scale per 32, and multiplies in
    integers, as llama.cpp does: one request's int4 step on SmolLM2 took 23.8 ms against 28.3 with float
    inputs on the 2-core EPYC (bench/RESULTS.md, "Quantized weights"), and each output moves by at most
    half an input step times the weights' magnitudes (the kernel's header). False (`cbserve serve
    --no-quantize-activations`) keeps float32 inputs: the product of the dequantized weights, up to the
    order of its sums, at every batch size.

    Deprecated fields, accepted at construction only and reset to None once applied:
    `use_default_compile_configs` (since transformers 5.11, use `default_compile_level`; True raises a level
    of 0 to 1), `max_cached_graphs` (since 5.13, ignored) and `block_size` (since 5.17, copied into
    `page_size`).
    """

    page_size: int = _DEFAULT_PAGE_SIZE
    num_blocks: int | None = None
    max_batch_tokens: int | None = None
    max_memory_percent: float | None = None
    kv_cache_memory: float | None = None
    max_requests_per_batch: int | None = None
    max_blocks_per_request: int | None = None
    allow_block_sharing: bool = True
    use_async_batching: bool | None = None
    use_cuda_graph: bool | tuple[bool, bool] | None = None
    q_padding_interval_size: int = 0
    kv_padding_interval_size: int = 0
    varlen_compile_config: CompileConfig | None = None
    decode_compile_config: CompileConfig | None = None
    default_compile_level: int = 0
    scheduler_type: str = "fifo"
    safety_margin: float | None = None
    return_logprobs: bool = False
    logprobs_mode: str = "raw_logprobs"
    seed: int | None = None
    auto_switch_to_flash: bool = True
    cpu_offload_space: float | None = 0.0
    cpu_offload_space_safety_threshold: float = 0.8
    max_queue_size: int = 0
    per_request_processors: bool = False
    drop_unsupported_processors: bool = True
    disable_nccl_graph_mixing: bool = True
    cpu_group_timeout: float | None = 300.0
    num_threads: int | None = None
    pack_cpu_weights: bool = True
    populate_kv_cache: bool = False
    batch_invariant: bool = False
    quantization: str = "none"
    quantize_activations: bool = True
    use_default_compile_configs: bool | None = None
    max_cached_graphs: int | None = None
    block_size: int | None = None

    def __post_init__(self) -> None:
        self._apply_deprecated_fields()
        for name in _COMPILE_CONFIG_FIELDS:
            setattr(self, name, _compile_config_from_dict(name, getattr(self, name)))
        self.validate()

    def _apply_deprecated_fields(self) -> None:
        # The warnings use stacklevel=4 to skip this method, __post_init__ and the generated __init__, so they
        # point at the line that built the config.
        if self.block_size is not None:
            _check_int("block_size", self.block_size, minimum=_MIN_PAGE_SIZE)
            # The default page_size cannot be told apart from an explicit 256, so only a non-default one
            # counts as a conflicting choice.
            if self.page_size != _DEFAULT_PAGE_SIZE and self.page_size != self.block_size:
                raise ValueError(
                    f"block_size ({self.block_size!r}) and page_size ({self.page_size!r}) disagree; "
                    "block_size is deprecated, set only page_size"
                )
            warnings.warn(
                "block_size is deprecated since transformers 5.17; use page_size. "
                f"Setting page_size to {self.block_size}.",
                FutureWarning,
                stacklevel=4,
            )
            self.page_size = self.block_size
            self.block_size = None
        if self.use_default_compile_configs is not None:
            _check_bool("use_default_compile_configs", self.use_default_compile_configs)
            if self.use_default_compile_configs and self.default_compile_level == 0:
                self.default_compile_level = 1
            warnings.warn(
                "use_default_compile_configs is deprecated since transformers 5.11; use "
                f"default_compile_level. default_compile_level is {self.default_compile_level!r}.",
                FutureWarning,
                stacklevel=4,
            )
            self.use_default_compile_configs = None
        if self.max_cached_graphs is not None:
            _check_int("max_cached_graphs", self.max_cached_graphs, minimum=None)
            warnings.warn(
                "max_cached_graphs is deprecated since transformers 5.13 and is ignored.",
                FutureWarning,
                stacklevel=4,
            )
            self.max_cached_graphs = None

    def validate(self) -> None:
        """Check every field, raising ValueError naming the first invalid one, its value and what is allowed.

        Call it again after mutating fields. Deprecated fields must be None here: they are only translated at
        construction, so setting one afterwards would otherwise be silently ignored.
        """
        for name in _DEPRECATED_FIELDS:
            value = getattr(self, name)
            if value is not None:
                raise ValueError(
                    f"{name} is deprecated and only accepted at construction, got {value!r}; "
                    "set its replacement field instead"
                )
        _check_int("page_size", self.page_size, minimum=_MIN_PAGE_SIZE)
        _check_optional_int("num_blocks", self.num_blocks, minimum=1)
        _check_optional_int("max_batch_tokens", self.max_batch_tokens, minimum=1)
        if self.max_memory_percent is not None:
            _check_fraction("max_memory_percent", self.max_memory_percent, low_inclusive=False)
        if self.kv_cache_memory is not None:
            _check_number("kv_cache_memory", self.kv_cache_memory, minimum=0.0, min_inclusive=False)
            if self.num_blocks is not None:
                raise ValueError(
                    f"kv_cache_memory ({self.kv_cache_memory:g} GiB) and num_blocks ({self.num_blocks}) both "
                    "size the KV cache: set one"
                )
        _check_optional_int("max_requests_per_batch", self.max_requests_per_batch, minimum=1)
        _check_optional_int("max_blocks_per_request", self.max_blocks_per_request, minimum=0)
        _check_bool("allow_block_sharing", self.allow_block_sharing)
        if self.use_async_batching is not None:
            _check_bool("use_async_batching", self.use_async_batching)
        _check_cuda_graph(self.use_cuda_graph)
        _check_int("q_padding_interval_size", self.q_padding_interval_size, minimum=0)
        _check_int("kv_padding_interval_size", self.kv_padding_interval_size, minimum=0)
        _check_compile_config("varlen_compile_config", self.varlen_compile_config)
        _check_compile_config("decode_compile_config", self.decode_compile_config)
        _check_int("default_compile_level", self.default_compile_level, minimum=0, maximum=_MAX_COMPILE_LEVEL)
        if self.scheduler_type not in SCHEDULER_TYPES:
            allowed = ", ".join(repr(s) for s in SCHEDULER_TYPES)
            raise ValueError(f"scheduler_type must be one of {allowed}, got {self.scheduler_type!r}")
        if self.safety_margin is not None:
            _check_fraction("safety_margin", self.safety_margin, low_inclusive=True)
        _check_bool("return_logprobs", self.return_logprobs)
        check_logprobs_mode(self.logprobs_mode)
        _check_optional_int("seed", self.seed, minimum=None)
        _check_bool("auto_switch_to_flash", self.auto_switch_to_flash)
        if self.cpu_offload_space is not None:
            _check_number("cpu_offload_space", self.cpu_offload_space, minimum=0.0, min_inclusive=True)
        _check_fraction(
            "cpu_offload_space_safety_threshold", self.cpu_offload_space_safety_threshold, low_inclusive=False
        )
        _check_int("max_queue_size", self.max_queue_size, minimum=0)
        if self.num_threads is not None:
            _check_int("num_threads", self.num_threads, minimum=1)
        _check_bool("pack_cpu_weights", self.pack_cpu_weights)
        _check_bool("populate_kv_cache", self.populate_kv_cache)
        _check_bool("quantize_activations", self.quantize_activations)
        _check_bool("batch_invariant", self.batch_invariant)
        if self.batch_invariant:
            self._check_batch_invariant_settings()
        if self.quantization not in QUANTIZATION_CHOICES:
            allowed = ", ".join(repr(choice) for choice in QUANTIZATION_CHOICES)
            raise ValueError(f"quantization must be one of {allowed}, got {self.quantization!r}")
        if self.batch_invariant and self.quantization != "none":
            raise ValueError(
                "batch_invariant needs full-precision linear layers, got quantization "
                f"{self.quantization!r}; set quantization to 'none'"
            )
        _check_bool("per_request_processors", self.per_request_processors)
        _check_bool("drop_unsupported_processors", self.drop_unsupported_processors)
        _check_bool("disable_nccl_graph_mixing", self.disable_nccl_graph_mixing)
        if self.cpu_group_timeout is not None:
            _check_number("cpu_group_timeout", self.cpu_group_timeout, minimum=0.0, min_inclusive=False)

    def _check_batch_invariant_settings(self) -> None:
        compiled = [path for path in _COMPILE_PATHS if self.compile_config_for(path) is not None]
        if compiled:
            raise ValueError(
                f"batch_invariant needs eager forwards, but these paths compile: {', '.join(compiled)}; "
                "torch.compile picks its own reductions and matmul kernels by shape; set "
                "default_compile_level=0 and leave varlen_compile_config and decode_compile_config None"
            )
        if self.max_blocks_per_request == 0:
            raise ValueError(
                "batch_invariant needs the attention kernel, whose order per query is fixed, but "
                "max_blocks_per_request is 0 (the gather path); leave it None or set it positive"
            )

    def resolved_safety_margin(self) -> float:
        """The safety margin in force: the explicit one, else the scheduler's default."""
        if self.safety_margin is not None:
            return float(self.safety_margin)
        return DEFAULT_SAFETY_MARGIN[self.scheduler_type]

    def resolved_max_memory_percent(self, has_logit_processing: bool) -> float:
        """The fraction of free memory the KV cache may take: the explicit one, else 0.9 (0.8 with logits
        processing)."""
        if self.max_memory_percent is not None:
            return float(self.max_memory_percent)
        if has_logit_processing:
            return _MAX_MEMORY_PERCENT_WITH_LOGIT_PROCESSING
        return _MAX_MEMORY_PERCENT

    def cuda_graph_flags(self) -> tuple[bool | None, bool | None]:
        """`use_cuda_graph` as a `(varlen, decode)` pair; None in a slot leaves that path without graphs."""
        if self.use_cuda_graph is None or isinstance(self.use_cuda_graph, bool):
            return self.use_cuda_graph, self.use_cuda_graph
        varlen, decode = self.use_cuda_graph
        return varlen, decode

    def compile_config_for(self, path: str) -> CompileConfig | None:
        """The compile config of the "varlen" or "decode" path: the explicit one if set, else the preset of
        `default_compile_level`, or None at level 0."""
        if path not in _COMPILE_PATHS:
            allowed = ", ".join(repr(p) for p in _COMPILE_PATHS)
            raise ValueError(f"path must be one of {allowed}, got {path!r}")
        explicit = self.varlen_compile_config if path == "varlen" else self.decode_compile_config
        if explicit is not None:
            return explicit
        level = self.default_compile_level
        if level == 0:
            return None
        from transformers import CompileConfig

        # Whole-graph compile is kept as in transformers' presets: it is measurably faster than regional
        # compile for the batched forward.
        return CompileConfig(
            fullgraph=True,
            mode="default" if level == 1 else "max-autotune-no-cudagraphs",
            dynamic=level <= 2,
        )

    def to_dict(self) -> dict[str, Any]:
        """All fields as plain values; compile configs become dicts so the result pickles and, unless a
        compile backend is a callable, serialises to JSON."""
        result: dict[str, Any] = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name in _COMPILE_CONFIG_FIELDS and value is not None:
                value = value.to_dict()
            result[field.name] = value
        return result

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ContinuousBatchingConfig:
        """Build a validated config from `to_dict()` output or its JSON round trip.

        Raises ValueError for a key that is not a field, so a typo cannot silently fall back to a default.
        """
        known = {field.name for field in dataclasses.fields(cls)}
        for key in data:
            if key not in known:
                raise ValueError(f"unknown ContinuousBatchingConfig field {key!r}")
        kwargs = dict(data)
        # JSON has no tuples: a (varlen, decode) pair comes back as a two-element list.
        if isinstance(kwargs.get("use_cuda_graph"), list):
            kwargs["use_cuda_graph"] = tuple(kwargs["use_cuda_graph"])
        return cls(**kwargs)


def _compile_config_from_dict(name: str, value: Any) -> Any:
    if not isinstance(value, dict):
        return value
    from transformers import CompileConfig

    try:
        return CompileConfig(**value)
    except TypeError as error:
        raise ValueError(f"{name} must hold CompileConfig fields, got {value!r}: {error}") from error


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")


def _is_int(value: Any) -> bool:
    # bool is an int subclass, but True as a count is almost always a mistake.
    return isinstance(value, int) and not isinstance(value, bool)


def _int_range(minimum: int | None, maximum: int | None) -> str:
    if minimum is not None and maximum is not None:
        return f"an int in [{minimum}, {maximum}]"
    if minimum is not None:
        return f"an int >= {minimum}"
    return "an int"


def _check_int(name: str, value: Any, minimum: int | None, maximum: int | None = None) -> None:
    if (
        not _is_int(value)
        or (minimum is not None and value < minimum)
        or (maximum is not None and value > maximum)
    ):
        raise ValueError(f"{name} must be {_int_range(minimum, maximum)}, got {value!r}")


def _check_optional_int(name: str, value: Any, minimum: int | None) -> None:
    if value is not None and (not _is_int(value) or (minimum is not None and value < minimum)):
        raise ValueError(f"{name} must be None or {_int_range(minimum, None)}, got {value!r}")


def _is_finite_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _check_number(name: str, value: Any, minimum: float, min_inclusive: bool) -> None:
    valid = _is_finite_number(value) and (value >= minimum if min_inclusive else value > minimum)
    if not valid:
        bound = f">= {minimum:g}" if min_inclusive else f"> {minimum:g}"
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}")


def _check_fraction(name: str, value: Any, low_inclusive: bool) -> None:
    inside = _is_finite_number(value) and (0 <= value <= 1 if low_inclusive else 0 < value <= 1)
    if not inside:
        interval = "[0, 1]" if low_inclusive else "(0, 1]"
        raise ValueError(f"{name} must be in {interval}, got {value!r}")


def _check_cuda_graph(value: Any) -> None:
    if value is None or isinstance(value, bool):
        return
    if isinstance(value, tuple) and len(value) == 2 and all(isinstance(flag, bool) for flag in value):
        return
    raise ValueError(
        f"use_cuda_graph must be None, a bool or a (varlen, decode) tuple of two bools, got {value!r}"
    )


def _check_compile_config(name: str, value: Any) -> None:
    if value is None:
        return
    from transformers import CompileConfig

    if not isinstance(value, CompileConfig):
        raise ValueError(f"{name} must be None or a transformers.CompileConfig, got {value!r}")
