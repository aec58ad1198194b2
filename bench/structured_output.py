"""Throughput of a batch with half its requests under a grammar
(engine.sampling.structured_output) against none.

Both workloads run the same random-weight llama (with the vocabulary of the embedded SmolLM2's tokenizer,
whose tokenizer the grammars are compiled for) on the same prompts, in alternating rounds (none, half,
none, half, ...) so that drift in machine load hits both alike, after one untimed warmup run of each.
Every request generates `--new-tokens` tokens: the unconstrained ones ignore EOS, and the constrained ones
follow a grammar that a random model practically never ends early (`--grammar regex`: lowercase words;
`--grammar json`: a JSON object of one long string); generated tokens are counted, not assumed. The grammar
is compiled before the timed rounds (each distinct spec compiles once per engine; its cost is reported
apart).

    python -m bench.structured_output
    python -m bench.structured_output --device cuda --dtype bfloat16 --num-requests 64

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

import engine
from service.default_model import default_model_dir, find_gguf, is_converted

GRAMMARS = {
    "regex": engine.StructuredOutput("regex", r"[a-z]+( [a-z]+)*"),
    "json": engine.StructuredOutput(
        "json_schema",
        json.dumps({"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}),
    ),
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--grammar", choices=tuple(GRAMMARS), default="regex")
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--async-batching", action="store_true")
    return parser.parse_args(argv)


def load_tokenizer() -> Any:
    folder = default_model_dir()
    if is_converted(folder):
        return AutoTokenizer.from_pretrained(str(folder))
    gguf = find_gguf()
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def build_model(args: argparse.Namespace, vocab_size: int) -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=4 * args.hidden_size,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(config).to(device=args.device, dtype=getattr(torch, args.dtype))
    return model.eval()


def run_once(
    manager: engine.ContinuousBatchingManager,
    prompts: list[list[int]],
    new_tokens: int,
    structured_output: engine.StructuredOutput | None,
) -> dict[str, Any]:
    """One batch: the odd-numbered requests carry `structured_output` (when given)."""
    runner = manager._engine.runner if manager._engine is not None else None
    sample_before = runner.timings.sample_s if runner is not None else 0.0
    started = time.perf_counter()
    ids = []
    for index, prompt in enumerate(prompts):
        constrained = structured_output is not None and index % 2 == 1
        ids.append(
            manager.add_request(
                prompt,
                max_new_tokens=new_tokens,
                eos_token_id=[],
                **({"structured_output": structured_output} if constrained else {}),
            )
        )
    outputs = [manager.get_result(request_id, timeout=3600) for request_id in ids]
    elapsed = time.perf_counter() - started
    assert all(output is not None and output.error is None for output in outputs), outputs
    tokens = sum(len(output.generated_tokens) for output in outputs if output is not None)
    constrained_tokens = sum(
        len(output.generated_tokens) for index, output in enumerate(outputs) if output and index % 2 == 1
    )
    sample_s = (runner.timings.sample_s - sample_before) if runner is not None else 0.0
    return {"seconds": elapsed, "tokens": tokens, "odd_tokens": constrained_tokens, "sample_s": sample_s}


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    tokenizer = load_tokenizer()
    model = build_model(args, len(tokenizer))
    generator = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(3, len(tokenizer), (args.prompt_tokens,), generator=generator).tolist()
        for _ in range(args.num_requests)
    ]
    config = engine.ContinuousBatchingConfig(
        max_requests_per_batch=args.num_requests,
        use_async_batching=args.async_batching,
    )
    manager = engine.ContinuousBatchingManager(model, continuous_batching_config=config, tokenizer=tokenizer)
    structured_output = GRAMMARS[args.grammar]
    compiled = time.perf_counter()
    assert manager._ensure_engine().grammars is not None
    manager._ensure_engine().grammars.compile(structured_output)  # type: ignore[union-attr]
    compile_s = time.perf_counter() - compiled
    manager.start()
    results: dict[str, list[dict[str, Any]]] = {"none": [], "half": []}
    try:
        for constraint in (None, structured_output):
            run_once(manager, prompts, args.new_tokens, constraint)  # warmup
        for _ in range(args.rounds):
            for name, constraint in (("none", None), ("half", structured_output)):
                results[name].append(run_once(manager, prompts, args.new_tokens, constraint))
    finally:
        manager.destroy()

    def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
        rates = [run["tokens"] / run["seconds"] for run in runs]
        return {
            "tokens_per_s_median": round(statistics.median(rates), 1),
            "tokens_per_s_runs": [round(rate, 1) for rate in rates],
            "tokens_per_run": [run["tokens"] for run in runs],
            "sample_s_per_run": round(statistics.median(run["sample_s"] for run in runs), 4),
        }

    none, half = summary(results["none"]), summary(results["half"])
    return {
        "bench": "structured_output",
        "grammar": args.grammar,
        "spec": structured_output.spec,
        "device": args.device,
        "dtype": args.dtype,
        "platform": platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "num_requests": args.num_requests,
        "constrained_requests": args.num_requests // 2,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "vocab_size": len(tokenizer),
        "hidden_size": args.hidden_size,
        "layers": args.layers,
        "async_batching": args.async_batching,
        "rounds": args.rounds,
        "grammar_compile_s": round(compile_s, 4),
        "none": none,
        "half": half,
        "half_over_none": round(half["tokens_per_s_median"] / none["tokens_per_s_median"], 3),
    }


def main(argv: Sequence[str] | None = None) -> None:
    print(json.dumps(run_benchmark(parse_args(argv)), indent=1), flush=True)


if __name__ == "__main__":
    main()
