"""Serving load: Poisson arrivals through the gRPC service (Python SDK) and the same load in-process.

For each arrival rate, `--requests` requests arrive with exponential gaps (rate `inf` sends them all at
once, i.e. that many concurrent streams). Each request streams its tokens; the benchmark records the
time to first token (TTFT), the gaps between tokens (inter-token latency, ITL) and the end-to-end
latency, and the generated tokens per second over the whole load.

- `grpc`: a real `cbserve serve` process on loopback, driven by `cbserve_client.AsyncClient.stream`;
- `in_process`: a `ContinuousBatchingManager` in this process, streaming through
  `register_result_handler`, with no network, no serialisation and no detokenisation.

Both use the same model weights (saved once to a temporary folder), prompts and arrival times. The
ratio of their throughputs at the same rate is the serving overhead. Prints one JSON line per
(mode, rate) and a summary line; these are figures, not pass/fail.

    python -m bench.serving_load --rates 2,8,inf --requests 64     # from the repository root
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.offline_throughput import build_model, make_prompts
from engine import ContinuousBatchingConfig, ContinuousBatchingManager

REPO_ROOT = Path(__file__).resolve().parents[1]
BENCH_NAME = "serving_load"
STARTUP_TIMEOUT_S = 300


@dataclass
class RequestTrace:
    """When one request was sent, and when each of its tokens arrived (time.perf_counter())."""

    sent_at: float
    token_times: list[float] = field(default_factory=list)
    num_tokens: int = 0

    def ttft(self) -> float:
        return self.token_times[0] - self.sent_at

    def inter_token_latencies(self) -> list[float]:
        return [
            later - earlier for earlier, later in zip(self.token_times, self.token_times[1:], strict=False)
        ]

    def end_to_end(self) -> float:
        return self.token_times[-1] - self.sent_at


def arrival_offsets(num_requests: int, rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent (Poisson process; all at 0 for inf)."""
    if math.isinf(rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    offsets, now = [], 0.0
    for _ in range(num_requests):
        offsets.append(now)
        now += rng.expovariate(rate)
    return offsets


def percentiles(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {"p50": math.nan, "p90": math.nan, "p99": math.nan}
    ordered = sorted(values)

    def at(fraction: float) -> float:
        return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]

    return {"p50": round(at(0.5), 4), "p90": round(at(0.9), 4), "p99": round(at(0.99), 4)}


def summarise(mode: str, rate: float, traces: list[RequestTrace], started: float, args: argparse.Namespace):
    finished = max(trace.token_times[-1] for trace in traces)
    generated = sum(trace.num_tokens for trace in traces)
    itl = [gap for trace in traces for gap in trace.inter_token_latencies()]
    return {
        "bench": BENCH_NAME,
        "mode": mode,
        "model": args.model,
        "rate_rps": "inf" if math.isinf(rate) else rate,
        "requests": len(traces),
        "new_tokens": args.new_tokens,
        "generated_tokens": generated,
        "wall_s": round(finished - started, 3),
        "tokens_per_s": round(generated / (finished - started), 1),
        "ttft_s": percentiles([trace.ttft() for trace in traces]),
        "itl_s": percentiles(itl),
        "e2e_s": percentiles([trace.end_to_end() for trace in traces]),
    }


async def run_grpc(target: str, prompts: list[list[int]], offsets: list[float], new_tokens: int):
    from cbserve_client import AsyncClient

    traces = [RequestTrace(sent_at=0.0) for _ in prompts]
    async with AsyncClient(target, timeout=600) as client:
        started = time.perf_counter()

        async def one(index: int) -> None:
            await asyncio.sleep(max(0.0, started + offsets[index] - time.perf_counter()))
            trace = traces[index]
            trace.sent_at = time.perf_counter()
            stream = client.stream(prompts[index], max_new_tokens=new_tokens, ignore_eos=True)
            async for chunk in stream:
                if chunk.token_ids:
                    now = time.perf_counter()
                    trace.token_times.extend([now] * len(chunk.token_ids))
                    trace.num_tokens += len(chunk.token_ids)

        await asyncio.gather(*(one(index) for index in range(len(prompts))))
    return traces, started


async def run_in_process(
    manager: ContinuousBatchingManager, prompts: list[list[int]], offsets: list[float], new_tokens: int
):
    traces = [RequestTrace(sent_at=0.0) for _ in prompts]
    loop = asyncio.get_running_loop()
    started = time.perf_counter()

    async def one(index: int) -> None:
        await asyncio.sleep(max(0.0, started + offsets[index] - time.perf_counter()))
        trace = traces[index]
        done = loop.create_future()

        def on_output(output: Any) -> None:
            now = time.perf_counter()
            new = len(output.generated_tokens) - trace.num_tokens
            trace.token_times.extend([now] * new)
            trace.num_tokens += new
            if output.is_finished() and not done.done():
                done.set_result(None)

        trace.sent_at = time.perf_counter()
        request_id = manager.add_request(
            prompts[index], max_new_tokens=new_tokens, streaming=True, eos_token_id=[]
        )
        manager.register_result_handler(request_id, on_output)
        await done

    await asyncio.gather(*(one(index) for index in range(len(prompts))))
    return traces, started


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class ServerProcess:
    """`python -m service serve` on the saved model, stopped with SIGTERM (killed if it hangs)."""

    def __init__(self, model_dir: str, args: argparse.Namespace) -> None:
        self.port = _free_port()
        command = [
            sys.executable,
            "-m",
            "service",
            "serve",
            "--model",
            model_dir,
            "--port",
            str(self.port),
            "--admin-port",
            str(_free_port()),
            "--page-size",
            str(args.page_size),
            "--max-batch-tokens",
            str(args.max_batch_tokens),
            "--num-blocks",
            str(args.num_blocks),
        ]
        environment = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        self.process = subprocess.Popen(
            command,
            cwd=REPO_ROOT,
            env=environment,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def wait_serving(self) -> None:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        with grpc.insecure_channel(self.target) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(
                        f"the server exited: {self.process.stderr.read() if self.process.stderr else ''}"
                    )
                try:
                    if health.Check(health_pb2.HealthCheckRequest(), timeout=2).status == 1:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.5)
        raise RuntimeError("the server did not become SERVING in time")

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def run_benchmark(args: argparse.Namespace) -> list[dict[str, Any]]:
    torch.set_num_threads(args.threads)
    rates = [math.inf if rate.strip() == "inf" else float(rate) for rate in args.rates.split(",")]
    model = build_model(args.model)
    prompts = make_prompts(args.requests, args.min_prompt, args.max_prompt, model.config.vocab_size)
    records: list[dict[str, Any]] = []
    config = ContinuousBatchingConfig(
        page_size=args.page_size, num_blocks=args.num_blocks, max_batch_tokens=args.max_batch_tokens
    )
    with tempfile.TemporaryDirectory(prefix="cbserve-bench-") as model_dir:
        model.save_pretrained(model_dir)
        server = ServerProcess(model_dir, args)
        try:
            server.wait_serving()
            manager = ContinuousBatchingManager(model, continuous_batching_config=config)
            manager.warmup()
            manager.start()
            try:
                warm = prompts[: args.warmup_requests]
                asyncio.run(run_grpc(server.target, warm, [0.0] * len(warm), args.new_tokens))
                for rate in rates:
                    offsets = arrival_offsets(len(prompts), rate, seed=args.seed)
                    for mode in ("in_process", "grpc"):
                        print(f"rate {rate}: {mode}", file=sys.stderr, flush=True)
                        if mode == "grpc":
                            traces, started = asyncio.run(
                                run_grpc(server.target, prompts, offsets, args.new_tokens)
                            )
                        else:
                            traces, started = asyncio.run(
                                run_in_process(manager, prompts, offsets, args.new_tokens)
                            )
                        record = summarise(mode, rate, traces, started, args)
                        records.append(record)
                        print(json.dumps(record), flush=True)
            finally:
                manager.destroy()
        finally:
            server.stop()
    summary: dict[str, Any] = {"bench": BENCH_NAME, "summary": True, "model": args.model}
    for rate in rates:
        key = "inf" if math.isinf(rate) else rate
        by_mode = {r["mode"]: r for r in records if r["rate_rps"] == key}
        summary[f"grpc_vs_in_process_at_{key}"] = round(
            by_mode["grpc"]["tokens_per_s"] / by_mode["in_process"]["tokens_per_s"], 3
        )
    summary.update(
        threads=args.threads,
        cpu_count=os.cpu_count(),
        load_avg_1min_end=round(os.getloadavg()[0], 2),
        torch=torch.__version__,
        python=sys.version.split()[0],
        config={
            "page_size": args.page_size,
            "num_blocks": args.num_blocks,
            "max_batch_tokens": args.max_batch_tokens,
        },
    )
    records.append(summary)
    print(json.dumps(summary), flush=True)
    if args.json_out:
        Path(args.json_out).write_text("".join(json.dumps(record) + "\n" for record in records))
    return records


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=("tiny", "medium"), default="tiny")
    parser.add_argument("--rates", default="2,8,inf", help="comma-separated requests/s; inf = all at once")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--min-prompt", type=int, default=16)
    parser.add_argument("--max-prompt", type=int, default=256)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=2048)
    parser.add_argument("--max-batch-tokens", type=int, default=2048)
    parser.add_argument("--warmup-requests", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the engine, in both modes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json-out", help="also write the JSON lines to this file")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    run_benchmark(parse_args(argv))


if __name__ == "__main__":
    main()
