"""One run: set each peer up and start its servers (cbserve's first, then vLLM's, which compiles while
llama.cpp builds, then llama.cpp's), warm each up, run the workloads in alternating
rounds, then print JSON and write the table and the plot.

A peer that fails to set up, to start or to warm up is reported with its error and the others still run.
All servers stay up for the whole run (vLLM compiles for minutes on every start), idle but for the one
being measured; a round measures the engines in a rotated order so that none always goes first.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.embedded_model import chat_prompts
from bench.peers import workloads
from bench.peers.cache import PeerCache, SetupError
from bench.peers.clients import (
    REQUEST_TIMEOUT_S,
    StreamRequest,
    cbserve_stream,
    llama_cpp_stream,
    vllm_stream,
)
from bench.peers.floor import weight_reading_floor_ms
from bench.peers.report import EngineRow, engine_row, machine, markdown, plot
from bench.peers.servers import ServerProcess, start_cbserve, start_llama_cpp, start_vllm
from bench.peers.setup_llama_cpp import LlamaCppInstall, setup_llama_cpp
from bench.peers.setup_vllm import setup_vllm
from service.default_model import ensure_default_model

WARMUP_REQUESTS = 4
VLLM_MODEL_NAME = "model"


@dataclass(frozen=True)
class EngineSpec:
    name: str
    label: str
    weights: str
    peer: str  # the setup it needs: "cbserve" (none), "vllm" or "llama.cpp"


ENGINES = {
    spec.name: spec
    for spec in (
        EngineSpec("cbserve", "cbserve (`cbserve serve`, gRPC)", "fp32", "cbserve"),
        EngineSpec(
            "cbserve_int4", "cbserve `--quantization int4` (the GGUF's own blocks)", "Q4_1 GGUF", "cbserve"
        ),
        EngineSpec("vllm", "vLLM CPU 0.32.0, compute on all threads", "fp32", "vllm"),
        EngineSpec("vllm_default_threads", "vLLM CPU 0.32.0, its default threads", "fp32", "vllm"),
        EngineSpec("llama_f32", "llama.cpp `llama-server -kvu`", "F32 GGUF", "llama.cpp"),
        EngineSpec("llama_q4_1", "llama.cpp `llama-server -kvu`", "Q4_1 GGUF", "llama.cpp"),
    )
}
DEFAULT_ENGINES = ("cbserve", "cbserve_int4", "vllm", "llama_f32", "llama_q4_1")


def _first_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


# Each peer's setup, the quickest first: a run starts the servers of each peer as soon as it is set up, so
# that vLLM compiles its model while llama.cpp is still being built.
SETUP_STEPS: dict[str, Callable[[PeerCache], Any]] = {"vllm": setup_vllm, "llama.cpp": setup_llama_cpp}


def setup_peers(cache: PeerCache, peers: set[str]) -> tuple[dict[str, Any], dict[str, str]]:
    """Each needed peer's install, or its error: one peer's failure leaves the others to run."""
    installs: dict[str, Any] = {}
    errors: dict[str, str] = {}
    for peer in [peer for peer in SETUP_STEPS if peer in peers]:
        try:
            installs[peer] = SETUP_STEPS[peer](cache)
        except (SetupError, OSError, RuntimeError) as error:
            errors[peer] = _first_line(error)
            print(f"peers setup: {peer} is not available: {error}", file=sys.stderr, flush=True)
    return installs, errors


def _start(
    spec: EngineSpec,
    installs: dict[str, Any],
    model_dir: str,
    log_dir: Path,
    threads: int,
    running: contextlib.ExitStack,
) -> tuple[ServerProcess, Callable[[], StreamRequest]]:
    """The engine's server, started, and how to make its request function once it is ready. What the
    request function holds open is closed by ``running``, before the server stops."""
    if spec.peer == "cbserve":
        quantization = "int4" if spec.name == "cbserve_int4" else "none"
        server, target = start_cbserve(model_dir, log_dir, spec.name, quantization)

        def cbserve_requests() -> StreamRequest:
            from cbserve_client import Client

            client = running.enter_context(Client(target, stream_timeout=REQUEST_TIMEOUT_S))
            return cbserve_stream(running.enter_context(client.session()))

        return server, cbserve_requests
    if spec.peer == "vllm":
        compute_threads = None if spec.name == "vllm_default_threads" else threads
        server, port = start_vllm(installs["vllm"], model_dir, log_dir, spec.name, compute_threads)
        return server, lambda: vllm_stream(port, VLLM_MODEL_NAME)
    llama: LlamaCppInstall = installs["llama.cpp"]
    gguf = llama.f32_gguf if spec.name == "llama_f32" else llama.q4_1_gguf
    server, port = start_llama_cpp(llama.server, gguf, log_dir, spec.name, threads)
    return server, lambda: llama_cpp_stream(port)


# What `--neighbour` runs beside the engines: a Python spin loop, pinned to one CPU.
NEIGHBOUR_CPU = 0


@contextlib.contextmanager
def busy_neighbour(enabled: bool) -> Iterator[subprocess.Popen[bytes] | None]:
    """While the rounds run, one process spinning on CPU `NEIGHBOUR_CPU` (the neighbour a shared machine or
    an over-committed node gives an engine), yielded; nothing when not `enabled`."""
    if not enabled:
        yield None
        return
    process = subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL)
    try:
        os.sched_setaffinity(process.pid, {NEIGHBOUR_CPU})
        yield process
    finally:
        process.kill()
        process.wait()


def _warm_up(stream: StreamRequest, prompts: list[list[int]], max_new_tokens: int) -> None:
    traces, _ = workloads.run_concurrently(
        stream, prompts[:WARMUP_REQUESTS], max_new_tokens, ignore_eos=False
    )
    errors = [trace.error for trace in traces if trace.error is not None]
    if errors:
        raise RuntimeError(f"{len(errors)} of {len(traces)} warmup requests failed: {errors[0]}")


def _settle(stream: StreamRequest, prompts: list[list[int]], max_new_tokens: int) -> None:
    """The warmup's requests again, right before an engine's first round. The engines were warmed as each
    became ready, and one that has been idle since may still act on what it saw then: cbserve's thread
    budget last sampled the machine while vLLM compiled on every core, and samples again only when it
    steps, so its first round began on one thread and reached two a second later."""
    with contextlib.suppress(RuntimeError):  # failed requests: the round that follows reports them
        _warm_up(stream, prompts, max_new_tokens)


def _emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


def _without_outputs(record: dict[str, Any]) -> dict[str, Any]:
    return {**record, "chats": {key: value for key, value in record["chats"].items() if key != "outputs"}}


def run(args: argparse.Namespace) -> list[EngineRow]:
    about = machine()
    about["uptime_start"] = about.pop("uptime")

    def settings(completed_rounds: int) -> dict[str, Any]:
        return {
            "rounds": completed_rounds,
            "chats": args.chats,
            "max_new_tokens": args.max_new_tokens,
            "concurrent": args.concurrent,
            "concurrent_new_tokens": args.concurrent_new_tokens,
            "threads": args.threads,
            "neighbour": args.neighbour,
            "note": args.note,
        }

    cache = PeerCache(Path(args.cache_dir)) if args.cache_dir else PeerCache.default()
    specs = [ENGINES[name] for name in args.engines]
    errors: dict[str, str] = {}
    model_dir = ensure_default_model()
    from transformers import AutoTokenizer, GenerationConfig

    prompts = chat_prompts(AutoTokenizer.from_pretrained(model_dir), args.chats)
    eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
    end_tokens = frozenset([eos] if isinstance(eos, int) else eos or [])
    floor_ms = None if args.no_floor else round(weight_reading_floor_ms(model_dir, args.threads), 2)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
    log_dir = cache.logs / f"run-{stamp}"
    log_dir.mkdir(parents=True, exist_ok=True)
    rounds: dict[str, list[dict[str, Any]]] = {spec.name: [] for spec in specs}
    rows: list[EngineRow] = []
    out = Path(args.out)
    report = ReportWriter(specs, errors, about, floor_ms, end_tokens, out)
    with contextlib.ExitStack() as running:
        started: dict[str, tuple[ServerProcess, Callable[[], StreamRequest]]] = {}
        for peer in ["cbserve", *SETUP_STEPS]:
            peer_specs = [spec for spec in specs if spec.peer == peer]
            installs, setup_errors = setup_peers(cache, {peer}) if peer_specs else ({}, {})
            for spec in peer_specs:
                if peer in setup_errors:
                    errors[spec.name] = setup_errors[peer]
                    continue
                try:
                    started[spec.name] = _start(spec, installs, model_dir, log_dir, args.threads, running)
                    running.callback(started[spec.name][0].stop)
                except (OSError, RuntimeError) as error:
                    errors[spec.name] = _first_line(error)
        streams: dict[str, StreamRequest] = {}
        for name, (server, make_stream) in started.items():
            try:
                began = time.perf_counter()
                server.wait_ready()
                streams[name] = make_stream()
                _warm_up(streams[name], prompts, args.max_new_tokens)
                print(f"{name}: ready and warm in {time.perf_counter() - began:.0f} s", file=sys.stderr)
            except Exception as error:  # any failure of one engine is reported; the others still run
                errors[name] = _first_line(error)
                streams.pop(name, None)
                server.stop()
                print(f"{name} is not available: {error}", file=sys.stderr, flush=True)
        order = [spec.name for spec in specs if spec.name in streams]
        running.enter_context(busy_neighbour(args.neighbour))
        for round_index in range(args.rounds):
            shift = round_index % max(1, len(order))
            for name in order[shift:] + order[:shift]:
                print(f"round {round_index + 1}: {name}", file=sys.stderr, flush=True)
                stream = streams[name]
                if round_index == 0:
                    _settle(stream, prompts, args.max_new_tokens)
                record = {
                    "bench": "peers",
                    "engine": name,
                    "round": round_index + 1,
                    "chats": workloads.chats(stream, prompts, args.max_new_tokens),
                    "one_request": workloads.one_request(stream, prompts[0], args.max_new_tokens),
                    "concurrent": workloads.concurrent(
                        stream, prompts, args.concurrent, args.concurrent_new_tokens
                    ),
                    "load_avg_1min": round(os.getloadavg()[0], 2),
                }
                rounds[name].append(record)
                _emit(_without_outputs(record))
                # After every engine's round, so that a run cut short still leaves what it measured.
                rows = report.write(rounds, settings(round_index + 1))
                (log_dir / "rounds.json").write_text(json.dumps(rounds))
    if not order:
        rows = report.write(rounds, settings(0))
    about["uptime_end"] = machine()["uptime"]
    summary = {"bench": "peers", "summary": True, "machine": about, "floor_ms": floor_ms}
    _emit(
        {**summary, "settings": settings(args.rounds if order else 0), "engines": [asdict(r) for r in rows]}
    )
    print(f"wrote {out}/RESULTS.md and peers.png; all outputs: {log_dir / 'rounds.json'}", file=sys.stderr)
    return rows


@dataclass(frozen=True)
class ReportWriter:
    """Writes the table (RESULTS.md) and the plot (peers.png) of the rounds so far into `out`."""

    specs: list[EngineSpec]
    errors: dict[str, str]
    about: dict[str, Any]
    floor_ms: float | None
    end_tokens: frozenset[int]
    out: Path

    def write(self, rounds: dict[str, list[dict[str, Any]]], settings: dict[str, Any]) -> list[EngineRow]:
        about = {**self.about, "uptime_end": machine()["uptime"]}
        reference = rounds["cbserve"][0]["chats"]["outputs"] if rounds.get("cbserve") else None
        rows = [
            engine_row(
                spec.name,
                spec.label,
                spec.weights,
                rounds[spec.name],
                reference,
                self.errors.get(spec.name),
                self.end_tokens,
            )
            for spec in self.specs
        ]
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "RESULTS.md").write_text(markdown(rows, about, settings, self.floor_ms))
        plot(rows, self.out / "peers.png", f"{about['date']}, commit {about['commit']}, {about['cpu']}")
        return rows
