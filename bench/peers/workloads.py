"""The three workloads, each run against one engine through a `StreamRequest`:

- `chats`: the chat prompts all at once, EOS on: throughput, and the outputs compared across engines;
- `one_request`: one chat prompt alone, EOS ignored so every engine decodes the same number of tokens:
  time to first token and ms per token after it;
- `concurrent`: the chat prompts repeated to `count` requests, all at once, EOS ignored: throughput and
  the median time to first token.

Concurrent requests run on one thread each, released together; a workload's wall time runs from the
release to the last token of any request.
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from bench.peers.clients import StreamRequest, Trace


def run_concurrently(
    stream: StreamRequest, prompts: list[list[int]], max_new_tokens: int, ignore_eos: bool
) -> tuple[list[Trace], float]:
    pool = ThreadPoolExecutor(max_workers=len(prompts))
    try:
        started = time.perf_counter()
        traces = list(pool.map(lambda prompt: stream(prompt, max_new_tokens, ignore_eos), prompts))
    finally:
        # Not waiting when the run is being stopped (SIGTERM, Ctrl-C): the requests in flight end when the
        # run's cleanup stops their server, instead of the cleanup waiting minutes for them to finish.
        pool.shutdown(wait=False, cancel_futures=True)
    finished = max((trace.token_times[-1] for trace in traces if trace.token_times), default=started)
    return traces, finished - started


def _failures(traces: list[Trace]) -> dict[str, Any]:
    errors = [trace.error for trace in traces if trace.error is not None]
    return {"failed_requests": len(errors), **({"first_error": errors[0][:500]} if errors else {})}


def chats(stream: StreamRequest, prompts: list[list[int]], max_new_tokens: int) -> dict[str, Any]:
    traces, wall = run_concurrently(stream, prompts, max_new_tokens, ignore_eos=False)
    generated = sum(len(trace.token_ids) for trace in traces)
    return {
        "requests": len(prompts),
        "generated_tokens": generated,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(generated / wall, 1) if wall > 0 else 0.0,
        **_failures(traces),
        "outputs": [trace.token_ids for trace in traces],
    }


def one_request(stream: StreamRequest, prompt: list[int], max_new_tokens: int) -> dict[str, Any]:
    trace = stream(prompt, max_new_tokens, True)
    record: dict[str, Any] = {"generated_tokens": len(trace.token_ids), **_failures([trace])}
    if len(trace.token_times) >= 2:
        decode_s = trace.token_times[-1] - trace.token_times[0]
        record["ttft_ms"] = round((trace.token_times[0] - trace.sent_at) * 1000, 1)
        record["ms_per_token"] = round(decode_s * 1000 / (len(trace.token_times) - 1), 2)
    return record


def concurrent(
    stream: StreamRequest, prompts: list[list[int]], count: int, max_new_tokens: int
) -> dict[str, Any]:
    repeated = [prompts[index % len(prompts)] for index in range(count)]
    traces, wall = run_concurrently(stream, repeated, max_new_tokens, ignore_eos=True)
    generated = sum(len(trace.token_ids) for trace in traces)
    first_tokens = [trace.token_times[0] - trace.sent_at for trace in traces if trace.token_times]
    return {
        "requests": count,
        "generated_tokens": generated,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(generated / wall, 1) if wall > 0 else 0.0,
        "ttft_p50_ms": round(statistics.median(first_tokens) * 1000, 1) if first_tokens else None,
        **_failures(traces),
    }
