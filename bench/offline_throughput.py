"""Offline throughput of cbserve against transformers' continuous batching and padded static batching.

All engines run in one process on the same random-weight model and the same prompts, in alternating rounds
(A B C A B C ...) so that drift in machine load hits every engine alike. Each engine first gets one untimed
warmup run. Results are JSON lines: one per engine, then one summary with the throughput ratios, the
device's measured matmul rate in the benchmark's dtype (the roofline for model-FLOPs utilisation) and greedy
token parity.

Run from the repository root:

    PYTHONPATH=. python bench/offline_throughput.py --model tiny
    PYTHONPATH=. python bench/offline_throughput.py --device cuda --dtype bfloat16 --model qwen3-0.6b

Importable: `run_benchmark(parse_args([...]))` returns the same records it prints.
"""

from __future__ import annotations

# isort: off
# First, before torch loads libgomp: importing the server package sets its OpenMP defaults
# (service/openmp.py), so the in-process engines here run as the server's does.
import service  # noqa: F401

# isort: on
import argparse
import copy
import dataclasses
import functools
import gc
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch
import transformers
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedConfig,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import engine
from engine import call_on_steps_thread

BENCH_NAME = "offline_throughput"
ENGINES = (
    "cbserve",
    "transformers_cb",
    "static",
    "cbserve_defaults",
    "cbserve_batch_invariant",
    "cbserve_fp8",
    "cbserve_int4",
    "cbserve_int8",
)
# What a run compares unless --engines says otherwise; cbserve_defaults is for runs that turn on cbserve's
# opt-in paths, to measure them against cbserve without them in the same run, and cbserve_batch_invariant
# (cbserve with the same flags and batch_invariant=True) measures what that mode costs; cbserve_<format> is
# cbserve on a copy of the model quantized to that format.
DEFAULT_ENGINES = ("cbserve", "transformers_cb", "static")


@dataclasses.dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    family: str = "llama"
    vocab_size: int = 32000
    max_position_embeddings: int = 2048
    head_dim: int | None = None
    tie_word_embeddings: bool = False


CausalLM = LlamaForCausalLM | Qwen3ForCausalLM
MODEL_CLASSES: dict[str, tuple[Callable[..., PreTrainedConfig], type[CausalLM]]] = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
}
MODEL_PRESETS: dict[str, ModelShape] = {
    "tiny": ModelShape(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=1024,
    ),
    "medium": ModelShape(
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        intermediate_size=2048,
    ),
    # The shapes of Qwen3-0.6B (596M parameters, tied embeddings), with random weights: the GPU benchmark.
    "qwen3-0.6b": ModelShape(
        hidden_size=1024,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        intermediate_size=3072,
        family="qwen3",
        vocab_size=151936,
        max_position_embeddings=4096,
        head_dim=128,
        tie_word_embeddings=True,
    ),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The configuration the peer measurements (shared/references/peer-on-this-cpu.md) were taken with, so our
# transformers_cb figures on the CPU are comparable to theirs.
TRANSFORMERS_CB_PAGE_SIZE = 256
TRANSFORMERS_CB_NUM_BLOCKS = 128
TRANSFORMERS_CB_MAX_BATCH_TOKENS = 2048
# Defaults per device of the flags left unset. On cuda: 8192 tokens per step is both engines' own GPU default;
# 64-token pages keep cbserve's auto-sized pool (about a million tokens on an H200) to some 17k blocks; and a
# 2048^2 matmul is too short to keep a GPU busy, so the roofline uses 8192^2.
DEVICE_DEFAULTS: dict[str, dict[str, int]] = {
    "cpu": {"page_size": 16, "max_batch_tokens": 2048, "matmul_size": 2048},
    "cuda": {"page_size": 64, "max_batch_tokens": 8192, "matmul_size": 8192},
}
# Left padding for static batching; any id works because the attention mask hides it.
PAD_TOKEN_ID = 0
MFU_FORMULA = (
    "mfu = (2 * n_body * (prompt_tokens + generated_tokens) + 2 * n_lm_head * generated_tokens)"
    " / median_s / matmul_flops_per_s; n_body = parameters outside the input embedding and the LM head"
    " (the embedding is a lookup, and the LM head only runs for positions that produce a token);"
    " attention-score FLOPs and padding are not counted, so padded work lowers mfu"
)


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """Knobs of the engines under test. transformers_cb's defaults are the peer's fixed CPU configuration;
    None lets it size that field from free memory."""

    page_size: int = 16
    max_batch_tokens: int = 2048
    num_blocks: int | None = None
    compile_level: int = 0
    cuda_graphs: bool = False
    async_batching: bool = False
    max_blocks_per_request: int | None = None
    pack_cpu_weights: bool = True
    batch_invariant: bool = False
    static_batch_size: int = 16
    transformers_cb_page_size: int = TRANSFORMERS_CB_PAGE_SIZE
    transformers_cb_num_blocks: int | None = TRANSFORMERS_CB_NUM_BLOCKS
    transformers_cb_max_batch_tokens: int | None = TRANSFORMERS_CB_MAX_BATCH_TOKENS


# Every engine takes (model, prompts, a fresh greedy config, options) and returns the generated tokens of
# each prompt, in input order.
EngineRunner = Callable[[CausalLM, list[list[int]], GenerationConfig, EngineOptions], list[list[int]]]
Result = TypeVar("Result")


def on_own_thread(function: Callable[..., Result], *args: Any, **kwargs: Any) -> Result:
    """`function(*args, **kwargs)` run on a thread that ends with it; its exception is raised here.

    libgomp (torch's OpenMP on Linux) keeps a team of worker threads for every thread that ran a parallel
    region, for as long as that thread lives, and a team left on the main thread (by model building, the
    matmul probe, the static peer or a reference `generate`) slowed every engine timed after it: SmolLM2
    generated about 100 tokens/s instead of 150-190 here, with or without the OpenMP settings of
    `service/openmp.py`. A thread that exits takes its team with it. (Loading a checkpoint with
    `from_pretrained` on the main thread, as the server does, did not slow the engine.)
    """
    name = f"bench-{getattr(function, '__name__', 'task')}"
    return call_on_steps_thread(functools.partial(function, *args, **kwargs), torch.get_num_threads(), name)


def build_model(
    preset: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> CausalLM:
    """A random-weight model of `preset`'s family and shape, seeded, with no EOS anywhere in its configs.

    The weights are drawn on the CPU and then moved, so a preset has the same weights on every device.
    """
    shape = dataclasses.asdict(MODEL_PRESETS[preset])
    config_class, model_class = MODEL_CLASSES[shape.pop("family")]
    if shape["head_dim"] is None:
        del shape["head_dim"]
    # eos_token_id=None in the model config too: transformers fills a generation config's unset fields from
    # the model's, and LlamaConfig's default eos (2) would stop requests early.
    config = config_class(bos_token_id=None, eos_token_id=None, pad_token_id=None, **shape)
    torch.manual_seed(0)
    model = model_class._from_config(config, attn_implementation="sdpa", dtype=dtype)
    return model.to(device).eval()


def make_prompts(num_requests: int, min_prompt: int, max_prompt: int, vocab_size: int) -> list[list[int]]:
    """Prompt lengths uniform in [min_prompt, max_prompt], ids uniform in [1, vocab_size); seed 0."""
    rng = random.Random(0)
    # Lengths are drawn before any token so they do not depend on the vocabulary size.
    lengths = [rng.randint(min_prompt, max_prompt) for _ in range(num_requests)]
    return [[rng.randrange(1, vocab_size) for _ in range(length)] for length in lengths]


def greedy_config(new_tokens: int) -> GenerationConfig:
    """Greedy decoding of exactly `new_tokens` tokens: no EOS, so no request stops early.

    Built fresh for each run because transformers' continuous batching rewrites a missing EOS to -1 in
    the config it is given.
    """
    return GenerationConfig(
        do_sample=False, max_new_tokens=new_tokens, eos_token_id=None, pad_token_id=PAD_TOKEN_ID
    )


def _ordered_tokens(engine_name: str, outputs: Mapping[str, Any], num_prompts: int) -> list[list[int]]:
    """Generated tokens per request from a `generate_batch` result (both APIs keep input order)."""
    if len(outputs) != num_prompts:
        raise RuntimeError(f"{engine_name} returned {len(outputs)} results for {num_prompts} prompts")
    failed = {request_id: output.error for request_id, output in outputs.items() if output.error is not None}
    if failed:
        raise RuntimeError(f"{engine_name}: {len(failed)} requests failed, e.g. {next(iter(failed.items()))}")
    return [list(output.generated_tokens) for output in outputs.values()]


def cbserve_config(options: EngineOptions) -> engine.ContinuousBatchingConfig:
    return engine.ContinuousBatchingConfig(
        page_size=options.page_size,
        num_blocks=options.num_blocks,
        max_batch_tokens=options.max_batch_tokens,
        default_compile_level=options.compile_level,
        use_cuda_graph=options.cuda_graphs,
        use_async_batching=options.async_batching,
        max_blocks_per_request=options.max_blocks_per_request,
        pack_cpu_weights=options.pack_cpu_weights,
        batch_invariant=options.batch_invariant,
    )


def run_cbserve(
    model: CausalLM,
    prompts: list[list[int]],
    generation_config: GenerationConfig,
    options: EngineOptions,
) -> list[list[int]]:
    outputs = engine.generate_batch(
        model,
        prompts,
        generation_config=generation_config,
        continuous_batching_config=cbserve_config(options),
    )
    return _ordered_tokens("cbserve", outputs, len(prompts))


def run_cbserve_defaults(
    model: CausalLM,
    prompts: list[list[int]],
    generation_config: GenerationConfig,
    options: EngineOptions,
) -> list[list[int]]:
    """cbserve with none of its opt-in paths (compilation, CUDA graphs, async batching), its default
    attention (the C kernel on the CPU, the gather path on CUDA) and its packed CPU weights."""
    defaults = dataclasses.replace(
        options,
        compile_level=0,
        cuda_graphs=False,
        async_batching=False,
        max_blocks_per_request=None,
        pack_cpu_weights=True,
    )
    return run_cbserve(model, prompts, generation_config, defaults)


def run_cbserve_batch_invariant(
    model: CausalLM,
    prompts: list[list[int]],
    generation_config: GenerationConfig,
    options: EngineOptions,
) -> list[list[int]]:
    """cbserve with the same options and `batch_invariant=True` (issue 33)."""
    return run_cbserve(model, prompts, generation_config, dataclasses.replace(options, batch_invariant=True))


def cbserve_step_breakdown(
    model: CausalLM, prompts: list[list[int]], new_tokens: int, options: EngineOptions
) -> dict[str, Any]:
    """One extra, untimed cbserve run through the manager, to read where its step time goes.

    Host overhead is everything but the forward pass and sampling: scheduling, input preparation and
    folding results back.
    """
    config = cbserve_config(options)
    model.set_attn_implementation("sdpa")
    with engine.continuous_batching_context_manager(
        model, greedy_config(new_tokens), continuous_batching_config=config
    ) as manager:
        ids = manager.add_requests(prompts)
        for request_id in ids:
            assert request_id is not None and manager.get_result(request_id, timeout=None) is not None
        timings = manager.stats().step_timings
    step_total = sum(value for name, value in timings.items() if name.endswith("_s"))
    host = timings["schedule_s"] + timings["prepare_inputs_s"] + timings["update_s"]
    return {
        "bench": BENCH_NAME,
        "engine": "cbserve",
        "step_breakdown_s": timings,
        "steps": timings["num_steps"],
        "host_overhead_fraction": round(host / step_total, 4),
    }


def transformers_cb_config(options: EngineOptions) -> transformers.ContinuousBatchingConfig:
    # transformers 5.17 (the GPU machine's) names the page size `block_size`; later versions call it
    # `page_size` and warn on the old name.
    fields = {field.name for field in dataclasses.fields(transformers.ContinuousBatchingConfig)}
    page_field = "page_size" if "page_size" in fields else "block_size"
    page: dict[str, Any] = {page_field: options.transformers_cb_page_size}
    return transformers.ContinuousBatchingConfig(
        num_blocks=options.transformers_cb_num_blocks,
        max_batch_tokens=options.transformers_cb_max_batch_tokens,
        **page,
    )


def run_transformers_cb(
    model: CausalLM,
    prompts: list[list[int]],
    generation_config: GenerationConfig,
    options: EngineOptions,
) -> list[list[int]]:
    config = transformers_cb_config(options)
    outputs = model.generate_batch(
        inputs=prompts, generation_config=generation_config, continuous_batching_config=config
    )
    return _ordered_tokens("transformers_cb", outputs, len(prompts))


def run_static(
    model: CausalLM,
    prompts: list[list[int]],
    generation_config: GenerationConfig,
    options: EngineOptions,
) -> list[list[int]]:
    """`model.generate` on consecutive batches of prompts, each left-padded to its longest prompt."""
    generated: list[list[int]] = []
    for start in range(0, len(prompts), options.static_batch_size):
        batch = prompts[start : start + options.static_batch_size]
        width = max(len(prompt) for prompt in batch)
        input_ids = torch.tensor(
            [[PAD_TOKEN_ID] * (width - len(prompt)) + prompt for prompt in batch], device=model.device
        )
        attention_mask = torch.tensor(
            [[0] * (width - len(prompt)) + [1] * len(prompt) for prompt in batch], device=model.device
        )
        # transformers annotates `generate`'s self as a protocol that the model classes do not match.
        output = model.generate(  # type: ignore[misc]
            input_ids=input_ids, attention_mask=attention_mask, generation_config=generation_config
        )
        generated.extend(output[:, width:].tolist())
    return generated


# Quantized copies of the benchmark's model, one per format: quantizing replaces the model's layers in
# place, and the other engines run the full-precision model. Each copy is quantized by its first run (the
# untimed warmup) and served as it is by the later ones.
_QUANTIZED_COPIES: dict[tuple[int, str], CausalLM] = {}


def run_cbserve_quantized(
    weight_format: str,
) -> Callable[[CausalLM, list[list[int]], GenerationConfig, EngineOptions], list[list[int]]]:
    """cbserve with the same options on a copy of the model quantized to `weight_format` (issue 35: fp8
    and int4 on a GPU, int8 and int4 on the CPU)."""

    def run(
        model: CausalLM, prompts: list[list[int]], generation_config: GenerationConfig, options: EngineOptions
    ) -> list[list[int]]:
        quantized = _QUANTIZED_COPIES.setdefault((id(model), weight_format), copy.deepcopy(model))
        config = dataclasses.replace(cbserve_config(options), quantization=weight_format)
        outputs = engine.generate_batch(
            quantized, prompts, generation_config=generation_config, continuous_batching_config=config
        )
        return _ordered_tokens(f"cbserve_{weight_format}", outputs, len(prompts))

    return run


RUNNERS: dict[str, EngineRunner] = {
    "cbserve": run_cbserve,
    "transformers_cb": run_transformers_cb,
    "static": run_static,
    "cbserve_defaults": run_cbserve_defaults,
    "cbserve_batch_invariant": run_cbserve_batch_invariant,
    "cbserve_fp8": run_cbserve_quantized("fp8"),
    "cbserve_int4": run_cbserve_quantized("int4"),
    "cbserve_int8": run_cbserve_quantized("int8"),
}


def synchronize(device: torch.device) -> None:
    """Waits for the device's queued work, so that a clock read after it covers that work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release_device_memory(device: torch.device) -> None:
    """Returns the last engine's freed cache to the GPU, so the next engine sizes its cache from the same free
    memory (both size from what the driver reports free, which excludes torch's cached blocks)."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def timed_run(
    engine_name: str,
    model: CausalLM,
    prompts: list[list[int]],
    new_tokens: int,
    options: EngineOptions,
) -> tuple[float, list[list[int]]]:
    """Wall seconds of one end-to-end run (engine setup and teardown included) and its tokens."""
    # cbserve and transformers' CB both swap in a paged attention while they run; resetting here keeps an
    # engine that failed to restore it from changing how the next one runs.
    model.set_attn_implementation("sdpa")
    generation_config = greedy_config(new_tokens)
    synchronize(model.device)
    start = time.perf_counter()
    tokens = RUNNERS[engine_name](model, prompts, generation_config, options)
    synchronize(model.device)
    seconds = time.perf_counter() - start
    release_device_memory(model.device)
    return seconds, tokens


def measure_matmul_flops(
    size: int = 2048,
    repeats: int = 10,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> float:
    """Achieved FLOP/s of a square `torch.matmul` in `dtype` on `device` (median of `repeats`, after two
    warmup calls)."""
    device = torch.device(device)
    generator = torch.Generator(device=device).manual_seed(0)
    left = torch.randn(size, size, generator=generator, device=device, dtype=dtype)
    right = torch.randn(size, size, generator=generator, device=device, dtype=dtype)
    for _ in range(2):
        torch.matmul(left, right)
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        torch.matmul(left, right)
        synchronize(device)
        times.append(time.perf_counter() - start)
    return 2 * size**3 / statistics.median(times)


def parameter_counts(model: CausalLM) -> tuple[int, int]:
    """(n_body, n_lm_head): parameters outside both vocabulary matrices, and those of the LM head."""
    embedding = model.get_input_embeddings().weight
    lm_head = model.get_output_embeddings().weight
    vocabulary_ids = {id(embedding), id(lm_head)}
    n_body = sum(parameter.numel() for parameter in model.parameters() if id(parameter) not in vocabulary_ids)
    return n_body, lm_head.numel()


def parity_fraction(tokens: list[list[int]], reference: list[list[int]]) -> float:
    return sum(ours == theirs for ours, theirs in zip(tokens, reference, strict=True)) / len(reference)


def first_token_parity_fraction(tokens: list[list[int]], reference: list[list[int]]) -> float:
    """Requests whose first generated token matches. In bf16, batch shapes change rounding, so whole outputs
    drift apart after a near-tie; a first token that differs in many requests points at a bug instead."""
    pairs = zip(tokens, reference, strict=True)
    return sum(ours[:1] == theirs[:1] for ours, theirs in pairs) / len(reference)


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run_benchmark(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Runs the benchmark that `args` (from `parse_args`) describes: per-engine records, then the summary."""
    engines: list[str] = args.engines
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    # On a GPU the peer's fixed CPU cache (128 blocks of 256 tokens) would hold only part of the workload, so
    # there transformers_cb sizes its cache from free memory, as cbserve does, with cbserve's token budget.
    gpu_peer_options: dict[str, Any] = {}
    if device.type != "cpu":
        gpu_peer_options = {
            "transformers_cb_num_blocks": None,
            "transformers_cb_max_batch_tokens": args.max_batch_tokens,
        }
    options = EngineOptions(
        page_size=args.page_size,
        max_batch_tokens=args.max_batch_tokens,
        num_blocks=args.num_blocks,
        compile_level=args.compile_level,
        cuda_graphs=args.cuda_graphs,
        async_batching=args.async_batching,
        max_blocks_per_request=args.max_blocks_per_request,
        pack_cpu_weights=not args.no_pack_cpu_weights,
        static_batch_size=args.static_batch_size,
        **gpu_peer_options,
    )
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    # Other processes on a small machine skew every figure; the load averages let a reader judge a run.
    load_at_start = os.getloadavg()[0]
    model = on_own_thread(build_model, args.model, device, dtype)
    prompts = make_prompts(args.requests, args.min_prompt, args.max_prompt, model.config.vocab_size)
    prompt_tokens = sum(len(prompt) for prompt in prompts)
    generated_tokens = args.requests * args.new_tokens
    n_params = sum(parameter.numel() for parameter in model.parameters())
    n_body, n_lm_head = parameter_counts(model)
    matmul_flops = on_own_thread(measure_matmul_flops, args.matmul_size, device=device, dtype=dtype)
    release_device_memory(device)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.machine()
    _log(
        f"model {args.model}: {n_params:,} params, {args.dtype} on {device} ({device_name}); "
        f"{args.requests} requests, {prompt_tokens} prompt tokens; matmul {matmul_flops / 1e9:.1f} GFLOP/s; "
        f"{torch.get_num_threads()} threads"
    )

    # With --keep-going an engine that raises is dropped from the later runs and reported with its error, so
    # one failing engine does not cost the figures of the others (a GPU check gets a single try).
    errors: dict[str, str] = {}

    def run_or_drop(engine_name: str, run_prompts: list[list[int]]) -> tuple[float, list[list[int]]] | None:
        try:
            return on_own_thread(timed_run, engine_name, model, run_prompts, args.new_tokens, options)
        except Exception as error:
            if not args.keep_going:
                raise
            errors[engine_name] = f"{type(error).__name__}: {error}"
            _log(f"{engine_name} failed and is dropped: {errors[engine_name]}")
            release_device_memory(device)
            return None

    warmup_prompts = prompts[: args.warmup_requests]
    if warmup_prompts:
        for engine_name in engines:
            warmup = run_or_drop(engine_name, warmup_prompts)
            if warmup is not None:
                _log(f"warmup {engine_name}: {warmup[0]:.2f} s ({len(warmup_prompts)} requests)")

    wall_s: dict[str, list[float]] = {name: [] for name in engines}
    first_tokens: dict[str, list[list[int]]] = {}
    repeat_consistent = dict.fromkeys(engines, True)
    for round_index in range(args.repeats):
        for engine_name in engines:
            run = None if engine_name in errors else run_or_drop(engine_name, prompts)
            if run is None:
                continue
            seconds, tokens = run
            wall_s[engine_name].append(seconds)
            reference = first_tokens.setdefault(engine_name, tokens)
            repeat_consistent[engine_name] &= tokens == reference
            _log(f"round {round_index + 1}/{args.repeats} {engine_name}: {seconds:.2f} s")

    if "cbserve" in engines and "cbserve" not in errors:
        breakdown = cbserve_step_breakdown(model, prompts, args.new_tokens, options)
        _log(f"cbserve step breakdown: {breakdown['step_breakdown_s']}")
    useful_flops = 2 * n_body * (prompt_tokens + generated_tokens) + 2 * n_lm_head * generated_tokens
    static_tokens = first_tokens.get("static")
    records: list[dict[str, Any]] = []
    throughput: dict[str, float] = {}
    for engine_name in engines:
        if engine_name in errors:
            records.append(
                {
                    "bench": BENCH_NAME,
                    "engine": engine_name,
                    "model": args.model,
                    "error": errors[engine_name],
                }
            )
            continue
        median_s = statistics.median(wall_s[engine_name])
        throughput[engine_name] = generated_tokens / median_s
        tokens = first_tokens[engine_name]
        records.append(
            {
                "bench": BENCH_NAME,
                "engine": engine_name,
                "model": args.model,
                "requests": args.requests,
                "new_tokens": args.new_tokens,
                "prompt_tokens": prompt_tokens,
                "wall_s": [round(seconds, 3) for seconds in wall_s[engine_name]],
                "median_s": round(median_s, 3),
                "tokens_per_s": round(throughput[engine_name], 1),
                "mfu": round(useful_flops / median_s / matmul_flops, 4),
                "requests_with_exact_new_tokens": sum(len(row) == args.new_tokens for row in tokens),
                "repeat_consistent": repeat_consistent[engine_name],
                "parity_vs_static": None if static_tokens is None else parity_fraction(tokens, static_tokens),
                "first_token_parity_vs_static": (
                    None if static_tokens is None else first_token_parity_fraction(tokens, static_tokens)
                ),
            }
        )

    if "cbserve" in engines and "cbserve" not in errors:
        records.append(breakdown)

    def ratio(peer: str) -> float | None:
        if "cbserve" not in throughput or peer not in throughput:
            return None
        return round(throughput["cbserve"] / throughput[peer], 3)

    records.append(
        {
            "bench": BENCH_NAME,
            "summary": True,
            "model": args.model,
            "cbserve_vs_transformers_cb": ratio("transformers_cb"),
            "cbserve_vs_static": ratio("static"),
            "cbserve_vs_cbserve_defaults": ratio("cbserve_defaults"),
            # How many times slower batch-invariant mode runs than cbserve with the same flags.
            "batch_invariant_slowdown": ratio("cbserve_batch_invariant"),
            # How many times faster each quantized format runs than the full-precision weights.
            "quantized_speedup": {
                name.removeprefix("cbserve_"): round(throughput[name] / throughput["cbserve"], 3)
                for name in ("cbserve_fp8", "cbserve_int4", "cbserve_int8")
                if name in throughput and "cbserve" in throughput
            },
            "parity_cbserve_vs_static": next(
                (record.get("parity_vs_static") for record in records if record["engine"] == "cbserve"), None
            ),
            "matmul_gflops": round(matmul_flops / 1e9, 1),
            "matmul_size": args.matmul_size,
            "device": str(device),
            "device_name": device_name,
            "dtype": args.dtype,
            "mfu_formula": MFU_FORMULA,
            "n_params": n_params,
            "n_params_body": n_body,
            "n_params_lm_head": n_lm_head,
            "threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(),
            "load_avg_1min_start": round(load_at_start, 2),
            "load_avg_1min_end": round(os.getloadavg()[0], 2),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
            "cbserve_config": {
                "page_size": options.page_size,
                "num_blocks": options.num_blocks,
                "max_batch_tokens": options.max_batch_tokens,
                "default_compile_level": options.compile_level,
                "use_cuda_graph": options.cuda_graphs,
                "use_async_batching": options.async_batching,
                "max_blocks_per_request": options.max_blocks_per_request,
                "pack_cpu_weights": options.pack_cpu_weights,
            },
            "transformers_cb_config": {
                "page_size": options.transformers_cb_page_size,
                "num_blocks": options.transformers_cb_num_blocks,
                "max_batch_tokens": options.transformers_cb_max_batch_tokens,
                "attn_implementation": "sdpa",
            },
            "static_batch_size": options.static_batch_size,
        }
    )
    return records


def plot_throughput(records: Sequence[Mapping[str, Any]], path: str) -> None:
    """Bar chart of median tokens/s per engine, with the range over repeats as error bars."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on benchmark machines
    import matplotlib.pyplot as plt

    # Lines with timings only: not the step breakdown, nor an engine that failed under --keep-going.
    engine_records = [record for record in records if "tokens_per_s" in record]
    names = [record["engine"] for record in engine_records]
    medians = [record["tokens_per_s"] for record in engine_records]
    fastest = [record["requests"] * record["new_tokens"] / min(record["wall_s"]) for record in engine_records]
    slowest = [record["requests"] * record["new_tokens"] / max(record["wall_s"]) for record in engine_records]
    error_bars = [
        [median - low for median, low in zip(medians, slowest, strict=True)],
        [high - median for median, high in zip(medians, fastest, strict=True)],
    ]
    figure, axes = plt.subplots(figsize=(6, 4))
    axes.bar(names, medians, yerr=error_bars, capsize=6)
    axes.set_ylabel("generated tokens/s (median)")
    axes.set_xlabel("error bars: slowest to fastest repeat")
    model = engine_records[0]["model"] if engine_records else "?"
    axes.set_title(f"offline throughput, {model} model")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def add_compile_level_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--compile-level",
        type=int,
        choices=range(4),
        default=0,
        help="cbserve's default_compile_level (torch.compile; the untimed warmup run compiles)",
    )


def add_no_pack_cpu_weights_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--no-pack-cpu-weights",
        action="store_true",
        help="cbserve's linear layers use the BLAS on the model's own weights (pack_cpu_weights=False)",
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODEL_PRESETS), default="tiny")
    parser.add_argument("--device", choices=sorted(DEVICE_DEFAULTS), default="cpu")
    parser.add_argument(
        "--dtype", choices=list(DTYPES), default="float32", help="of the weights and the KV caches"
    )
    parser.add_argument(
        "--engines",
        nargs="+",
        choices=ENGINES,
        default=list(DEFAULT_ENGINES),
        help="engines to compare (cbserve_defaults: cbserve without the opt-in paths the flags turn on)",
    )
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--min-prompt", type=int, default=16)
    parser.add_argument("--max-prompt", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup-requests", type=int, default=8, help="requests in each untimed warmup run")
    parser.add_argument("--page-size", type=int, default=None, help="cbserve only; default 16, 64 on cuda")
    parser.add_argument(
        "--max-batch-tokens",
        type=int,
        default=None,
        help="cbserve's; default 2048, or 8192 on cuda, where transformers_cb gets the same",
    )
    parser.add_argument(
        "--num-blocks", type=int, default=None, help="cbserve only; default sizes from memory"
    )
    add_compile_level_argument(parser)
    parser.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="cbserve replays CUDA graphs (cuda only; varlen steps need --max-blocks-per-request)",
    )
    parser.add_argument(
        "--async-batching",
        action="store_true",
        help="cbserve prepares each step while the previous one runs (use_async_batching)",
    )
    parser.add_argument(
        "--max-blocks-per-request",
        type=int,
        default=None,
        help="cbserve's attention kernel: widest block table it reads; 0 turns it off (the gather path)."
        " Default: the C kernel on the CPU, any width; off on cuda (the Triton kernel needs a width)",
    )
    add_no_pack_cpu_weights_argument(parser)
    parser.add_argument("--static-batch-size", type=int, default=16)
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: torch's choice); on a busy machine, 1 avoids waits for a"
        " descheduled worker thread on every small op",
    )
    parser.add_argument(
        "--matmul-size",
        type=int,
        default=None,
        help="side of the square matmul roofline; default 2048, 8192 on cuda",
    )
    parser.add_argument("--plot", metavar="PATH", help="write a PNG bar chart of tokens/s (needs matplotlib)")
    parser.add_argument("--json-out", metavar="PATH", help="also write the JSON lines to this file")
    parser.add_argument(
        "--keep-going",
        action="store_true",
        help="report an engine that raises as {engine, error} and carry on with the others",
    )
    args = parser.parse_args(argv)
    if args.requests < 1 or args.new_tokens < 1 or args.repeats < 1:
        parser.error("--requests, --new-tokens and --repeats must be at least 1")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    if args.warmup_requests < 0:
        parser.error(f"--warmup-requests must be >= 0, got {args.warmup_requests}")
    if not 1 <= args.min_prompt <= args.max_prompt:
        parser.error(f"need 1 <= --min-prompt <= --max-prompt, got {args.min_prompt} and {args.max_prompt}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a GPU that torch can use; torch.cuda.is_available() is False")
    for name, default in DEVICE_DEFAULTS[args.device].items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    # Keep the CLI order but run each engine once per round.
    args.engines = list(dict.fromkeys(args.engines))
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    records = run_benchmark(args)
    lines = [json.dumps(record) for record in records]
    print("\n".join(lines), flush=True)
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as file:
            file.write("\n".join(lines) + "\n")
    if args.plot:
        plot_throughput(records, args.plot)


if __name__ == "__main__":
    main()
