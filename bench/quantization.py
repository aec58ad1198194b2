"""Quantized weights on the CPU (engine.quantization): the candidate kernels, then the embedded model.

`kernels`: every linear layer of one SmolLM2-135M step (30 layers of q, k, v, o, gate, up, down, and the
49152 x 576 output layer: 211 weights, 538 MB in fp32, far more than the caches) run in sequence on 1 and
on 32 rows, per candidate: `F.linear` on fp32, torch's `aten._weight_int8pack_mm` (int8, a scale per
channel) and `aten._weight_int4pack_mm_for_cpu` (int4, groups of 32), and cbserve's kernel on int8 and int4
(groups of 32). Alternating rounds; the median step, and the bandwidth it implies from the bytes of
weights read.

`engine`: the embedded SmolLM2-135M-Instruct served from fp32 (`quantization="none"`), int8 (quantized at
load) and int4 (its GGUF file's own Q4_1 blocks, Q8_0 for the output layer), each with int8 inputs at
decode (the default, `quantize_activations`) and with float inputs (`_float_inputs`), and on request fp8
(the GPU's format, for its quality: slow on a CPU), in alternating rounds: one request's ms per token (one
chat prompt, EOS off, `--max-new-tokens` tokens), and 32 chats' throughput (EOS on). Quality against
fp32: the fraction of the chats' greedy tokens equal to fp32's, and the perplexity of each on a fixed
local text (Python's own `pydoc_data` help topics, the first `--perplexity-tokens` tokens), with int8
inputs as decode computes each token.

`agreement`: the same servings, each chat asked alone (greedy, EOS on), as one user meets the server: the
answers' tokens and whole answers equal to fp32's, and the first chat's answer as text.

Prints JSON lines, each with the machine's load average at its start and end (the machine is shared):

    PYTHONPATH=. python bench/quantization.py --part kernels engine
    PYTHONPATH=. python bench/quantization.py --part agreement --max-new-tokens 64
"""

from __future__ import annotations

# isort: off
# First, before torch loads libgomp: the server's OpenMP defaults (service/openmp.py), as the server runs.
import service  # noqa: F401

# isort: on
import argparse
import functools
import json
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

import engine
from bench.embedded_model import chat_prompts, equal_fraction, greedy_config
from engine.quantization import kernel
from engine.quantization.formats import quantize
from engine.quantization.linear import QuantizedLinear
from engine.quantization.model import quantize_model, quantized_layers
from service.default_model import ensure_default_model, load_own_gguf_blocks

BENCH_NAME = "quantization"
HIDDEN, INTERMEDIATE, KV, VOCAB, LAYERS = 576, 1536, 192, 49152, 30
# (out, in) of each linear layer of one decoder layer, then the output layer's.
LAYER_SHAPES = [
    (HIDDEN, HIDDEN),
    (KV, HIDDEN),
    (KV, HIDDEN),
    (HIDDEN, HIDDEN),
    (INTERMEDIATE, HIDDEN),
    (INTERMEDIATE, HIDDEN),
    (HIDDEN, INTERMEDIATE),
]
STEP_SHAPES = LAYER_SHAPES * LAYERS + [(VOCAB, HIDDEN)]
KERNELS = ("fp32_linear", "aten_int8", "aten_int4", "cbserve_int8", "cbserve_int4")
# Per serving: its `quantization`, its `quantize_activations`, and the model it is served from (a serving
# with float inputs shares its integer twin's quantized model; each engine sets the layers' flag at start).
SERVINGS: dict[str, tuple[str, bool, str]] = {
    "fp32": ("none", True, "fp32"),
    "int8": ("int8", True, "int8"),
    "int8_float_inputs": ("int8", False, "int8"),
    "int4_gguf": ("int4", True, "int4_gguf"),
    "int4_gguf_float_inputs": ("int4", False, "int4_gguf"),
    # The GPU's format, here for its quality: the CPU's fp8 matmul is oneDNN's slow reference path, so it
    # runs only when asked for (`--servings fp32 fp8`).
    "fp8": ("fp8", False, "fp8"),
}
DEFAULT_SERVINGS = [name for name in SERVINGS if name != "fp8"]


def _kernel_step(name: str, weights: list[torch.Tensor]) -> tuple[Callable[[torch.Tensor, int], Any], int]:
    """A function running every layer of a step on `rows` rows, and the bytes of weights it reads."""
    if name == "fp32_linear":
        return lambda inputs, index: F.linear(inputs, weights[index]), sum(w.nbytes for w in weights)
    if name == "aten_int8":
        packed = []
        for weight in weights:
            scales = weight.abs().amax(dim=1) / 127
            packed.append((torch.round(weight / scales[:, None]).to(torch.int8), scales))
        return (
            lambda inputs, index: torch.ops.aten._weight_int8pack_mm(inputs, *packed[index]),
            sum(q.nbytes + s.nbytes for q, s in packed),
        )
    if name == "aten_int4":
        packed4 = []
        for weight in weights:
            int4 = quantize("w", weight, "int4")
            levels = torch.cat(
                [
                    int4.packed.view(weight.shape[0], -1, 16) & 15,
                    int4.packed.view(weight.shape[0], -1, 16) >> 4,
                ],
                -1,
            )
            # torch's int4 layout: w = (q - 8) * scale + zero, scales and zeros [groups, out, 2].
            assert int4.mins is not None
            zeros = int4.mins + 8 * int4.scales
            scales_and_zeros = torch.stack([int4.scales, zeros], dim=-1).transpose(0, 1).contiguous()
            tiles = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                levels.reshape(weight.shape).to(torch.int32), 1
            )
            packed4.append((tiles, scales_and_zeros))
        return (
            lambda inputs, index: torch.ops.aten._weight_int4pack_mm_for_cpu(
                inputs, packed4[index][0], 32, packed4[index][1]
            ),
            sum(t.nbytes + s.nbytes for t, s in packed4),
        )
    weight_format = name.removeprefix("cbserve_")
    quantized: list[QuantizedLinear] = [
        QuantizedLinear(quantize("w", weight, weight_format), None, "w") for weight in weights
    ]
    return (
        lambda inputs, index: quantized[index](inputs),
        sum(layer.quantized_weight.nbytes for layer in quantized),
    )


def run_kernels(args: argparse.Namespace) -> list[dict[str, Any]]:
    load_start = os.getloadavg()[0]
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(out, inp, generator=generator) * inp**-0.5 for out, inp in STEP_SHAPES]
    steps = {name: _kernel_step(name, weights) for name in args.kernels}
    records = []
    for rows in (1, 32):
        inputs = {inp: torch.randn(rows, inp, generator=generator) for inp in (HIDDEN, INTERMEDIATE)}
        times: dict[str, list[float]] = {name: [] for name in args.kernels}
        for round_index in range(args.kernel_rounds + 1):
            for name in args.kernels:
                step, _ = steps[name]
                start = time.perf_counter()
                for index, (_, inp) in enumerate(STEP_SHAPES):
                    step(inputs[inp], index)
                if round_index:  # the first round warms up
                    times[name].append(time.perf_counter() - start)
        for name in args.kernels:
            median_s = statistics.median(times[name])
            records.append(
                {
                    "bench": BENCH_NAME,
                    "part": "kernels",
                    "kernel": name,
                    "rows": rows,
                    "step_ms_median": round(median_s * 1e3, 2),
                    "step_ms_min": round(min(times[name]) * 1e3, 2),
                    "weight_mb": round(steps[name][1] / 1e6, 1),
                    "gb_per_s_at_median": round(steps[name][1] / median_s / 1e9, 2),
                    "threads": torch.get_num_threads(),
                    "load_avg_1min_start": round(load_start, 2),
                    "load_avg_1min_end": round(os.getloadavg()[0], 2),
                }
            )
    return records


def _perplexity_text(tokenizer: Any, count: int) -> torch.Tensor:
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[key] for key in sorted(topics))
    return torch.tensor([tokenizer(text)["input_ids"][:count]])


def _perplexity(model: Any, tokens: torch.Tensor, quantize_activations: bool) -> float:
    """Perplexity of `tokens` under one plain forward. With `quantize_activations`, each quantized layer runs
    its rows INTEGER_MAX_ROWS at a time, on the kernel's integer path: each token's logits are then those
    a decode step computes (a row's result on that path does not depend on the other rows of its call),
    where a one-call forward of every token would take the float path."""
    layers = list(quantized_layers(model).values())
    for layer in layers:
        layer.quantize_activations = quantize_activations
        if quantize_activations:
            layer.forward = functools.partial(_in_decode_sized_calls, layer)
    try:
        with torch.no_grad():
            loss = model(tokens, labels=tokens).loss
    finally:
        for layer in layers:
            layer.__dict__.pop("forward", None)
    return math.exp(loss.item())


def _in_decode_sized_calls(layer: QuantizedLinear, inputs: torch.Tensor) -> torch.Tensor:
    rows = inputs.reshape(-1, inputs.shape[-1])
    calls = [QuantizedLinear.forward(layer, part) for part in rows.split(kernel.INTEGER_MAX_ROWS)]
    return torch.cat(calls).view(*inputs.shape[:-1], -1)


def _serve(model: Any, prompts: list[list[int]], config: Any, serving: str) -> tuple[float, list[list[int]]]:
    quantization, quantize_activations, _ = SERVINGS[serving]
    start = time.perf_counter()
    outputs = engine.generate_batch(
        model,
        prompts,
        generation_config=config,
        continuous_batching_config=engine.ContinuousBatchingConfig(
            page_size=16,
            max_batch_tokens=2048,
            quantization=quantization,
            quantize_activations=quantize_activations,
        ),
    )
    return time.perf_counter() - start, [list(output.generated_tokens) for output in outputs.values()]


def _servings(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    """The tokenizer, and the model each of `args.servings` serves (quantized once per format)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = ensure_default_model()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    models: dict[str, Any] = {}
    for name in args.servings:
        quantization, _, model_name = SERVINGS[name]
        if model_name in models:
            continue
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
        start = time.perf_counter()
        if model_name == "int4_gguf":
            load_own_gguf_blocks(folder, model)
        quantize_model(model, quantization)
        print(f"{model_name}: quantized in {time.perf_counter() - start:.1f} s", flush=True)
        models[model_name] = model.eval()
    return tokenizer, {name: models[SERVINGS[name][2]] for name in args.servings}


def run_engine(args: argparse.Namespace) -> list[dict[str, Any]]:
    load_start = os.getloadavg()[0]
    tokenizer, servings = _servings(args)
    chats = chat_prompts(tokenizer, args.requests)
    chat_config = greedy_config(next(iter(servings.values())), args.max_new_tokens)
    single_config = greedy_config(next(iter(servings.values())), args.max_new_tokens)
    single_config.eos_token_id = None
    single_config.min_new_tokens = args.max_new_tokens
    for name, model in servings.items():  # warmup
        _serve(model, chats[:2], chat_config, name)
    single: dict[str, list[float]] = {name: [] for name in servings}
    batch: dict[str, list[float]] = {name: [] for name in servings}
    outputs: dict[str, list[list[int]]] = {}
    for _ in range(args.rounds):
        for name, model in servings.items():
            seconds, tokens = _serve(model, chats[:1], single_config, name)
            single[name].append(seconds * 1e3 / max(1, len(tokens[0])))
            seconds, tokens = _serve(model, chats, chat_config, name)
            batch[name].append(sum(len(row) for row in tokens) / seconds)
            outputs.setdefault(name, tokens)
    text = _perplexity_text(tokenizer, args.perplexity_tokens)
    records = []
    for name, model in servings.items():
        records.append(
            {
                "bench": BENCH_NAME,
                "part": "engine",
                "serving": name,
                "one_request_ms_per_token": [round(value, 1) for value in single[name]],
                "one_request_ms_per_token_median": round(statistics.median(single[name]), 1),
                "chats_tokens_per_s": [round(value, 1) for value in batch[name]],
                "chats_tokens_per_s_median": round(statistics.median(batch[name]), 1),
                "chat_tokens_equal_to_fp32": (
                    round(equal_fraction(outputs[name], outputs["fp32"]), 4) if "fp32" in outputs else None
                ),
                "perplexity": round(_perplexity(model, text, SERVINGS[name][1]), 3),
                "requests": args.requests,
                "max_new_tokens": args.max_new_tokens,
                "threads": torch.get_num_threads(),
                "load_avg_1min_start": round(load_start, 2),
                "load_avg_1min_end": round(os.getloadavg()[0], 2),
            }
        )
    return records


def run_agreement(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Each chat served alone, as a user asking one question meets the server: every decode step has one
    row, so `quantize_activations` takes effect at every token (in a batch of more than 4 rows it does not).
    Per serving, the answers' tokens equal to fp32's and the answers equal to fp32's whole."""
    load_start = os.getloadavg()[0]
    tokenizer, servings = _servings(args)
    chats = chat_prompts(tokenizer, args.requests)
    config = greedy_config(next(iter(servings.values())), args.max_new_tokens)
    answers = {
        name: [_serve(model, [chat], config, name)[1][0] for chat in chats]
        for name, model in servings.items()
    }
    reference = answers.get("fp32")
    return [
        {
            "bench": BENCH_NAME,
            "part": "agreement",
            "serving": name,
            "answer_tokens_equal_to_fp32": round(equal_fraction(rows, reference), 4) if reference else None,
            "answers_equal_to_fp32": sum(row == want for row, want in zip(rows, reference, strict=True))
            if reference
            else None,
            "first_answer": tokenizer.decode(rows[0], skip_special_tokens=True),
            "requests": args.requests,
            "max_new_tokens": args.max_new_tokens,
            "load_avg_1min_start": round(load_start, 2),
            "load_avg_1min_end": round(os.getloadavg()[0], 2),
        }
        for name, rows in answers.items()
    ]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--part", nargs="+", choices=("kernels", "engine", "agreement"), default=["kernels", "engine"]
    )
    parser.add_argument("--kernels", nargs="+", choices=KERNELS, default=list(KERNELS))
    parser.add_argument("--kernel-rounds", type=int, default=5)
    parser.add_argument("--servings", nargs="+", choices=list(SERVINGS), default=DEFAULT_SERVINGS)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--perplexity-tokens", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default: 2)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    for part, runner in (("kernels", run_kernels), ("engine", run_engine), ("agreement", run_agreement)):
        if part in args.part:
            for record in runner(args):
                print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
