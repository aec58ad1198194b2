"""What a run reports: the machine and its load, each engine's medians over the rounds, the markdown table
and the plot."""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
WORKLOADS = ("chats", "one_request", "concurrent")
# The flags that decide which kernels the engines pick; the full list is long and says little more.
CPU_FLAGS_OF_INTEREST = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512_bf16",
    "avx512_vnni",
    "amx_tile",
    "amx_bf16",
)


def cpu_model_and_flags(cpuinfo: str) -> tuple[str, list[str]]:
    """The first processor's model name and, of `CPU_FLAGS_OF_INTEREST`, those it has, from
    /proc/cpuinfo's text."""
    model, flags = "unknown", set[str]()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and model == "unknown":
            model = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    return model, [flag for flag in CPU_FLAGS_OF_INTEREST if flag in flags]


def _command_output(command: Sequence[str]) -> str:
    try:
        return subprocess.run(
            command, capture_output=True, text=True, cwd=REPO_ROOT, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _commit() -> str:
    """HEAD's short hash, marked when tracked files differ from it (the figures are then not HEAD's)."""
    commit = _command_output(["git", "rev-parse", "--short", "HEAD"])
    if _command_output(["git", "status", "--porcelain", "--untracked-files=no"]) not in ("", "unknown"):
        commit += " with uncommitted changes"
    return commit


def machine() -> dict[str, Any]:
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = ""
    model, flags = cpu_model_and_flags(cpuinfo)
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": _commit(),
        "cpu": model,
        "cpu_flags": flags,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "uptime": _command_output(["uptime"]),
    }


def _without_end_token(tokens: Sequence[int], end_tokens: frozenset[int]) -> list[int]:
    return list(tokens[:-1]) if tokens and tokens[-1] in end_tokens else list(tokens)


def equal_outputs(
    outputs: Sequence[Sequence[int]],
    reference: Sequence[Sequence[int]],
    end_tokens: frozenset[int] = frozenset(),
) -> int:
    """How many requests generated exactly the reference's tokens (same ids, same length), a final token
    of `end_tokens` (EOS) left out on both sides: llama.cpp stops at EOS without returning it, cbserve
    and vLLM return it."""
    if len(outputs) != len(reference):
        raise ValueError(f"{len(outputs)} outputs against {len(reference)} reference outputs")
    return sum(
        _without_end_token(mine, end_tokens) == _without_end_token(theirs, end_tokens)
        for mine, theirs in zip(outputs, reference, strict=True)
    )


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 2) if values else None


@dataclass(frozen=True)
class EngineRow:
    """One engine's line of the table: medians over the rounds it completed."""

    engine: str
    label: str
    weights: str
    rounds: int
    chats_tokens_per_s: float | None
    one_request_ms_per_token: float | None
    one_request_ttft_ms: float | None
    concurrent_tokens_per_s: float | None
    concurrent_ttft_p50_ms: float | None
    outputs_equal_to_cbserve: str
    failed_requests: int
    error: str | None = None


def engine_row(
    engine: str,
    label: str,
    weights: str,
    rounds: list[dict[str, Any]],
    reference_outputs: list[list[int]] | None,
    error: str | None = None,
    end_tokens: frozenset[int] = frozenset(),
) -> EngineRow:
    """`rounds`: the engine's per-round records (`chats`, `one_request`, `concurrent`). Outputs are
    compared in the first round, with cbserve's first round (`reference_outputs`), EOS left out."""

    def figures(workload: str, key: str) -> list[float]:
        return [record[workload][key] for record in rounds if record[workload].get(key) is not None]

    equal = "-"
    if rounds and reference_outputs is not None and engine != "cbserve":
        outputs = rounds[0]["chats"]["outputs"]
        equal = f"{equal_outputs(outputs, reference_outputs, end_tokens)}/{len(reference_outputs)}"
    failed = sum(record[workload]["failed_requests"] for record in rounds for workload in WORKLOADS)
    return EngineRow(
        engine=engine,
        label=label,
        weights=weights,
        rounds=len(rounds),
        chats_tokens_per_s=_median(figures("chats", "tokens_per_s")),
        one_request_ms_per_token=_median(figures("one_request", "ms_per_token")),
        one_request_ttft_ms=_median(figures("one_request", "ttft_ms")),
        concurrent_tokens_per_s=_median(figures("concurrent", "tokens_per_s")),
        concurrent_ttft_p50_ms=_median(figures("concurrent", "ttft_p50_ms")),
        outputs_equal_to_cbserve=equal,
        failed_requests=failed,
        error=error,
    )


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def _workloads_paragraph(settings: dict[str, Any]) -> str:
    tokens, concurrent = settings["max_new_tokens"], settings["concurrent"]
    sentences = (
        f"Workloads, {settings['rounds']} alternating rounds, medians shown:",
        f"{settings['chats']} chat prompts all at once (greedy, up to {tokens} new tokens, EOS on);",
        f"one request alone ({tokens} tokens, EOS ignored);",
        f"{concurrent} concurrent requests ({settings['concurrent_new_tokens']} tokens each, EOS ignored).",
        "Every engine is called through its own network API (cbserve over gRPC with the Python SDK, on one",
        "session's stream; the others over HTTP), streaming, with prompt caching off. Outputs are compared",
        "in the first round's",
        "chats, request by request, with cbserve's.",
    )
    if settings.get("neighbour"):
        sentences += ("Every round ran beside one busy process (a Python spin loop) pinned to CPU 0.",)
    return " ".join(sentences)


def _header(settings: dict[str, Any]) -> list[str]:
    columns = (
        "engine",
        "weights",
        f"{settings['chats']} chats, tok/s",
        "one request, ms/token",
        "one request, TTFT ms",
        f"{settings['concurrent']} concurrent, tok/s",
        f"{settings['concurrent']} concurrent, TTFT p50 ms",
        "outputs equal to cbserve",
        "rounds",
    )
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]


def markdown(
    rows: list[EngineRow], about: dict[str, Any], settings: dict[str, Any], floor_ms: float | None
) -> str:
    lines = [
        "# cbserve against vLLM CPU and llama.cpp",
        "",
        f"Measured {about['date']} at commit `{about['commit']}` by `python -m bench.peers run`, on "
        f"{about['cpu']} ({about['cores']} cores; flags: {', '.join(about['cpu_flags']) or 'none listed'})."
        f" Load at the start: `{about['uptime_start']}`; at the end: `{about['uptime_end']}`.",
        "",
        _workloads_paragraph(settings),
        "",
        *_header(settings),
    ]
    for row in rows:
        if row.error is not None and row.rounds == 0:
            lines.append(
                f"| {row.label} | {row.weights} | not run: {row.error.splitlines()[0][:160]} |||||||"
            )
            continue
        lines.append(
            f"| {row.label} | {row.weights} | {_cell(row.chats_tokens_per_s)} "
            f"| {_cell(row.one_request_ms_per_token)} | {_cell(row.one_request_ttft_ms)} "
            f"| {_cell(row.concurrent_tokens_per_s)} | {_cell(row.concurrent_ttft_p50_ms)} "
            f"| {row.outputs_equal_to_cbserve} | {row.rounds} |"
        )
    if floor_ms is not None:
        lines += [
            "",
            f"Weight-reading floor of one fp32 decode step (all linear layers at batch 1, the faster of "
            f"`F.linear` and cbserve's float32 kernel, "
            f"{settings['threads']} threads, measured in this run before the servers started): "
            f"{floor_ms:.1f} ms.",
        ]
    failed = [row for row in rows if row.failed_requests]
    if failed:
        lines += ["", "Failed requests: " + ", ".join(f"{row.label} {row.failed_requests}" for row in failed)]
    if settings.get("note"):
        lines += ["", f"Note: {settings['note']}"]
    lines += ["", "![throughput and latency per engine](peers.png)", ""]
    return "\n".join(lines)


def plot(rows: list[EngineRow], path: Path, title: str) -> None:
    """Three bar charts side by side: 32-chat and concurrent throughput (higher is better) and one
    request's ms per token (lower is better)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [row for row in rows if row.rounds > 0]
    labels = [f"{row.engine}\n{row.weights}" for row in measured]
    panels = (
        ("32 chats, tokens/s", [row.chats_tokens_per_s or 0.0 for row in measured]),
        ("concurrent requests, tokens/s", [row.concurrent_tokens_per_s or 0.0 for row in measured]),
        (
            "one request, ms/token (lower is better)",
            [row.one_request_ms_per_token or 0.0 for row in measured],
        ),
    )
    figure, axes = plt.subplots(1, len(panels), figsize=(15, 4.5))
    for axis, (name, values) in zip(axes, panels, strict=True):
        bars = axis.bar(
            labels, values, color=["tab:blue" if row.engine == "cbserve" else "tab:gray" for row in measured]
        )
        axis.bar_label(bars, fmt="%.1f")
        axis.set_title(name)
        axis.tick_params(axis="x", labelsize=8)
    figure.suptitle(title, fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
