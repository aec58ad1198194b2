"""What RL frameworks call, through the Python SDK against live in-process servers: logprobs of the
sampled distribution (logprobs_mode, per request and as the server's default), the prefix-cache reset
after a weight sync (refused with requests in flight unless they are aborted), the weights' checksum
(the server's equals the trainer's own, and a fleet compares every replica in one call), `push_and_verify`
(a push proved by the replicas' digests, with each phase timed), and what Sleep reports of memory actually
held."""

from __future__ import annotations

import math
from collections.abc import Iterator

import grpc
import pytest
import torch
from cbserve_client import (
    AdminClient,
    AdminFleet,
    Client,
    FailedPreconditionError,
    InvalidArgumentError,
    WeightsMismatchError,
    push_and_verify,
    weights_checksum,
)
from cbserve_client.proto import generation_pb2, generation_pb2_grpc, types_pb2

from tests.helpers.models import fresh_tiny_model, random_prompt, seeded_tiny_llama
from tests.helpers.servers import ADMIN_TOKEN, RunningServer, engine_config_for_tests, loaded_server

TIMEOUT = 60
CHANGED = "model.layers.0.mlp.up_proj.weight"


@pytest.fixture(scope="module")
def replicas() -> Iterator[list[RunningServer]]:
    """Two replicas of the same weights (models of their own: the tests change them); the first serves
    processed logprobs by default."""
    configs = [engine_config_for_tests(logprobs_mode="processed_logprobs"), engine_config_for_tests()]
    servers: list[RunningServer] = []
    try:
        for config in configs:
            servers.append(loaded_server(fresh_tiny_model("llama"), config=config))
        yield servers
    finally:
        for server in servers:
            server.close()


@pytest.fixture
def client(replicas: list[RunningServer]) -> Iterator[Client]:
    with Client(replicas[0].target, timeout=TIMEOUT, stream_timeout=TIMEOUT) as connected:
        yield connected


@pytest.fixture
def admin(replicas: list[RunningServer]) -> Iterator[AdminClient]:
    with AdminClient(replicas[0].admin_target, ADMIN_TOKEN, timeout=TIMEOUT) as connected:
        yield connected


@pytest.fixture
def fleet(replicas: list[RunningServer]) -> Iterator[AdminFleet]:
    with AdminFleet([server.admin_target for server in replicas], ADMIN_TOKEN, timeout=TIMEOUT) as connected:
        yield connected


def _logsumexp(values: list[float]) -> float:
    return math.log(sum(math.exp(value) for value in values))


# ------------------------------------------------------------------ logprobs mode


def test_processed_logprobs_are_those_of_the_top_k_the_token_was_drawn_from(client: Client) -> None:
    prompt = random_prompt(12, seed=1)
    sampling = dict(max_new_tokens=6, temperature=0.8, top_k=2, seed=5, top_logprobs=5, ignore_eos=True)
    processed = client.generate(prompt, logprobs_mode="processed_logprobs", **sampling)
    raw = client.generate(prompt, logprobs_mode="raw_logprobs", **sampling)
    assert processed.token_ids == raw.token_ids, "the mode changes what is reported, not what is drawn"
    for step, (kept, every) in enumerate(zip(processed.logprobs, raw.logprobs, strict=True)):
        assert len(kept.top) == 2 and len(every.top) == 5, step
        assert _logsumexp([top.logprob for top in kept.top]) == pytest.approx(0.0, abs=1e-4), (
            f"step {step}: the two tokens top-k kept carry all the probability"
        )
        assert kept.logprob > every.logprob, f"step {step}: renormalised over two tokens, it is likelier"


def test_a_request_without_a_mode_gets_the_servers_default(
    client: Client, replicas: list[RunningServer]
) -> None:
    prompt = random_prompt(12, seed=2)
    sampling = dict(max_new_tokens=4, temperature=0.8, top_k=2, seed=6, top_logprobs=5, ignore_eos=True)
    by_default = client.generate(prompt, **sampling)
    assert all(len(step.top) == 2 for step in by_default.logprobs), "the first replica's default: processed"
    with Client(replicas[1].target, timeout=TIMEOUT, stream_timeout=TIMEOUT) as other:
        assert all(len(step.top) == 5 for step in other.generate(prompt, **sampling).logprobs), (
            "the second replica's default: raw"
        )


def test_an_unknown_logprobs_mode_is_refused_by_the_client_and_by_the_server(
    replicas: list[RunningServer],
) -> None:
    with (
        Client(replicas[0].target) as client,
        pytest.raises(InvalidArgumentError, match=r"sampling\.logprobs_mode must be one of"),
    ):
        client.generate([5, 6], logprobs_mode="processed_logits")
    request = types_pb2.GenerationRequest(token_ids=types_pb2.TokenIds(ids=[5, 6]))
    request.sampling.logprobs_mode = 7  # type: ignore[assignment]
    with grpc.insecure_channel(replicas[0].target) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.AddRequest(generation_pb2.AddRequestRequest(request=request), timeout=TIMEOUT)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.logprobs_mode: unknown value 7" in (refused.value.details() or "")


# ------------------------------------------------------------------ prefix-cache reset


def test_reset_prefix_cache_drops_what_a_request_left_cached(client: Client, admin: AdminClient) -> None:
    client.generate(random_prompt(40, seed=3), max_new_tokens=1)  # two full 16-token blocks at least
    reset = admin.reset_prefix_cache()
    assert reset.dropped_blocks >= 2 and reset.aborted_requests == 0
    assert admin.reset_prefix_cache().dropped_blocks == 0


def test_reset_prefix_cache_is_refused_with_a_request_in_flight_unless_it_aborts_it(
    client: Client, admin: AdminClient
) -> None:
    with admin.paused():  # the request stays queued while the pause holds
        request_id = client.submit(random_prompt(10, seed=4), max_new_tokens=4)
        with pytest.raises(FailedPreconditionError, match=r"requests in flight \(1 queued or running\)"):
            admin.reset_prefix_cache()
        reset = admin.reset_prefix_cache(abort=True)
    assert reset.aborted_requests == 1
    assert list(client.results(request_id))[-1].finish_reason == "cancelled"


# ------------------------------------------------------------------ weights checksum


def test_the_servers_checksum_equals_the_trainers_own_of_the_same_weights(admin: AdminClient) -> None:
    served = admin.weights_checksum(per_tensor=True)
    trainer = weights_checksum(fresh_tiny_model("llama").state_dict())
    assert served.algorithm == trainer.algorithm == "xxh3-128"
    assert served.digest == trainer.digest
    assert served.tensors == trainer.tensors
    assert served.num_tensors == len(served.tensors) == len(fresh_tiny_model("llama").state_dict())
    summary = admin.weights_checksum()
    assert summary.digest == served.digest and summary.tensors == {}, "per-tensor digests only on request"


def test_the_trainers_checksum_of_what_it_pushed_equals_the_servers_after_the_push(
    replicas: list[RunningServer],
) -> None:
    """A float32 push, then a bfloat16 trainer's push to the float32 server: the trainer digests its own
    tensors cast to the server's dtype (`dtype=`), as the server casts what it receives."""
    trainer_state = fresh_tiny_model("llama").state_dict()
    trainer_state[CHANGED] = seeded_tiny_llama(9).state_dict()[CHANGED]
    with AdminClient(replicas[1].admin_target, ADMIN_TOKEN, timeout=TIMEOUT) as admin:
        try:
            before = admin.weights_checksum()
            update = admin.update_weights({CHANGED: trainer_state[CHANGED]}, version="step-1")
            after = admin.weights_checksum(per_tensor=True)
            assert after.digest == weights_checksum(trainer_state).digest != before.digest
            assert after.weight_version == update.weight_version == before.weight_version + 1

            bf16_state = {name: tensor.to(torch.bfloat16) for name, tensor in trainer_state.items()}
            admin.update_weights(bf16_state, version="step-2")
            served = admin.weights_checksum(per_tensor=True)
            assert served.digest == weights_checksum(bf16_state, dtype=torch.float32).digest
            as_held = weights_checksum(bf16_state)
            assert as_held.tensors[CHANGED].dtype == "BF16" and as_held.digest != served.digest
        finally:  # the fleet test below needs both replicas equal again
            admin.update_weights(fresh_tiny_model("llama").state_dict())


def test_the_trainers_checksum_equals_the_engines_for_every_dtype_and_layout() -> None:
    """Both apply cbserve_checksum's one algorithm; this checks what each adds around it (dtype names,
    shapes, tied names, the order of the model's lines)."""
    from engine.weights import checksum as server_side

    generator = torch.Generator().manual_seed(0)
    values = torch.randn(7, 13, generator=generator) * 100
    tensors = {
        "f32": values,
        "bf16 odd length": values.to(torch.bfloat16).reshape(-1)[:91],
        "f16": values.to(torch.float16),
        "i64": values.to(torch.int64),
        "u8 of 3": torch.tensor([1, 2, 250], dtype=torch.uint8),
        "bool": values > 0,
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "column-major": values.t(),
    }
    trainer = weights_checksum(tensors)
    server = server_side.weights_checksum(tensors)
    assert {name: (c.digest, c.dtype, c.shape) for name, c in trainer.tensors.items()} == {
        c.name: (c.digest, c.dtype, c.shape) for c in server.tensors
    }
    assert trainer.digest == server.digest


def test_tied_weights_are_digested_once_under_each_name() -> None:
    model = fresh_tiny_model("llama")
    state = model.state_dict()
    state["tied.copy"] = state["model.norm.weight"]  # state_dict() gives tied names as detached views
    checksum = weights_checksum(state)
    assert checksum.tensors["tied.copy"].digest == checksum.tensors["model.norm.weight"].digest
    assert checksum.num_tensors == len(state)


def test_check_weights_passes_on_equal_replicas_and_names_the_one_that_differs(
    fleet: AdminFleet, replicas: list[RunningServer]
) -> None:
    expected = weights_checksum(fresh_tiny_model("llama").state_dict())
    assert fleet.check_weights().digest == expected.digest
    assert fleet.check_weights(expected=expected).digest == expected.digest
    stray = seeded_tiny_llama(10).state_dict()[CHANGED]
    with AdminClient(replicas[1].admin_target, ADMIN_TOKEN, timeout=TIMEOUT) as admin:
        admin.update_weights({CHANGED: stray})
        try:
            with pytest.raises(WeightsMismatchError) as mismatch:
                fleet.check_weights(expected=expected)
            differing_target = replicas[1].admin_target
            assert mismatch.value.reference == "expected"
            assert mismatch.value.differing == {differing_target: (CHANGED,)}
            message = str(mismatch.value)
            assert (
                f"1 of 2 replicas hold other weights than the expected weights: {differing_target}" in message
            )
            assert CHANGED in message
            with pytest.raises(WeightsMismatchError) as against_first:
                fleet.check_weights()
            assert against_first.value.reference == replicas[0].admin_target
            assert against_first.value.differing == {differing_target: (CHANGED,)}
        finally:
            admin.update_weights({CHANGED: fresh_tiny_model("llama").state_dict()[CHANGED]})
    assert fleet.check_weights(expected=expected).digest == expected.digest


def test_push_and_verify_pushes_to_every_replica_and_proves_it_with_their_digests(fleet: AdminFleet) -> None:
    trained = seeded_tiny_llama(12).state_dict()
    before = [status.weight_version for status in fleet.status()]
    try:
        report = push_and_verify(fleet, trained, version="step-12")
        assert report.weight_versions == {
            target: version + 1 for target, version in zip(fleet.targets, before, strict=True)
        }
        assert report.checksum.digest == weights_checksum(trained).digest
        assert [checksum.digest for checksum in fleet.weights_checksum()] == [report.checksum.digest] * 2
        phases = (report.push_s, report.trainer_checksum_s, report.servers_checksum_s)
        assert all(seconds > 0 for seconds in phases) and report.total_s >= report.push_s, report

        # A bfloat16 trainer pushing to float32 servers matches only once it says the servers' dtype.
        bf16 = {name: tensor.to(torch.bfloat16) for name, tensor in trained.items()}
        with pytest.raises(WeightsMismatchError) as mismatch:
            push_and_verify(fleet, bf16)
        assert mismatch.value.reference == "expected" and len(mismatch.value.differing) == 2
        proved = push_and_verify(fleet, bf16, dtype=torch.float32)
        assert proved.checksum.digest == weights_checksum(bf16, dtype=torch.float32).digest
    finally:  # the other tests need the replicas' first weights
        fleet.update_weights(fresh_tiny_model("llama").state_dict())


# ------------------------------------------------------------------ sleep


def test_sleep_of_an_idle_server_reports_both_figures() -> None:
    # 32768 blocks * 16 tokens * 512 bytes = 256 MiB, never written. The resident figure is the process's
    # RSS before and after, and this server shares its process with the test run: a cache this large keeps
    # the bound far above what other threads allocate or free meanwhile (14 MB seen once beside 32 MiB).
    config = engine_config_for_tests(num_blocks=32768)
    server = loaded_server(fresh_tiny_model("llama"), config=config)
    try:
        with AdminClient(server.admin_target, ADMIN_TOKEN, timeout=TIMEOUT) as admin:
            result = admin.sleep(1)
            assert result.released_bytes == 32768 * 16 * 512
            assert result.resident_bytes_released is not None
            assert result.resident_bytes_released < result.released_bytes / 4, (
                f"an idle server's cache was never written: {result}"
            )
            assert admin.wake_up() == 0
    finally:
        server.close()
