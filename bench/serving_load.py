"""Serving load: Poisson arrivals through the gRPC service (Python SDK), an SMG gateway (OpenAI API) in
front of it, and the same load in-process.

For each arrival rate, `--requests` requests arrive with exponential gaps (rate `inf` sends them all at
once, i.e. that many concurrent streams). Each request streams its tokens; the benchmark records the
time to first token (TTFT), the gaps between tokens (inter-token latency, ITL) and the end-to-end
latency, and the generated tokens per second over the whole load.

- `grpc`: a real `cbserve serve` process on loopback, driven by `cbserve_client.AsyncClient.stream`;
- `gateway`: the same `cbserve serve` process behind a Shepherd Model Gateway (`smg launch`, which speaks
  `vllm.grpc.engine.VllmEngine` to it), driven by the `openai` package's streaming completions API;
- `in_process`: a `ContinuousBatchingManager` in this process, streaming through
  `register_result_handler`, with no network, no serialisation and no detokenisation.

All use the same model weights (saved once to a temporary folder, with the SmolLM2 tokenizer the gateway
needs), prompts and arrival times. The ratio of two modes' throughputs at the same rate is the overhead
of the layer between them. Prints one JSON line per (mode, rate) and a summary line; these are figures,
not pass/fail.

    python -m bench.serving_load --rates 2,8,inf --requests 64     # from the repository root
    python -m bench.serving_load --rates inf --requests 64 --modes grpc gateway
"""

from __future__ import annotations

# isort: off
# First, before torch loads libgomp: importing the server package sets its OpenMP defaults
# (service/openmp.py), so the in-process engines here run as the server's does.
import service  # noqa: F401

# isort: on
import argparse
import asyncio
import contextlib
import dataclasses
import importlib.metadata
import json
import math
import os
import random
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.offline_throughput import MODEL_PRESETS, build_model, make_prompts, on_own_thread
from bench.ports import free_ports
from bench.smg_gateway import SmgGateway
from engine import ContinuousBatchingConfig, ContinuousBatchingManager

REPO_ROOT = Path(__file__).resolve().parents[1]
BENCH_NAME = "serving_load"
STARTUP_TIMEOUT_S = 300
GATEWAY_STARTUP_TIMEOUT_S = 120
# Every rate runs the selected modes in this order.
MODES = ("in_process", "grpc", "gateway")
# Flags added to the gateway's `smg launch` command unless --gateway-args says otherwise.
DEFAULT_GATEWAY_ARGS = ""


@dataclass
class RequestTrace:
    """When one request was sent, and when each of its tokens arrived (time.perf_counter()).

    In the `gateway` mode `token_times` holds one time per streamed chunk that carried text, which is not
    always one per token (see `run_gateway`); `num_tokens` is then the gateway's usage count.
    """

    sent_at: float
    token_times: list[float] = field(default_factory=list)
    num_tokens: int = 0
    prompt_tokens: int = 0
    error: str | None = None

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
    """The figures of one (mode, rate) run, over the requests that streamed to the end (all of them, but
    in the `gateway` mode, where a failed request is counted in `failed_requests` instead of raising)."""
    done = [trace for trace in traces if trace.error is None and trace.token_times]
    finished = max((trace.token_times[-1] for trace in done), default=started)
    generated = sum(trace.num_tokens for trace in done)
    itl = [gap for trace in done for gap in trace.inter_token_latencies()]
    wall = finished - started
    record = {
        "bench": BENCH_NAME,
        "mode": mode,
        "model": args.model,
        "rate_rps": "inf" if math.isinf(rate) else rate,
        "requests": len(traces),
        "failed_requests": len(traces) - len(done),
        "new_tokens": args.new_tokens,
        "prompt_tokens": sum(trace.prompt_tokens for trace in done),
        "generated_tokens": generated,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(generated / wall, 1) if wall > 0 else 0.0,
        "ttft_s": percentiles([trace.ttft() for trace in done]),
        "itl_s": percentiles(itl),
        "e2e_s": percentiles([trace.end_to_end() for trace in done]),
    }
    if mode == "gateway":
        record["text_chunks"] = sum(len(trace.token_times) for trace in done)
        errors = [trace.error for trace in traces if trace.error is not None]
        if errors:
            record["first_error"] = errors[0][:500]
    return record


async def run_grpc(target: str, prompts: list[list[int]], offsets: list[float], new_tokens: int):
    from cbserve_client import AsyncClient

    traces = [RequestTrace(sent_at=0.0, prompt_tokens=len(prompt)) for prompt in prompts]
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


async def run_gateway(
    base_url: str, model: str, prompts: list[str], offsets: list[float], new_tokens: int
) -> tuple[list[RequestTrace], float]:
    """The load through the gateway's OpenAI completions API, streamed with the official `openai` client.

    The prompts are text: SMG 1.13's `/v1/completions` rejects a list of token ids as `prompt` (400 "data
    did not match any variant of untagged enum StringOrArray"), so each prompt is sent as the text whose
    tokenization is the token-id prompt the other modes send (see `make_text_prompts`).

    Counting: a streamed completion chunk carries text, not tokens. The gateway detokenizes incrementally
    and holds back a token whose bytes end inside a UTF-8 character, releasing it with a later chunk (and
    a token that decodes to nothing gives no text), so one chunk may carry several tokens or none, and
    counting chunks would miscount. The total therefore comes from the final usage chunk
    (`stream_options.include_usage`: the engine's own `completion_tokens`). TTFT, ITL and end-to-end time
    use the arrival times of the chunks that carry text, which is what an OpenAI client sees. The ITL
    percentiles are thus per text chunk: a held-back token merges two gaps into one, where the `grpc` mode
    would record the later token with a zero gap. Asking for `logprobs` would give the exact token count
    of each chunk, but it makes the engine and gateway do extra work and so changes what is measured.
    `text_chunks` in the record says how far chunks and tokens differ.

    No retries (`max_retries=0`): a request the gateway refuses is recorded as failed, not resent.
    """
    import openai

    traces = [RequestTrace(sent_at=0.0) for _ in prompts]
    # trust_env=False: loopback traffic must not go through a proxy named in the environment.
    http_client = openai.DefaultAsyncHttpxClient(trust_env=False)
    async with openai.AsyncOpenAI(
        base_url=base_url, api_key="none", max_retries=0, timeout=600, http_client=http_client
    ) as client:
        started = time.perf_counter()

        async def one(index: int) -> None:
            await asyncio.sleep(max(0.0, started + offsets[index] - time.perf_counter()))
            trace = traces[index]
            trace.sent_at = time.perf_counter()
            try:
                stream = await client.completions.create(
                    model=model,
                    prompt=prompts[index],
                    max_tokens=new_tokens,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True},
                )
                usage = None
                async for chunk in stream:
                    if any(choice.text for choice in chunk.choices):
                        trace.token_times.append(time.perf_counter())
                    if chunk.usage is not None:
                        usage = chunk.usage
                if usage is None:
                    raise RuntimeError("the stream ended without a usage chunk")
                trace.num_tokens = usage.completion_tokens
                trace.prompt_tokens = usage.prompt_tokens
            except Exception as error:  # a refused or broken stream is a result here, not a crash
                trace.error = f"{type(error).__name__}: {error}"

        await asyncio.gather(*(one(index) for index in range(len(prompts))))
    return traces, started


async def run_in_process(
    manager: ContinuousBatchingManager, prompts: list[list[int]], offsets: list[float], new_tokens: int
):
    traces = [RequestTrace(sent_at=0.0, prompt_tokens=len(prompt)) for prompt in prompts]
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


def load_tokenizer() -> Any:
    """The tokenizer (with its chat template) of the embedded SmolLM2 model, from cbserve's converted cache.

    The benchmark's models have random weights and no tokenizer, but the gateway needs a real one (it
    loads it from the folder the worker serves), so this one is saved next to the model, and the model's
    vocabulary is made the tokenizer's (49152) in every mode.
    """
    from transformers import AutoTokenizer

    from service.default_model import ensure_default_model

    return AutoTokenizer.from_pretrained(ensure_default_model())


def build_serving_model(preset: str, vocab_size: int) -> torch.nn.Module:
    """`build_model(preset)` (same seed, same shapes, no EOS) with `vocab_size` tokens."""
    original = MODEL_PRESETS[preset]
    MODEL_PRESETS[preset] = dataclasses.replace(original, vocab_size=vocab_size)
    try:
        return build_model(preset)
    finally:
        MODEL_PRESETS[preset] = original


def make_text_prompts(tokenizer: Any, args: argparse.Namespace) -> tuple[list[list[int]], list[str]]:
    """The prompts as token ids (for `grpc` and `in_process`) and as text (for `gateway`), the same prompts.

    Random ids (`make_prompts`) are decoded to text and the text is tokenized again: the ids sent by the
    token-id modes are that tokenization, so the gateway, which tokenizes the text itself (with no BOS for
    completions), hands the engine the same ids. Each record's `prompt_tokens` shows that they agree.
    """
    random_ids = make_prompts(args.requests, args.min_prompt, args.max_prompt, len(tokenizer))
    texts = [tokenizer.decode(ids) for ids in random_ids]
    return [tokenizer.encode(text, add_special_tokens=False) for text in texts], texts


def _log_tail(path: Path, limit: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-limit:]
    except OSError:
        return ""


class ServerProcess:
    """`python -m service serve` on the saved model, stopped with SIGTERM (killed if it hangs).

    Its output goes to `log_path` (a pipe that nobody reads would block a chatty server)."""

    def __init__(self, model_dir: str, log_path: Path, args: argparse.Namespace) -> None:
        self.port, self.admin_port = free_ports(2)
        self.log_path = log_path
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
            str(self.admin_port),
            "--page-size",
            str(args.page_size),
            "--max-batch-tokens",
            str(args.max_batch_tokens),
            "--num-blocks",
            str(args.num_blocks),
        ]
        environment = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        with open(log_path, "wb") as log:
            self.process = subprocess.Popen(
                command,
                cwd=REPO_ROOT,
                env=environment,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
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
                    raise RuntimeError(f"the server exited: {_log_tail(self.log_path)}")
                try:
                    if health.Check(health_pb2.HealthCheckRequest(), timeout=2).status == 1:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.5)
        raise RuntimeError("the server did not become SERVING in time")

    def stop(self) -> None:
        if self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _count_lines(path: Path, needle: str) -> int:
    return sum(needle in line for line in path.read_text(errors="replace").splitlines())


def run_benchmark(args: argparse.Namespace) -> list[dict[str, Any]]:
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()[0]
    modes = [mode for mode in MODES if mode in args.modes]
    rates = [math.inf if rate.strip() == "inf" else float(rate) for rate in args.rates.split(",")]
    tokenizer = load_tokenizer()
    # Torch work on threads that end (see `on_own_thread`): the in-process engine runs in this process.
    model = on_own_thread(build_serving_model, args.model, len(tokenizer))
    prompts, texts = make_text_prompts(tokenizer, args)
    records: list[dict[str, Any]] = []
    config = ContinuousBatchingConfig(
        page_size=args.page_size, num_blocks=args.num_blocks, max_batch_tokens=args.max_batch_tokens
    )
    warm = slice(0, args.warmup_requests)
    no_wait = [0.0] * len(prompts[warm])
    gateway: SmgGateway | None = None
    gateway_model = ""
    with (
        tempfile.TemporaryDirectory(prefix="cbserve-bench-") as model_dir,
        tempfile.TemporaryDirectory(prefix="cbserve-bench-logs-") as log_dir,
        contextlib.ExitStack() as running,
    ):
        model.save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
        server: ServerProcess | None = None
        if "grpc" in modes or "gateway" in modes:
            server = ServerProcess(model_dir, Path(log_dir) / "server.log", args)
            running.callback(server.stop)
            server.wait_serving()
            asyncio.run(run_grpc(server.target, prompts[warm], no_wait, args.new_tokens))
        if server is not None and "gateway" in modes:
            log = Path(log_dir) / "gateway.log"
            gateway = SmgGateway([server.target], log, *shlex.split(args.gateway_args), log_level="warn")
            running.callback(gateway.stop)
            gateway_model = gateway.wait_ready(GATEWAY_STARTUP_TIMEOUT_S)
            warm_traces, _ = asyncio.run(
                run_gateway(f"{gateway.base_url}/v1", gateway_model, texts[warm], no_wait, args.new_tokens)
            )
            failed = [trace.error for trace in warm_traces if trace.error is not None]
            if failed:
                raise RuntimeError(f"{len(failed)} warmup requests failed through the gateway: {failed[0]}")
        manager: ContinuousBatchingManager | None = None
        if "in_process" in modes:
            manager = on_own_thread(ContinuousBatchingManager, model, continuous_batching_config=config)
            running.callback(manager.destroy)
            manager.warmup()
            manager.start()
        for rate in rates:
            offsets = arrival_offsets(len(prompts), rate, seed=args.seed)
            for mode in modes:
                print(f"rate {rate}: {mode}", file=sys.stderr, flush=True)
                if mode == "grpc":
                    assert server is not None
                    traces, started = asyncio.run(run_grpc(server.target, prompts, offsets, args.new_tokens))
                elif mode == "gateway":
                    assert gateway is not None
                    traces, started = asyncio.run(
                        run_gateway(f"{gateway.base_url}/v1", gateway_model, texts, offsets, args.new_tokens)
                    )
                else:
                    assert manager is not None
                    traces, started = asyncio.run(run_in_process(manager, prompts, offsets, args.new_tokens))
                record = summarise(mode, rate, traces, started, args)
                records.append(record)
                print(json.dumps(record), flush=True)
        gateway_vetoes = _count_lines(gateway.log_path, "vetoed") if gateway is not None else None
    summary: dict[str, Any] = {"bench": BENCH_NAME, "summary": True, "model": args.model, "modes": modes}
    for rate in rates:
        key = "inf" if math.isinf(rate) else rate
        by_mode = {r["mode"]: r["tokens_per_s"] for r in records if r["rate_rps"] == key}
        for mode, baseline in (("grpc", "in_process"), ("gateway", "grpc")):
            if mode in by_mode and by_mode.get(baseline):
                summary[f"{mode}_vs_{baseline}_at_{key}"] = round(by_mode[mode] / by_mode[baseline], 3)
    summary.update(
        vocab_size=len(tokenizer),
        threads=args.threads,
        cpu_count=os.cpu_count(),
        load_avg_1min_start=round(load_start, 2),
        load_avg_1min_end=round(os.getloadavg()[0], 2),
        torch=torch.__version__,
        python=sys.version.split()[0],
        config={
            "page_size": args.page_size,
            "num_blocks": args.num_blocks,
            "max_batch_tokens": args.max_batch_tokens,
        },
    )
    if gateway is not None:
        summary.update(
            smg=importlib.metadata.version("smg"),
            openai=importlib.metadata.version("openai"),
            gateway_args=args.gateway_args,
            gateway_log_vetoes=gateway_vetoes,
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
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=MODES,
        default=list(MODES),
        help="which modes to run (default: all three; each rate runs them in the order in_process, grpc, "
        "gateway whatever the order given)",
    )
    parser.add_argument("--rates", default="2,8,inf", help="comma-separated requests/s; inf = all at once")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--min-prompt", type=int, default=16)
    parser.add_argument("--max-prompt", type=int, default=256)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=2048)
    parser.add_argument("--max-batch-tokens", type=int, default=2048)
    parser.add_argument("--warmup-requests", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the engine, in all modes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--gateway-args",
        default=DEFAULT_GATEWAY_ARGS,
        help="extra `smg launch` flags of the gateway mode, one shell-quoted string; write it with `=`, "
        f'as in --gateway-args="--worker-wedge-secs 0" (default: "{DEFAULT_GATEWAY_ARGS}")',
    )
    parser.add_argument("--json-out", help="also write the JSON lines to this file")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    # SIGTERM unwinds like Ctrl-C, so that the server and the gateway (in a session of its own, which a
    # terminal's Ctrl-C does not reach) are stopped by `run_benchmark`'s cleanup.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    run_benchmark(parse_args(argv))


if __name__ == "__main__":
    main()
