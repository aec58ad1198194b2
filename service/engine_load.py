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
    """The record the gateway routes on and its telemetry, every field with common.proto's meaning.

    Absent, because cbserve has none of them: `speculative` (no speculative decoding), `lora` (no
    adapters), `disaggregation` (no prefill/decode split). Absent because the engine does not measure
    them: `memory` (EngineMemory has no field presence, and the bytes of the weights as the kernels hold
    them, repacked, and of the CUDA graphs' pools are not counted).
    """
    blocks_used_fraction = stats.num_blocks_used / stats.num_blocks_total if stats.num_blocks_total else 0.0
    num_in_flight = stats.num_running + stats.num_waiting + stats.num_preempted_waiting
    record = common_pb2.EngineLoad(
        running_requests=stats.num_running,
        waiting_requests=stats.num_waiting,
        waiting_uncached_tokens=_uint32(stats.waiting_uncached_tokens),
        token_usage=blocks_used_fraction,
        # Blocks holding only a retained prefix sit in the free queue, evictable, and count as free: the
        # used blocks are exactly the non-evictable ones, so both usages are the same fraction.
        active_token_usage=blocks_used_fraction,
        gen_throughput=gen_throughput,
        max_running_requests=max_running_requests,
        age_ms=0,
        cache_hit_rate=stats.prefix_cache_hit_rate,
        num_used_tokens=stats.num_blocks_used * page_size,
        max_total_num_tokens=stats.num_blocks_total * page_size,
        queues=common_pb2.EngineQueues(
            waiting=stats.num_waiting,
            # Grammars compile in add_request, before a request is queued: none ever waits for one.
            grammar=0,
            # A pause (or sleep, or weights incomplete) parks the loop: every request in flight is held.
            paused=num_in_flight if stats.paused else 0,
            retracted=stats.num_preempted_waiting,
        ),
        # The loop refreshes the stats this record is read from after every step it completes, so a
        # silence is one step's at most while the engine serves.
        engine_reports_steps=True,
        prefill_pending_tokens=_uint32(stats.prefill_pending_tokens),
    )
    if stats.has_unfinished_requests:
        silence_ms = (time.monotonic() - stats.progress_at) * 1000
        record.engine_silence_ms = _uint32(max(0, int(silence_ms)))
    return record


def _uint32(value: int) -> int:
    return min(value, 2**32 - 1)
