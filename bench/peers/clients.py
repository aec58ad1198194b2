"""One streamed, greedy request through each engine's own network API, as the token ids it generated and
when each arrived.

cbserve is called over gRPC with its Python SDK; llama.cpp's `/completion` and vLLM's OpenAI
`/v1/completions` over HTTP with the standard library (server-sent events, read line by line). Every
request sends token ids, so all engines see the same prompt, asks for the generated ids back, and turns
prompt caching off where the API has a per-request switch. A request that fails is a result (`error`),
not a crash: one engine's failure must not end the others' run.
"""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

REQUEST_TIMEOUT_S = 900


@dataclass
class Trace:
    """When one request was sent and when each of its tokens arrived (time.perf_counter()); a server event
    that carries several tokens gives them all its arrival time."""

    sent_at: float
    token_ids: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    error: str | None = None

    def add(self, token_ids: Iterable[int]) -> None:
        now = time.perf_counter()
        for token in token_ids:
            self.token_ids.append(token)
            self.token_times.append(now)


# (prompt ids, most new tokens, ignore EOS) -> the request's trace
StreamRequest = Callable[[list[int], int, bool], Trace]


def server_sent_events(lines: Iterable[bytes]) -> Iterator[dict[str, Any]]:
    """The JSON payloads of `data:` lines, up to OpenAI's closing `data: [DONE]`."""
    for raw in lines:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[len(b"data:") :].strip()
        if payload == b"[DONE]":
            return
        yield json.loads(payload)


def llama_cpp_tokens(event: dict[str, Any]) -> list[int]:
    """The generated ids in one `/completion` event (`return_tokens`); the final event repeats none."""
    return list(event.get("tokens") or [])


def vllm_tokens(event: dict[str, Any]) -> list[int]:
    """The generated ids in one `/v1/completions` chunk (`return_token_ids`); the usage chunk has none."""
    if "error" in event:
        raise RuntimeError(f"vLLM: {event['error']}")
    return [token for choice in event.get("choices", []) for token in choice.get("token_ids") or []]


def _post_stream(
    port: int, path: str, body: dict[str, Any], tokens_of: Callable[[dict[str, Any]], list[int]]
) -> Trace:
    trace = Trace(sent_at=time.perf_counter())
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT_S)
    try:
        connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read()[:500]!r}")
        for event in server_sent_events(iter(response.readline, b"")):
            trace.add(tokens_of(event))
    except Exception as error:  # recorded, not raised: see the module's docstring
        trace.error = f"{type(error).__name__}: {error}"
    finally:
        connection.close()
    return trace


def llama_cpp_stream(port: int) -> StreamRequest:
    def request(prompt: list[int], max_new_tokens: int, ignore_eos: bool) -> Trace:
        body = {
            "prompt": prompt,
            "n_predict": max_new_tokens,
            "temperature": 0.0,
            "top_k": 1,
            "ignore_eos": ignore_eos,
            "cache_prompt": False,
            "return_tokens": True,
            "stream": True,
        }
        return _post_stream(port, "/completion", body, llama_cpp_tokens)

    return request


def vllm_stream(port: int, model_name: str) -> StreamRequest:
    def request(prompt: list[int], max_new_tokens: int, ignore_eos: bool) -> Trace:
        body = {
            "model": model_name,
            "prompt": prompt,
            "max_tokens": max_new_tokens,
            "temperature": 0.0,
            "ignore_eos": ignore_eos,
            "return_token_ids": True,
            "stream": True,
        }
        return _post_stream(port, "/v1/completions", body, vllm_tokens)

    return request


def cbserve_stream(session: Any) -> StreamRequest:
    """`session` is a `cbserve_client.GenerateSession`: one Generate stream that the concurrent requests'
    threads share, whose chunks the server batches by engine step (the SDK's way to keep many requests in
    flight at one server)."""

    def request(prompt: list[int], max_new_tokens: int, ignore_eos: bool) -> Trace:
        trace = Trace(sent_at=time.perf_counter())
        try:
            for chunk in session.stream(
                prompt, max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=ignore_eos
            ):
                if chunk.error:
                    raise RuntimeError(chunk.error)
                trace.add(chunk.token_ids)
        except Exception as error:  # recorded, not raised: see the module's docstring
            trace.error = f"{type(error).__name__}: {error}"
        return trace

    return request
