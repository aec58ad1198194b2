"""Shared pieces of the reliability suites: the prompt pool and its greedy references, reading a
request's outcome through the SDK, sampling a server's memory, and the figures each suite reports."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import grpc
import psutil
import torch
from cbserve_client import AsyncChunkStream, Chunk, ChunkStream, Client

from tests.helpers.models import random_prompt
from tests.helpers.oracle import reference_greedy

# What every suite measured, by suite name; tests/reliability/conftest.py prints it in the terminal summary.
FIGURES: dict[str, dict[str, Any]] = {}

INTERNAL = grpc.StatusCode.INTERNAL.value[0]
# Added to a request's max_new_tokens so that it is surely still decoding when a fault hits it: even
# alone on a fast machine, 600 steps take far longer than the longest deadline a fault sets (0.6 s).
EXTRA_TOKENS = 600
# No request of the suites may take longer than this; a hang fails the test instead of blocking it.
REQUEST_TIMEOUT_S = 120.0
MIB = 2**20


def report(suite: str, **figures: Any) -> None:
    """Records figures of `suite` for the terminal summary (later calls add to earlier ones)."""
    FIGURES.setdefault(suite, {}).update(figures)


@dataclass(frozen=True)
class PoolEntry:
    """A prompt, how many tokens to generate, and the greedy output of the request run alone."""

    prompt: list[int]
    max_new_tokens: int
    expected: list[int]


# Prompt lengths around the page size (16), the step budget (256) and the long end; max_new_tokens
# mixed the same way. Prompts of 40 tokens and more at every third index share a 32-token prefix (two
# full pages), so distinct prompts also hit each other in the prefix cache.
POOL_PROMPT_LENGTHS = (1, 2, 3, 5, 8, 13, 15, 16, 17, 21, 31, 32, 33, 40, 47, 48)
POOL_PROMPT_LENGTHS += (63, 64, 65, 80, 96, 100, 127, 128, 150, 180, 200, 240, 255, 256, 257, 300)
POOL_MAX_NEW_TOKENS = (1, 2, 3, 4, 6, 8, 12, 16, 20, 24, 32)
SHARED_PREFIX_LENGTH = 32


def build_prompt_pool(model: torch.nn.Module) -> list[PoolEntry]:
    """32 distinct requests and their references (transformers' own greedy `generate`, run alone)."""
    shared_prefix = random_prompt(SHARED_PREFIX_LENGTH, seed=7_000)
    pool = []
    for index, length in enumerate(POOL_PROMPT_LENGTHS):
        prompt = random_prompt(length, seed=7_001 + index)
        if index % 3 == 0 and length >= 40:
            prompt = shared_prefix + prompt[SHARED_PREFIX_LENGTH:]
        max_new_tokens = POOL_MAX_NEW_TOKENS[index % len(POOL_MAX_NEW_TOKENS)]
        pool.append(PoolEntry(prompt, max_new_tokens, reference_greedy(model, prompt, max_new_tokens)))
    return pool


@dataclass
class Outcome:
    """How one request ended, as its client saw it."""

    request_id: str
    status: str = "unknown"
    finish_reason: str | None = None
    token_ids: list[int] = field(default_factory=list)
    error: str | None = None
    error_code: int = 0
    prompt_tokens: int | None = None

    def add(self, chunk: Chunk) -> None:
        if chunk.token_index != len(self.token_ids) and chunk.token_ids:
            raise AssertionError(
                f"request {self.request_id}: a chunk starts at token {chunk.token_index}, "
                f"{len(self.token_ids)} tokens received so far"
            )
        self.token_ids.extend(chunk.token_ids)
        self.status = chunk.status
        if chunk.usage is not None:
            self.prompt_tokens = chunk.usage.prompt_tokens
        if chunk.finished:
            self.finish_reason = chunk.finish_reason
            self.error = chunk.error
            self.error_code = chunk.error_code

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def read_to_end(stream: ChunkStream, outcome: Outcome | None = None) -> Outcome:
    """Reads `stream` until its request ends; raises the SDK's error if the call fails first."""
    outcome = outcome or Outcome(stream.request_id)
    with stream:
        for chunk in stream:
            outcome.add(chunk)
            if chunk.finished:
                break
    return outcome


async def read_to_end_async(stream: AsyncChunkStream) -> Outcome:
    """`read_to_end` for the asyncio client."""
    outcome = Outcome(stream.request_id)
    async with stream:
        async for chunk in stream:
            outcome.add(chunk)
            if chunk.finished:
                break
    return outcome


def final_outcome(client: Client, request_id: str) -> Outcome:
    """Every token and the terminal status of a request, read back with StreamResults (waits for its end)."""
    return read_to_end(client.results(request_id, timeout=REQUEST_TIMEOUT_S))


def final_outcomes(client: Client, request_id: str) -> dict[int, Outcome]:
    """Every sequence of a request (one unless it has n > 1), by index, read back with StreamResults
    until the call ends, which it does once every sequence has ended."""
    outcomes: dict[int, Outcome] = {}
    with client.results(request_id, timeout=REQUEST_TIMEOUT_S) as stream:
        for chunk in stream:
            outcomes.setdefault(chunk.index, Outcome(request_id)).add(chunk)
    return outcomes


def mismatch(entry: PoolEntry, outcome: Outcome) -> str | None:
    """Why `outcome` is not the completed greedy output of `entry` run alone, or None when it is."""
    want = ("finished", "length", entry.expected, len(entry.prompt))
    got = (outcome.status, outcome.finish_reason, outcome.token_ids, outcome.prompt_tokens)
    if got == want:
        return None
    return f"request {outcome.request_id}: want {want}, got {got} (error {outcome.error!r})"


class RssSampler:
    """Samples a process's resident memory every `interval_s` seconds, in a background thread."""

    def __init__(self, pid: int, interval_s: float = 0.25) -> None:
        self._process = psutil.Process(pid)
        self._interval_s = interval_s
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append((time.monotonic(), self._process.memory_info().rss))
            except psutil.NoSuchProcess:
                return
            self._stop.wait(self._interval_s)

    def peaks(self, start: float, end: float) -> tuple[int, int]:
        """The highest RSS in the first and in the second half of [start, end]."""
        middle = (start + end) / 2
        first = [rss for at, rss in self.samples if start <= at < middle]
        second = [rss for at, rss in self.samples if middle <= at <= end]
        if not first or not second:
            raise AssertionError(f"too few RSS samples in [{start}, {end}]: {len(self.samples)}")
        return max(first), max(second)
