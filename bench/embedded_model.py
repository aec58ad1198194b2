"""Offline throughput on the embedded SmolLM2-135M-Instruct: chat prompts, EOS on, greedy.

cbserve's `generate_batch` against transformers' continuous batching (its fixed CPU configuration from
`bench/offline_throughput.py`) on the same model and prompts, in alternating rounds, and every output
checked token for token against one-at-a-time `model.generate` (greedy, the model's EOS). Prints JSON
lines: one per engine, then a summary with the ratio. `--dtype bfloat16` measures the same in bf16, whose
outputs are reported as the fraction of tokens equal to bf16 `generate`'s (exact equality across batch
shapes is not expected in bf16).

Run from the repository root (the first run converts the embedded model, about a minute):

    PYTHONPATH=. python bench/embedded_model.py
    PYTHONPATH=. python bench/embedded_model.py --dtype bfloat16 --engines cbserve
"""

from __future__ import annotations

# isort: off
# First, before torch loads libgomp: importing the server package sets its OpenMP defaults
# (service/openmp.py), so the in-process engines here run as the server's does.
import service  # noqa: F401

# isort: on
import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
from transformers import GenerationConfig

import engine
from bench.offline_throughput import (
    EngineOptions,
    add_compile_level_argument,
    add_no_pack_cpu_weights_argument,
    on_own_thread,
    transformers_cb_config,
)
from service.default_model import ensure_default_model
from service.model_loading import load_pretrained

BENCH_NAME = "embedded_model"
ENGINES = ("cbserve", "transformers_cb", "cbserve_eager", "cbserve_batch_invariant")
# What a run compares unless --engines says otherwise; cbserve_eager (cbserve on its defaults, never
# compiled) is for runs with --compile-level or --no-pack-cpu-weights, to measure either against the
# defaults in the same alternating rounds.
DEFAULT_ENGINES = ("cbserve", "transformers_cb")
QUESTIONS = (
    "What is the capital of France?",
    "Explain photosynthesis in two sentences.",
    "Write a haiku about the sea.",
    "List three uses of a paperclip.",
    "What is 17 times 23?",
    "Translate 'good morning' into Spanish.",
    "Give me a tip for learning to cook.",
    "Why is the sky blue?",
    "Name a famous painting and its painter.",
    "What does a compiler do?",
    "Suggest a name for a pet turtle.",
    "Describe a rainy day in one paragraph.",
    "What are the primary colors?",
    "How do I boil an egg?",
    "Summarize the plot of Romeo and Juliet.",
    "What is the boiling point of water at sea level?",
    "Write a short poem about coffee.",
    "What is machine learning?",
    "Give two reasons to exercise.",
    "Who wrote Pride and Prejudice?",
    "What is the largest planet in the solar system?",
    "How many continents are there? Name them.",
    "Write a limerick about a cat.",
    "What is the difference between weather and climate?",
    "Recommend a book for a long flight.",
    "What is a prime number?",
    "Explain what a rainbow is to a child.",
    "Write a thank-you note to a teacher.",
    "What causes the seasons?",
    "How does a bicycle stay upright?",
    "Give a one-line definition of gravity.",
    "What should I pack for a day hike?",
)


def chat_prompts(tokenizer: Any, count: int) -> list[list[int]]:
    prompts = []
    for index in range(count):
        messages = [{"role": "user", "content": QUESTIONS[index % len(QUESTIONS)]}]
        rendered = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True
        )
        prompts.append(list(rendered["input_ids"]))
    return prompts


def greedy_config(model: Any, max_new_tokens: int) -> GenerationConfig:
    eos = model.generation_config.eos_token_id
    return GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=eos if isinstance(eos, int) else eos[0],
    )


def run_engine(
    name: str,
    model: Any,
    prompts: list[list[int]],
    config: GenerationConfig,
    compile_level: int = 0,
    pack_cpu_weights: bool = True,
) -> list[list[int]]:
    """`compile_level` and `pack_cpu_weights` apply to the engine named cbserve; cbserve_eager keeps the
    engine's defaults; cbserve_batch_invariant is cbserve on its defaults with `batch_invariant=True`."""
    model.set_attn_implementation("sdpa")
    if name in ("cbserve", "cbserve_eager", "cbserve_batch_invariant"):
        outputs = engine.generate_batch(
            model,
            prompts,
            generation_config=config,
            continuous_batching_config=engine.ContinuousBatchingConfig(
                page_size=16,
                max_batch_tokens=2048,
                default_compile_level=compile_level if name == "cbserve" else 0,
                pack_cpu_weights=pack_cpu_weights or name != "cbserve",
                batch_invariant=name == "cbserve_batch_invariant",
            ),
        )
    else:
        outputs = model.generate_batch(
            inputs=prompts,
            generation_config=config,
            continuous_batching_config=transformers_cb_config(EngineOptions()),
        )
    if len(outputs) != len(prompts):
        raise RuntimeError(f"{name} returned {len(outputs)} results for {len(prompts)} prompts")
    return [list(output.generated_tokens) for output in outputs.values()]


def reference(model: Any, prompts: list[list[int]], config: GenerationConfig) -> list[list[int]]:
    """One-at-a-time `generate`: no batch, no padding."""
    model.set_attn_implementation("sdpa")
    tokens = []
    with torch.no_grad():
        for prompt in prompts:
            output = model.generate(torch.tensor([prompt]), generation_config=config)
            tokens.append(output[0, len(prompt) :].tolist())
    return tokens


def equal_fraction(tokens: list[list[int]], expected: list[list[int]]) -> float:
    """Tokens equal to the reference's at the same position, over the reference's tokens."""
    equal = sum(
        sum(a == b for a, b in zip(row, want, strict=False))
        for row, want in zip(tokens, expected, strict=True)
    )
    return equal / max(1, sum(len(want) for want in expected))


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    load_at_start = os.getloadavg()[0]
    model, tokenizer = on_own_thread(load_pretrained, ensure_default_model(), "cpu", args.dtype)
    model.eval()
    prompts = chat_prompts(tokenizer, args.requests)
    config = greedy_config(model, args.max_new_tokens)
    # Every torch call runs on a thread that ends with it (see `on_own_thread`).
    expected = on_own_thread(reference, model, prompts, config)
    for name in args.engines:  # untimed warmup on a few prompts (compilation included)
        start = time.perf_counter()
        on_own_thread(run_engine, name, model, prompts[:4], config, args.compile_level, args.pack_cpu_weights)
        print(f"warmup {name}: {time.perf_counter() - start:.1f} s", file=sys.stderr)
    wall: dict[str, list[float]] = {name: [] for name in args.engines}
    outputs: dict[str, list[list[int]]] = {}
    for _ in range(args.repeats):
        for name in args.engines:
            start = time.perf_counter()
            tokens = on_own_thread(
                run_engine, name, model, prompts, config, args.compile_level, args.pack_cpu_weights
            )
            wall[name].append(time.perf_counter() - start)
            outputs.setdefault(name, tokens)
    records: list[dict[str, Any]] = []
    throughput = {}
    for name in args.engines:
        median_s = statistics.median(wall[name])
        generated = sum(len(row) for row in outputs[name])
        throughput[name] = generated / median_s
        mismatched = sum(row != want for row, want in zip(outputs[name], expected, strict=True))
        records.append(
            {
                "bench": BENCH_NAME,
                "engine": name,
                "dtype": args.dtype,
                "requests": len(prompts),
                "prompt_tokens": sum(len(prompt) for prompt in prompts),
                "generated_tokens": generated,
                "wall_s": [round(seconds, 3) for seconds in wall[name]],
                "median_s": round(median_s, 3),
                "tokens_per_s": round(throughput[name], 1),
                "requests_differing_from_generate": mismatched,
                "tokens_equal_to_generate": round(equal_fraction(outputs[name], expected), 4),
            }
        )

    def ratio_to(peer: str) -> float | None:
        if "cbserve" in throughput and peer in throughput:
            return round(throughput["cbserve"] / throughput[peer], 3)
        return None

    records.append(
        {
            "bench": BENCH_NAME,
            "summary": True,
            "dtype": args.dtype,
            "cbserve_compile_level": args.compile_level,
            "cbserve_pack_cpu_weights": args.pack_cpu_weights,
            "cbserve_vs_transformers_cb": ratio_to("transformers_cb"),
            "cbserve_vs_cbserve_eager": ratio_to("cbserve_eager"),
            # How many times slower batch-invariant mode runs than cbserve on its defaults.
            "batch_invariant_slowdown": ratio_to("cbserve_batch_invariant"),
            "max_new_tokens": args.max_new_tokens,
            "reference": "one-at-a-time model.generate, greedy, the model's EOS",
            "threads": torch.get_num_threads(),
            "load_avg_1min_start": round(load_at_start, 2),
            "load_avg_1min_end": round(os.getloadavg()[0], 2),
            "torch": torch.__version__,
        }
    )
    return records


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(DEFAULT_ENGINES))
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1)
    add_compile_level_argument(parser)
    add_no_pack_cpu_weights_argument(parser)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args(argv)
    args.pack_cpu_weights = not args.no_pack_cpu_weights
    if args.requests < 1 or args.max_new_tokens < 1 or args.repeats < 1:
        parser.error("--requests, --max-new-tokens and --repeats must be at least 1")
    args.engines = list(dict.fromkeys(args.engines))
    return args


def main(argv: Sequence[str] | None = None) -> None:
    for record in run(parse_args(argv)):
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
