"""The weight-reading floor of one request's decode step: every linear layer of the model (the LM head
included) applied to one row, timed back to back, by the faster of torch's `F.linear` and cbserve's
float32 kernel (`engine.quantization.kernel.float_linear`, on the weights packed into its panels). At
batch 1 a step reads all its weights once and does little arithmetic per byte, so no engine's fp32 step
can be much faster than the faster reader; the table gives each engine's ms per token against it.
(`F.linear` alone is no floor here: the BLAS multiplies one row on one thread, at half of what two
threads stream.)"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from bench.offline_throughput import on_own_thread
from engine.quantization import kernel

REPEATS = 30


def _linear_step_ms(model_dir: str, threads: int) -> float:
    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    layers = [module for module in model.modules() if isinstance(module, torch.nn.Linear)]
    inputs = [torch.randn(1, layer.in_features) for layer in layers]
    with torch.no_grad():
        panels = [kernel.float32_panels(layer.weight) for layer in layers]
        readers = [
            lambda index, values: F.linear(values, layers[index].weight, layers[index].bias),
            lambda index, values: kernel.float_linear(
                values, panels[index], layers[index].out_features, layers[index].bias
            ),
        ]
        fastest = float("inf")
        for reader in readers:
            timings = []
            for _ in range(REPEATS):
                start = time.perf_counter()
                for index, values in enumerate(inputs):
                    reader(index, values)
                timings.append(time.perf_counter() - start)
            fastest = min(fastest, statistics.median(timings) * 1000)
    return fastest


def weight_reading_floor_ms(model_dir: str, threads: int) -> float:
    """Median ms of one batch-1 pass over all linear layers, on a thread that ends with it (see
    `on_own_thread`: a libgomp team left on the main thread would slow what runs after it)."""
    return on_own_thread(_linear_step_ms, model_dir, threads)
