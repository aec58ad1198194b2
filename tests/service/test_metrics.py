"""The Prometheus endpoint: scraped during and after generation, its values move with the requests."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator

import pytest
import torch
from cbserve_client import AdminClient, Client, InvalidArgumentError
from prometheus_client.parser import text_string_to_metric_families

from bench.ports import free_port
from tests.helpers.models import random_prompt
from tests.helpers.servers import ADMIN_TOKEN, ByteTokenizer, RunningServer, wait_all_blocks_free, wait_until

LONG = 900
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture(scope="module")
def metered(model: torch.nn.Module) -> Iterator[RunningServer]:
    running = RunningServer(model, tokenizer=ByteTokenizer(), metrics_port=free_port())
    try:
        running.load()
        yield running
    finally:
        running.close()


def scrape(server: RunningServer) -> Samples:
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        text = response.read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def test_metrics_move_with_generation(metered: RunningServer) -> None:
    with (
        Client(metered.target, timeout=60) as client,
        AdminClient(metered.admin_target, token=ADMIN_TOKEN, timeout=30) as admin,
    ):
        before = scrape(metered)
        assert value(before, "cbserve:num_requests_running") == 0
        assert value(before, "cbserve:kv_cache_blocks_used") == 0
        assert value(before, "cbserve:kv_cache_blocks_total") > 0
        assert value(before, "cbserve:weight_version") == 1
        assert ("cbserve_requests_waiting", frozenset()) in before  # the HPA's queue-depth metric
        assert value(before, "cbserve:time_to_first_token_seconds_count") == 0

        # During: a long request streams.
        long_prompt = random_prompt(40, 11)
        long_id = client.submit(long_prompt, max_new_tokens=LONG, ignore_eos=True)
        next(chunk for chunk in client.results(long_id) if chunk.token_ids)
        during = scrape(metered)
        assert value(during, "cbserve:num_requests_running") > 0
        assert value(during, "cbserve:kv_cache_blocks_used") > 0
        assert client.cancel(long_id) is True
        wait_all_blocks_free(admin)

        prompts = [random_prompt(10 + seed, seed) for seed in range(3)]
        completions = [client.generate(prompt, max_new_tokens=12, ignore_eos=True) for prompt in prompts]
        with pytest.raises(InvalidArgumentError):
            client.generate([5, 256], max_new_tokens=4)  # token id >= vocab
        long_tokens = sum(len(chunk.token_ids) for chunk in client.results(long_id))
        wait_all_blocks_free(admin)

        expected_generated = long_tokens + sum(len(c.token_ids) for c in completions)
        expected_prompt = len(long_prompt) + sum(len(prompt) for prompt in prompts)
        wait_until(
            lambda: value(scrape(metered), "cbserve:generation_tokens_total") == expected_generated,
            what="generation tokens counted",
        )
        after = scrape(metered)
    assert value(after, "cbserve:prompt_tokens_total") == expected_prompt
    assert value(after, "cbserve:request_success_total", finished_reason="length") == 3
    assert value(after, "cbserve:request_success_total", finished_reason="cancelled") == 1
    assert value(after, "cbserve:request_success_total", finished_reason="eos") == 0
    finished = 4
    assert value(after, "cbserve:time_to_first_token_seconds_count") == finished
    assert value(after, "cbserve:e2e_request_latency_seconds_count") == finished
    assert value(after, "cbserve:request_queue_time_seconds_count") == finished
    assert value(after, "cbserve:inter_token_latency_seconds_count") == expected_generated - finished
    assert value(after, "cbserve:num_requests_rejected_total", code="INVALID_ARGUMENT") == 1
    assert value(after, "cbserve:num_requests_running") == 0
    assert value(after, "cbserve:num_requests_waiting") == 0
    assert value(after, "cbserve_requests_waiting") == 0
    assert value(after, "cbserve:kv_cache_blocks_used") == 0
    assert ("cbserve:num_preemptions_total", frozenset()) in after
    assert ("cbserve:kv_offloaded_blocks_total", frozenset()) in after
    assert ("cbserve:prefix_cache_hit_rate", frozenset()) in after


def test_pause_duration_is_observed(metered: RunningServer) -> None:
    with AdminClient(metered.admin_target, token=ADMIN_TOKEN, timeout=30) as admin:
        before = value(scrape(metered), "cbserve:pause_seconds_count")
        with admin.paused():
            pass
    wait_until(
        lambda: value(scrape(metered), "cbserve:pause_seconds_count") == before + 1, what="pause observed"
    )


def test_no_metrics_port_serves_nothing(served: RunningServer) -> None:
    assert served.server.metrics_port is None
