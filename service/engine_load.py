"""The engine's load as gateways read it: `GetLoads` and the load record on every KV event batch."""

from __future__ import annotations

import time
from collections import deque

from smg_grpc_proto.generated import common_pb2

from engine import ManagerStats

# The window over which the generation rate is measured.
RATE_WINDOW_S = 10.0


class GenerationRate:
    """Tokens generated per second over the last `RATE_WINDOW_S`, from the engine's running count."""

    def __init__(self) -> None:
        self._samples: deque[tuple[float, int]] = deque()

    def update(self, num_generated_tokens: int) -> float:
        now = time.monotonic()
        self._samples.append((now, num_generated_tokens))
        while len(self._samples) > 2 and now - self._samples[1][0] >= RATE_WINDOW_S:
            self._samples.popleft()
        first_time, first_count = self._samples[0]
        elapsed = now - first_time
        return (num_generated_tokens - first_count) / elapsed if elapsed > 0 else 0.0


def engine_load(
    stats: ManagerStats, page_size: int, max_running_requests: int, gen_throughput: float
) -> common_pb2.EngineLoad:
    """The record the gateway routes on (running, waiting, KV usage, rate) and its telemetry."""
    return common_pb2.EngineLoad(
        running_requests=stats.num_running,
        waiting_requests=stats.num_waiting,
        token_usage=stats.num_blocks_used / stats.num_blocks_total if stats.num_blocks_total else 0.0,
        gen_throughput=gen_throughput,
        max_running_requests=max_running_requests,
        age_ms=0,
        cache_hit_rate=stats.prefix_cache_hit_rate,
        num_used_tokens=stats.num_blocks_used * page_size,
        max_total_num_tokens=stats.num_blocks_total * page_size,
    )
