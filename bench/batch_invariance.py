"""Which operations give a row different bits depending on what else is in the batch, and by how much.

A request's numbers are batch-invariant when every operation computes each of its rows (tokens) the same
way whatever the other rows are. This script measures that, operation by operation, at the shapes of a
model, then end to end through the engine:

- `ops`: each operation of a decoder layer at the model's widths, on the first rows of a batch of M rows
  against the same rows computed alone (M = 1), for M from 1 to 2048: the linear layers through the BLAS
  (`F.linear`, MKL in torch's x86 wheels) and through oneDNN (`torch.ops.mkldnn._linear_pointwise`) on
  the plain weight and on the weight packed for it (what `engine.runner.packed_linear` calls), RMSNorm,
  the MLP's activation, RoPE's cos, the sampler's log_softmax over the vocabulary, and the activation at
  a width that is not a multiple of the vector width (the tail case).
- `attention`: cbserve's attention kernel (the C one on the CPU, the Triton one on CUDA) serving one
  sequence's queries three ways: as one prefill chunk (tiles of 16 queries), as two chunks split at
  another point, and one query at a time (decode tiles), compared row by row; with full attention and
  with a sliding window; in the default order and in batch-invariant mode's fixed order.
- `engine`: a needle prompt alone and among `--others` other prompts through `engine.generate_batch`
  (greedy, logprobs): tokens equal, and the largest logprob difference; and the engine's logprobs against
  a plain forward of prompt + output (`model(...)`), which is what a trainer computes.

Each measurement prints one JSON line (`--sections` picks which run); `varies` lists the row counts (or
splits) whose rows differ from the rows alone. `--model smollm2` (the embedded model, converted on first
use) or `tiny` (the offline benchmark's tiny Llama). `--batch-invariant` runs the engine section in
`ContinuousBatchingConfig(batch_invariant=True)` as well, with the plain forward under
`engine.trainer_exact`. `--device cuda` measures the GPU's kernels instead (cuBLAS and the mode's Triton
matmul, torch's reductions and the mode's row mean, the Triton attention kernel), as bench/gpu_check.sh
does.

    PYTHONPATH=. python bench/batch_invariance.py --model smollm2
    PYTHONPATH=. python bench/batch_invariance.py --device cuda --model tiny --batch-invariant
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
import random
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

import engine
from bench.offline_throughput import build_model, on_own_thread

BENCH_NAME = "batch_invariance"
SECTIONS = ("ops", "attention", "engine")
ROW_COUNTS = (1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 64, 100, 128, 255, 511, 1024, 2048)
# Rows compared at each count: the first ones, which every count has.
ROWS_COMPARED = 8
# A width that is not a multiple of the 16 floats torch's vector loops take at once (AVX2: two 8-float
# vectors), to show what happens to the elements past the last full vector.
MISALIGNED_WIDTH = 100
ATTENTION_PAGE_SIZE = 16
ATTENTION_LENGTH = 100
ATTENTION_WINDOW = 24

Operation = Callable[[torch.Tensor], torch.Tensor]


def row_variance(operation: Operation, width: int, seed: int, device: torch.device) -> dict[str, Any]:
    """`operation` on the first rows of batches of every ROW_COUNTS size against each row alone."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(max(ROW_COUNTS), width, generator=generator).to(device)
    alone = torch.cat([operation(inputs[row : row + 1]) for row in range(ROWS_COMPARED)])
    varies: list[int] = []
    largest = 0.0
    for count in ROW_COUNTS:
        rows = min(count, ROWS_COMPARED)
        batched = operation(inputs[:count])[:rows]
        if not torch.equal(batched, alone[:rows]):
            varies.append(count)
            largest = max(largest, (batched - alone[:rows]).abs().max().item())
    return {"varies": varies, "max_abs_diff": largest}


def rms_norm(weight: torch.Tensor, eps: float, mean: Callable[[torch.Tensor], torch.Tensor]) -> Operation:
    """Llama's RMSNorm, as transformers writes it, with `mean` for its `pow(2).mean(-1, keepdim=True)`."""

    def operation(hidden: torch.Tensor) -> torch.Tensor:
        variance = mean(hidden.pow(2))
        return weight * (hidden * torch.rsqrt(variance + eps))

    return operation


def rope_cos(head_dim: int, device: torch.device) -> Operation:
    """cos of RoPE's angles for rows of positions, as the rotary embedding computes them."""
    inverse_frequencies = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))

    def operation(positions: torch.Tensor) -> torch.Tensor:
        angles = positions[:, :1].abs() * 100 * inverse_frequencies
        return torch.cat((angles, angles), dim=-1).cos()

    return operation


def linear_libraries(weight: torch.Tensor) -> list[tuple[str, Operation]]:
    """The ways a linear layer can run on `weight`'s device: what the default mode and batch-invariant mode
    call there."""
    if weight.device.type == "cuda":
        from engine.runner.batch_invariant_cuda import matmul

        return [
            ("cublas", lambda rows: F.linear(rows, weight)),
            ("triton_fixed_tile", lambda rows: matmul(rows, weight)),
        ]
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    return [
        ("blas", lambda rows: F.linear(rows, weight)),
        ("onednn", lambda rows: torch.ops.mkldnn._linear_pointwise(rows, weight, None, "none", [], "")),
        (
            "onednn_packed",
            lambda rows: torch.ops.mkldnn._linear_pointwise(rows, packed, None, "none", [], ""),
        ),
    ]


def measure_ops(model: torch.nn.Module, device: torch.device) -> list[dict[str, Any]]:
    text_config = model.config.get_text_config()
    records = []
    shapes = sorted(
        {tuple(module.weight.shape) for module in model.modules() if isinstance(module, torch.nn.Linear)}
    )
    for out_features, in_features in shapes:
        weight = (torch.randn(out_features, in_features) / in_features**0.5).to(device)
        for library, operation in linear_libraries(weight):
            record = row_variance(operation, in_features, out_features, device)
            records.append({"op": f"linear {in_features}->{out_features}", "library": library, **record})
    hidden, intermediate = text_config.hidden_size, text_config.intermediate_size
    head_dim = getattr(text_config, "head_dim", None) or hidden // text_config.num_attention_heads
    norm_weight = torch.randn(hidden).to(device)
    means: list[tuple[str, Callable[[torch.Tensor], torch.Tensor]]] = [
        ("torch", lambda x: x.mean(-1, keepdim=True))
    ]
    if device.type == "cuda":
        from engine.runner.batch_invariant_cuda import row_mean

        means.append(("triton_row_mean", lambda x: row_mean(x, keepdim=True)))
    for library, mean in means:
        record = row_variance(rms_norm(norm_weight, 1e-5, mean), hidden, 1, device)
        records.append({"op": f"rms_norm {hidden}", "library": library, **record})
    for width, seed in ((intermediate, 2), (MISALIGNED_WIDTH, 3)):
        records.append(
            {"op": f"silu(x) * x {width}", **row_variance(lambda x: F.silu(x) * x, width, seed, device)}
        )
    records.append(
        {"op": f"rope cos {head_dim}", **row_variance(rope_cos(head_dim, device), head_dim, 4, device)}
    )
    vocab = text_config.vocab_size
    for name, function in (("log_softmax", torch.log_softmax), ("softmax", torch.softmax)):
        record = row_variance(lambda x, f=function: f(x, dim=-1), vocab, 5, device)
        records.append({"op": f"{name} {vocab}", **record})
    return records


def attention_kernel(device: torch.device) -> Callable[..., torch.Tensor] | None:
    if device.type == "cuda":
        from engine.runner.paged_attention_kernel import paged_attention

        return paged_attention
    from engine.runner import paged_attention_cpu

    return paged_attention_cpu.load(torch.float32)


def measure_attention(
    model: torch.nn.Module, sliding_window: int | None, device: torch.device
) -> dict[str, Any]:
    """The kernel on one sequence: one chunk, two chunks, one query at a time; in the default order and
    in the fixed one (where every tile holds up to 16 queries, as batch-invariant steps' do)."""
    kernel = attention_kernel(device)
    if kernel is None:
        return {"op": "paged_attention", "error": "the kernel could not be built here"}
    text_config = model.config.get_text_config()
    num_heads = text_config.num_attention_heads
    num_kv_heads = getattr(text_config, "num_key_value_heads", None) or num_heads
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // num_heads
    generator = torch.Generator().manual_seed(0)
    length, page = ATTENTION_LENGTH, ATTENTION_PAGE_SIZE
    num_pages = -(-length // page)
    keys = torch.randn(num_pages * page, num_kv_heads, head_dim, generator=generator).to(device)
    values = torch.randn(num_pages * page, num_kv_heads, head_dim, generator=generator).to(device)
    queries = torch.randn(length, num_heads, head_dim, generator=generator).to(device)
    table = torch.arange(num_pages, dtype=torch.int32, device=device).unsqueeze(0)
    scale = head_dim**-0.5

    def int32(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)

    def chunk(start: int, end: int, queries_per_tile: int, fixed_order: bool) -> torch.Tensor:
        """Queries of positions [start, end) as one request's chunk, the keys before them cached."""
        tiles = list(range(0, end - start, queries_per_tile))
        return kernel(
            queries[start:end].contiguous(),
            keys,
            values,
            table,
            int32([0, end - start]),
            int32([end]),
            int32([0] * len(tiles)),
            int32(tiles),
            queries_per_tile,
            page,
            scale,
            None,
            sliding_window,
            False,
            fixed_order,
        )

    varies: dict[str, dict[str, float]] = {}
    for order, fixed, decode_tile in (("default", False, 1), ("fixed_order", True, 16)):
        whole = chunk(0, length, 16, fixed)
        results = {
            "two chunks (37 + 63)": torch.cat([chunk(0, 37, 16, fixed), chunk(37, length, 16, fixed)]),
            "one query at a time (decode tiles)": torch.cat(
                [chunk(p, p + 1, decode_tile, fixed) for p in range(length)]
            ),
        }
        varies[order] = {
            name: (result - whole).abs().max().item()
            for name, result in results.items()
            if not torch.equal(result, whole)
        }
    return {
        "op": "paged_attention",
        "device": device.type,
        "sliding_window": sliding_window,
        "against": "one chunk, tiles of 16 queries",
        "varies": varies,
    }


def smollm2(device: torch.device) -> tuple[torch.nn.Module, list[list[int]]]:
    from service.default_model import ensure_default_model
    from service.model_loading import load_pretrained

    model, tokenizer = load_pretrained(str(ensure_default_model()), str(device), "float32")
    questions = (
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "Explain photosynthesis in two sentences.",
        "What does a compiler do?",
    )
    prompts = [
        [
            int(token)
            for token in tokenizer.apply_chat_template(
                [{"role": "user", "content": question}], add_generation_prompt=True, return_dict=False
            )
        ]
        for question in questions
    ]
    return model, prompts


def other_prompts(count: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(rng.randint(8, 200))] for _ in range(count)]


def measure_engine(
    model: torch.nn.Module, needle: list[int], others: int, new_tokens: int, batch_invariant: bool
) -> dict[str, Any]:
    """The needle alone, then among `others` prompts; and the engine against a plain forward."""
    vocab_size = model.config.get_text_config().vocab_size
    settings: dict[str, Any] = {"page_size": 16, "max_batch_tokens": 512}
    if batch_invariant:
        settings["batch_invariant"] = True

    def run(prompts: list[list[int]], index: int) -> tuple[list[int], list[float]]:
        config = engine.ContinuousBatchingConfig(**settings)
        outputs = list(
            engine.generate_batch(
                model,
                prompts,
                continuous_batching_config=config,
                max_new_tokens=new_tokens,
                eos_token_id=[],
                do_sample=False,
                logprobs=True,
                warmup=False,
            ).values()
        )
        return list(outputs[index].generated_tokens), list(outputs[index].logprobs)

    alone_tokens, alone_logprobs = run([needle], 0)
    batch = other_prompts(others, vocab_size, seed=7)
    position = len(batch) // 2
    batch.insert(position, needle)
    batched_tokens, batched_logprobs = run(batch, position)
    common = min(len(alone_logprobs), len(batched_logprobs))
    difference = torch.tensor(alone_logprobs[:common]) - torch.tensor(batched_logprobs[:common])
    with torch.no_grad():
        sequence = torch.tensor([needle + alone_tokens], device=next(model.parameters()).device)
        if batch_invariant:
            with engine.trainer_exact(model):
                logits = model(sequence).logits[0].float()
        else:
            logits = model(sequence).logits[0].float()
        log_probs = torch.log_softmax(logits, dim=-1).cpu()
        rows = torch.arange(len(needle) - 1, len(needle) - 1 + len(alone_tokens))
        trainer = log_probs[rows, torch.tensor(alone_tokens)]
    return {
        "op": "engine",
        "batch_invariant": batch_invariant,
        "others": others,
        "new_tokens": new_tokens,
        "tokens_equal": alone_tokens == batched_tokens,
        "logprobs_bitwise_equal": alone_logprobs == batched_logprobs,
        "max_abs_logprob_diff_alone_vs_batch": difference.abs().max().item(),
        "trainer_forward_bitwise_equal": torch.equal(trainer, torch.tensor(alone_logprobs)),
        "max_abs_logprob_diff_engine_vs_trainer_forward": (trainer - torch.tensor(alone_logprobs))
        .abs()
        .max()
        .item(),
    }


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if args.model == "smollm2":
        model, prompts = on_own_thread(smollm2, device)
        needle = prompts[0]
    else:
        model = on_own_thread(build_model, "tiny", device)
        needle = other_prompts(1, model.config.vocab_size, seed=1)[0]
    context = {
        "bench": BENCH_NAME,
        "model": args.model,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }
    records: list[dict[str, Any]] = []
    if "ops" in args.sections:
        records.extend({**context, **record} for record in on_own_thread(measure_ops, model, device))
    if "attention" in args.sections:
        for sliding_window in (None, ATTENTION_WINDOW):
            records.append({**context, **on_own_thread(measure_attention, model, sliding_window, device)})
    modes = [False, True] if args.batch_invariant else [False]
    for batch_invariant in modes if "engine" in args.sections else []:
        record = on_own_thread(measure_engine, model, needle, args.others, args.new_tokens, batch_invariant)
        records.append({**context, **record})
    return records


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--others", type=int, default=31, help="prompts batched with the needle")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument(
        "--batch-invariant", action="store_true", help="also run the engine section with batch_invariant=True"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    for record in run(parse_args(argv)):
        print(json.dumps(record), flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
