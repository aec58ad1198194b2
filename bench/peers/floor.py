"""The weight-reading floor of one request's decode step: every linear layer of the model (the LM head
included) applied to one row with `F.linear`, timed back to back. At batch 1 a step reads all its weights
once and does little arithmetic per byte, so no engine's fp32 step can be much faster than this; the table
gives each engine's ms per token against it."""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from bench.offline_throughput import on_own_thread

REPEATS = 30


def _linear_step_ms(model_dir: str, threads: int) -> float:
    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    layers = [module for module in model.modules() if isinstance(module, torch.nn.Linear)]
    inputs = [torch.randn(1, layer.in_features) for layer in layers]
    timings = []
    with torch.no_grad():
        for _ in range(REPEATS):
            start = time.perf_counter()
            for layer, values in zip(layers, inputs, strict=True):
                F.linear(values, layer.weight, layer.bias)
            timings.append(time.perf_counter() - start)
    return statistics.median(timings) * 1000


def weight_reading_floor_ms(model_dir: str, threads: int) -> float:
    """Median ms of one batch-1 pass over all linear layers, on a thread that ends with it (see
    `on_own_thread`: a libgomp team left on the main thread would slow what runs after it)."""
    return on_own_thread(_linear_step_ms, model_dir, threads)
