"""cbserve behind the real SMG gateway, called with the official `openai` client: the OpenAI API, cache-aware
routing from cbserve's KV events, the gateway's cache flush (each replica's prefix-cache reset), disconnects,
a lost replica, and fields cbserve does not serve. (The vLLM protocol's SamplingParams carries no logprobs
mode, so a request through the gateway gets the replica's default, `cbserve serve --logprobs-mode`.)

The replicas serve a tiny random Llama with the embedded SmolLM2's tokenizer and chat template (the
gateway tokenizes and detokenizes with it); greedy outputs are compared with the same request sent to a
replica directly through the Python SDK.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import signal
import time
import urllib.error
import urllib.request
import zipfile
from collections import Counter
from pathlib import Path

import grpc
import openai
import pytest
from cbserve_client import AdminClient, Client
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2_grpc
from transformers import AutoTokenizer

from tests.helpers.gateway import Gateway
from tests.helpers.servers import ADMIN_TOKEN, ServerProcess, wait_until

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The capital of France is"
MAX_TOKENS = 12
REQUEST_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def client(gateway: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="unused", timeout=REQUEST_TIMEOUT_S)


@pytest.fixture(scope="module")
def model_name(client: openai.OpenAI) -> str:
    (model,) = client.models.list().data
    return model.id


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: str):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _direct_text(replica: ServerProcess, tokenizer, prompt_ids: list[int]) -> str:
    """The same greedy request sent straight to a replica, decoded as the gateway decodes."""
    with Client(replica.target) as direct:
        completion = direct.generate(prompt_ids, max_new_tokens=MAX_TOKENS, temperature=0.0)
    return tokenizer.decode(completion.token_ids, skip_special_tokens=True)


def _wait_idle(replicas: list[ServerProcess]) -> None:
    for replica in replicas:
        with AdminClient(replica.admin_target, ADMIN_TOKEN) as admin:
            wait_until(
                lambda admin=admin: (
                    (status := admin.status()).active_requests == 0 and status.kv_blocks_used == 0
                ),
                timeout=REQUEST_TIMEOUT_S,
                what=f"no request and no KV block held on {replica.target}",
            )


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_completion_equals_the_same_greedy_request_sent_directly(
    client: openai.OpenAI, model_name: str, replicas: list[ServerProcess], tokenizer, stream: bool
) -> None:
    prompt_ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    if not isinstance(prompt_ids, list):
        prompt_ids = list(prompt_ids["input_ids"])
    expected = _direct_text(replicas[0], tokenizer, prompt_ids)
    if stream:
        chunks = client.chat.completions.create(
            model=model_name, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, stream=True
        )
        text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    else:
        response = client.chat.completions.create(
            model=model_name, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0
        )
        text = response.choices[0].message.content or ""
        assert response.usage is not None and response.usage.prompt_tokens == len(prompt_ids)
    assert text == expected, f"through the gateway: {text!r}\ndirect: {expected!r}"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completion_equals_the_same_greedy_request_sent_directly(
    client: openai.OpenAI, model_name: str, replicas: list[ServerProcess], tokenizer, stream: bool
) -> None:
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    expected = _direct_text(replicas[1], tokenizer, prompt_ids)
    if stream:
        chunks = client.completions.create(
            model=model_name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stream=True
        )
        text = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
    else:
        response = client.completions.create(
            model=model_name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0
        )
        text = response.choices[0].text
    assert text == expected, f"through the gateway: {text!r}\ndirect: {expected!r}"


def test_a_client_that_disconnects_mid_stream_leaves_no_kv_block_held(
    client: openai.OpenAI, model_name: str, replicas: list[ServerProcess]
) -> None:
    stream = client.completions.create(
        model=model_name,
        prompt=PROMPT,
        max_tokens=1500,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    received = 0
    for chunk in stream:
        received += len(chunk.choices[0].text) if chunk.choices else 0
        if received >= 5:
            break
    stream.close()
    _wait_idle(replicas)


def test_n_choices_are_sampled_from_one_prompt(client: openai.OpenAI, model_name: str) -> None:
    """n = 3 sampled with a seed: three choices, indexed, each its own sample; greedy, all alike."""
    sampled = client.chat.completions.create(
        model=model_name, messages=MESSAGES, max_tokens=12, temperature=1.0, seed=3, n=3
    )
    assert sorted(choice.index for choice in sampled.choices) == [0, 1, 2]
    assert len({choice.message.content for choice in sampled.choices}) > 1, sampled.choices
    greedy = client.chat.completions.create(
        model=model_name, messages=MESSAGES, max_tokens=8, temperature=0, n=2
    )
    assert [choice.index for choice in greedy.choices] == [0, 1]
    assert greedy.choices[0].message.content == greedy.choices[1].message.content


def test_a_field_past_its_bound_comes_back_as_a_400_naming_it(client: openai.OpenAI, model_name: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=5000)
    assert "sampling_params.max_tokens" in str(caught.value), caught.value


def test_min_p_reaches_the_engine(client: openai.OpenAI, model_name: str) -> None:
    """min_p 1 keeps only the most likely token: sampled at temperature 1, the answer is the greedy one."""
    greedy = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=6, temperature=0)
    kept = client.chat.completions.create(
        model=model_name, messages=MESSAGES, max_tokens=6, temperature=1.0, seed=5, extra_body={"min_p": 1.0}
    )
    assert kept.choices[0].message.content == greedy.choices[0].message.content


def test_requests_sharing_a_prefix_land_mostly_on_one_replica(
    client: openai.OpenAI, model_name: str, gateway: Gateway, replicas: list[ServerProcess]
) -> None:
    """The gateway learns each replica's cached blocks from cbserve's KV events and routes by them."""
    shared = "You are a careful assistant who answers in one short sentence. " * 15  # about 200 tokens
    requests_before = _requests_per_worker(gateway)
    hits_before = gateway.metric("smg_cache_aware_policy_branch_total", branch="event_hit")
    cached_before = {replica.target: _prefix_cache_hit_tokens(replica) for replica in replicas}

    def ask(index: int) -> None:
        client.chat.completions.create(
            model=model_name,
            messages=[
                {"role": "system", "content": shared},
                {"role": "user", "content": f"Question {index}?"},
            ],
            max_tokens=2,
            temperature=0,
        )

    ask(0)
    # The first request's blocks reach the gateway's index as stored events before the others arrive.
    wait_until(
        lambda: gateway.metric("smg_kv_event_blocks_total", op="stored") >= 12,
        timeout=REQUEST_TIMEOUT_S,
        what="the first request's blocks in the gateway's index",
    )
    for index in range(1, 16):
        ask(index)
    routed = _requests_per_worker(gateway) - requests_before
    hits = gateway.metric("smg_cache_aware_policy_branch_total", branch="event_hit") - hits_before
    (busiest, count), *_ = routed.most_common()
    assert count >= 12, f"16 requests with one prefix were spread over replicas: {dict(routed)}"
    assert hits >= 12, f"only {hits} routing decisions matched cbserve's KV events"
    assert gateway.metric("smg_kv_event_batches_total", disposition="applied") > 0
    busiest_replica = next(replica for replica in replicas if busiest.endswith(replica.target))
    reused = _prefix_cache_hit_tokens(busiest_replica) - cached_before[busiest_replica.target]
    # Every request after the first on that replica reuses the shared prefix's full blocks (>= 160 tokens).
    assert reused >= (count - 1) * 160, f"{busiest} reused {reused} prompt tokens for {count} requests"


def _prefix_cache_hit_tokens(replica: ServerProcess) -> int:
    with AdminClient(replica.admin_target, ADMIN_TOKEN) as admin:
        return admin.status().prefix_cache_hits


def _requests_per_worker(gateway: Gateway) -> Counter[str]:
    counts: Counter[str] = Counter()
    for (name, labels), value in gateway.metrics().items():
        if name == "smg_worker_requests_total":
            counts[dict(labels)["worker"]] += int(value)
    return counts


def _post(url: str) -> tuple[int, str]:
    """(status, body) of an empty POST to `url`, an HTTP error status included."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    request = urllib.request.Request(url, data=b"", method="POST")
    try:
        with opener.open(request, timeout=REQUEST_TIMEOUT_S) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def _prefix_cache_hits(replicas: list[ServerProcess]) -> int:
    return sum(_prefix_cache_hit_tokens(replica) for replica in replicas)


def test_the_gateways_flush_cache_resets_every_replicas_prefix_cache(
    client: openai.OpenAI, model_name: str, gateway: Gateway, replicas: list[ServerProcess]
) -> None:
    """SMG's POST /flush_cache calls each replica's FlushCache (the vLLM protocol's prefix-cache reset): a
    prompt sent again after it is computed anew, and only a third time found in the cache."""
    prompt = "Reset the cache after each weight sync, a trainer says. " * 8  # about 100 tokens

    def ask() -> None:
        client.completions.create(model=model_name, prompt=prompt, max_tokens=1, temperature=0)

    _wait_idle(replicas)
    ask()
    status, body = _post(f"{gateway.base_url}/flush_cache")
    assert status == 200, body
    answer = json.loads(body)
    assert (answer["status"], answer["workers_flushed"]) == ("success", 2), answer
    hits = _prefix_cache_hits(replicas)
    stored = gateway.metric("smg_kv_event_blocks_total", op="stored")
    ask()
    assert _prefix_cache_hits(replicas) == hits, "the flushed prefix was found in a replica's cache"
    # Its blocks reach the gateway's index before the third request is routed by them.
    wait_until(
        lambda: gateway.metric("smg_kv_event_blocks_total", op="stored") >= stored + 6,
        timeout=REQUEST_TIMEOUT_S,
        what="the second request's blocks in the gateway's index",
    )
    ask()
    assert _prefix_cache_hits(replicas) >= hits + 96, "the prompt's blocks were not cached again"


def test_the_gateways_flush_cache_is_refused_by_a_replica_with_a_request_in_flight(
    gateway: Gateway, replicas: list[ServerProcess]
) -> None:
    busy = replicas[0]
    _wait_idle(replicas)
    with (
        AdminClient(busy.admin_target, ADMIN_TOKEN) as admin,
        Client(busy.target) as direct,
    ):
        with admin.paused():  # the request stays queued while the pause holds
            request_id = direct.submit([5, 6, 7], max_new_tokens=2)
            status, body = _post(f"{gateway.base_url}/flush_cache")
        assert list(direct.results(request_id))[-1].finish_reason in ("length", "eos"), "it ran on"
    answer = json.loads(body)
    assert status == 206 and answer["status"] == "partial_success", (status, body)
    assert answer["successful"] == [f"grpc://{replicas[1].target}"]
    (failed,) = answer["failed"]
    assert failed["worker"] == f"grpc://{busy.target}"
    assert "requests in flight (1 queued or running)" in failed["error"], failed
    status, body = _post(f"{gateway.base_url}/flush_cache")
    assert status == 200, body


def test_the_tokenizer_a_replica_streams_is_the_one_it_serves(
    replicas: list[ServerProcess], tokenizer, tmp_path: Path
) -> None:
    """What a gateway without a copy of the model loads (GetTokenizer): same ids, same chat template."""
    with grpc.insecure_channel(replicas[0].target) as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        chunks = list(stub.GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=REQUEST_TIMEOUT_S))
    data = b"".join(chunk.data for chunk in chunks)
    assert [chunk.sha256 for chunk in chunks[:-1]] == [""] * (len(chunks) - 1)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        archive.extractall(tmp_path)
    unpacked = AutoTokenizer.from_pretrained(tmp_path)
    assert unpacked(PROMPT)["input_ids"] == tokenizer(PROMPT)["input_ids"]
    rendered = unpacked.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert rendered == tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert (tmp_path / "generation_config.json").is_file() and (tmp_path / "config.json").is_file()


def test_after_one_replica_is_killed_requests_succeed_on_the_other(
    client: openai.OpenAI, model_name: str, replicas: list[ServerProcess]
) -> None:
    """Runs last in this module: it kills a replica (the module's fixture stops the other)."""
    victim = replicas[1]
    os.kill(victim.pid, signal.SIGKILL)
    victim.process.wait(timeout=30)
    started = time.monotonic()
    for index in range(6):
        response = client.completions.create(
            model=model_name, prompt=f"{PROMPT} {index}", max_tokens=4, temperature=0
        )
        assert response.choices[0].finish_reason in ("stop", "length")
    assert time.monotonic() - started < 6 * REQUEST_TIMEOUT_S
