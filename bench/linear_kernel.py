"""The float32 linear layers of a step, on each kernel the engine could run them on, at several row counts.

SmolLM2-135M's decoder-layer products (30 layers of q, k, v, o, gate, up and down: 576 -> 576, 576 -> 192
twice, 576 -> 1536 twice, 1536 -> 576), random weights from a fixed seed, each layer's own weights (so
they stream from memory as in a step), timed back to back:

- `panels`: the engine's kernel on weights packed into its panels (`engine.quantization.kernel`), all in
  one mapping on transparent huge pages, what `PackedLinears` installs;
- `panels_small_pages`: the same panels in one mapping on 4 KiB pages;
- `onednn`: oneDNN on weights packed for it (`torch.ops.mkldnn._linear_pointwise`), what the engine ran
  before and still runs in batch-invariant mode;
- `blas`: `F.linear` on the plain weights (MKL in torch's x86 wheels).

One JSON line per row count (best and median of `--repeats` passes per kernel, kernels alternating, and how
many passes of `panels` beat the `panels_small_pages` pass beside them), then a summary.

    python -m bench.linear_kernel --rows 1 16 32 64 256
"""

from __future__ import annotations

# isort: off
# First, before torch loads libgomp: the server's OpenMP defaults (service/openmp.py), as the server runs.
import service  # noqa: F401

# isort: on
import argparse
import json
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.offline_throughput import on_own_thread
from engine.quantization import kernel
from engine.runner.packed_linear import PanelArena

SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
LAYERS = 30
KERNELS = ("panels", "panels_small_pages", "onednn", "blas")


def _packed_panels(weights: list[torch.Tensor], huge_pages: bool) -> list[torch.Tensor]:
    """The weights' panels in one arena, as `PackedLinears` lays them out (the views keep it mapped)."""
    arena = PanelArena([kernel.float32_panels_shape(*weight.shape) for weight in weights], huge_pages)
    return [kernel.float32_panels(weight, out) for weight, out in zip(weights, arena.views, strict=True)]


def _products(
    weights: list[torch.Tensor],
    panels: dict[str, list[torch.Tensor]],
    onednn: list[torch.Tensor],
    inputs: dict[int, torch.Tensor],
) -> dict[str, Callable[[int], torch.Tensor]]:
    """Each kernel's product of layer `index` on the `inputs` rows of its input width."""

    def on_panels(name: str) -> Callable[[int], torch.Tensor]:
        return lambda index: kernel.float_linear(
            inputs[weights[index].shape[1]], panels[name][index], weights[index].shape[0], None
        )

    return {
        "panels": on_panels("panels"),
        "panels_small_pages": on_panels("panels_small_pages"),
        "onednn": lambda index: torch.ops.mkldnn._linear_pointwise(
            inputs[weights[index].shape[1]], onednn[index], None, "none", [], ""
        ),
        "blas": lambda index: F.linear(inputs[weights[index].shape[1]], weights[index]),
    }


def _measure(rows_list: list[int], repeats: int) -> dict[int, dict[str, float]]:
    """The best seconds of each kernel over all the layers, per row count."""
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(shape, generator=generator) * 0.02 for _ in range(LAYERS) for shape in SHAPES]
    panels = {
        "panels": _packed_panels(weights, huge_pages=True),
        "panels_small_pages": _packed_panels(weights, huge_pages=False),
    }
    onednn = [torch.ops.mkldnn._reorder_linear_weight(weight, None) for weight in weights]
    flops_per_row = 2 * sum(weight.numel() for weight in weights)
    results = {}
    for rows in rows_list:
        inputs = {width: torch.randn(rows, width, generator=generator) for width in (576, 1536)}
        products = _products(weights, panels, onednn, inputs)
        passes: dict[str, list[float]] = {name: [] for name in KERNELS}
        with torch.inference_mode():
            for _ in range(repeats):
                for name in KERNELS:
                    start = time.perf_counter()
                    for index in range(len(weights)):
                        products[name](index)
                    passes[name].append(time.perf_counter() - start)
        best = {name: min(seconds) for name, seconds in passes.items()}
        line: dict[str, object] = {"bench": "linear_kernel", "rows": rows}
        for name, seconds in best.items():
            line[f"{name}_ms"] = round(seconds * 1000, 1)
            line[f"{name}_median_ms"] = round(statistics.median(passes[name]) * 1000, 1)
            line[f"{name}_gflops"] = round(flops_per_row * rows / seconds / 1e9, 1)
        pairs = zip(passes["panels"], passes["panels_small_pages"], strict=True)
        line["huge_pages_faster_passes"] = f"{sum(huge < small for huge, small in pairs)}/{repeats}"
        print(json.dumps(line), flush=True)
        results[rows] = best
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 32, 64, 256])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    load_start = float(Path("/proc/loadavg").read_text().split()[0])
    results = on_own_thread(_measure, args.rows, args.repeats)
    summary = {
        "bench": "linear_kernel",
        "summary": True,
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit,
        "machine": platform.processor() or platform.machine(),
        "threads": args.threads,
        "load_avg_1min_start": load_start,
        "onednn_over_panels": {
            rows: round(best["onednn"] / best["panels"], 2) for rows, best in results.items()
        },
        "small_pages_over_huge_pages": {
            rows: round(best["panels_small_pages"] / best["panels"], 2) for rows, best in results.items()
        },
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
