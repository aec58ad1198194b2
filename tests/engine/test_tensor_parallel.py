"""Tensor parallelism on CPU: two gloo ranks of a sharded tiny Llama stay in lockstep.

Each scenario runs `tensor_parallel_worker.py` as two processes (launched the way torchrun does, through
RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT) and reads what each rank wrote. The oracle is
`model.generate` on the unsharded model in this process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from bench.ports import free_port
from engine.parallel import check_tensor_parallel_size, torchrun_environment
from tests.helpers.models import random_prompt, tiny_config
from tests.helpers.oracle import reference_greedy

WORKER = Path(__file__).with_name("tensor_parallel_worker.py")
REPO_ROOT = Path(__file__).resolve().parents[2]
WORLD_SIZE = 2
MAX_NEW_TOKENS = 16
PROMPT_LENGTHS = (1, 7, 16, 33, 70)


def build_model(seed: int, tie_word_embeddings: bool = False) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = tiny_config("llama")
    config.tie_word_embeddings = tie_word_embeddings
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    return model.eval()


def launch_ranks(arguments: list[str], timeout_s: float, stop_after_rank0: bool = False) -> list[int | None]:
    """Runs the worker as WORLD_SIZE ranks; returns their exit codes (None: killed after rank 0 ended)."""
    port = free_port()
    processes = []
    for rank in range(WORLD_SIZE):
        env = {
            **os.environ,
            **torchrun_environment(rank, WORLD_SIZE, port),
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(REPO_ROOT),
        }
        processes.append(subprocess.Popen([sys.executable, str(WORKER), *arguments], env=env, cwd=REPO_ROOT))
    codes: list[int | None] = []
    try:
        codes.append(processes[0].wait(timeout=timeout_s))
        for process in processes[1:]:
            if stop_after_rank0:
                process.kill()
                process.wait()
                codes.append(None)
            else:
                codes.append(process.wait(timeout=timeout_s))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    return codes


def read_reports(out: Path) -> list[dict[str, Any]]:
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(WORLD_SIZE)]


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    folder = tmp_path_factory.mktemp("tp-models")
    build_model(0).save_pretrained(folder / "seed0")
    build_model(1).save_pretrained(folder / "seed1")
    yield folder / "seed0", folder / "seed1" / "model.safetensors"


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def lockstep(
    request: pytest.FixtureRequest, saved_models: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> list[dict[str, Any]]:
    """Both ranks through the lockstep scenario, with steps resolved at once or launched one ahead."""
    model_dir, new_weights = saved_models
    out = tmp_path_factory.mktemp("tp-lockstep")
    prompts = [random_prompt(length, seed=length) for length in PROMPT_LENGTHS]
    (out / "prompts.json").write_text(json.dumps(prompts))
    arguments = ["--scenario", "lockstep", "--model", str(model_dir), "--new-weights", str(new_weights)]
    if request.param:
        arguments.append("--async-batching")
    codes = launch_ranks(
        [*arguments, "--out", str(out), "--max-new-tokens", str(MAX_NEW_TOKENS)], timeout_s=300
    )
    assert codes == [0, 0], f"rank exit codes {codes}"
    reports = read_reports(out)
    for report in reports:
        report["prompts"] = prompts
    return reports


def test_each_rank_holds_a_shard(lockstep: list[dict[str, Any]]) -> None:
    assert [report["tp_size"] for report in lockstep] == [WORLD_SIZE, WORLD_SIZE]
    num_kv_heads = tiny_config("llama").num_key_value_heads
    assert [report["kv_heads_cached"] for report in lockstep] == [num_kv_heads // WORLD_SIZE] * WORLD_SIZE
    assert [report["loop_error"] for report in lockstep] == [None, None]
    assert all(report["loop_ended"] for report in lockstep), "stop on the driver must end every rank's loop"


def test_every_rank_runs_in_the_mode_asked_for(
    lockstep: list[dict[str, Any]], request: pytest.FixtureRequest
) -> None:
    launched_ahead = "async" in request.node.callspec.id
    assert [report["async_batching"] for report in lockstep] == [launched_ahead] * WORLD_SIZE
    for report in lockstep:
        # Steps prepared before their predecessor's tokens landed feed those tokens on the device.
        assert (report["placeholder_inputs"] > 0) == launched_ahead, report["placeholder_inputs"]


def test_greedy_outputs_equal_the_unsharded_model(lockstep: list[dict[str, Any]]) -> None:
    results = lockstep[0]["results"]
    prompts = lockstep[0]["prompts"]
    expected = [reference_greedy(build_model(0), prompt, MAX_NEW_TOKENS) for prompt in prompts]
    for prompt, got, want in zip(prompts, results["greedy_before"], expected, strict=True):
        assert got == want, f"prompt of {len(prompt)} tokens:\n  tp=2:     {got}\n  generate: {want}"


def test_every_rank_finished_the_same_requests_with_the_same_tokens(lockstep: list[dict[str, Any]]) -> None:
    driver, follower = (report["finished"] for report in lockstep)
    assert driver.keys() == follower.keys()
    for request_id in driver:
        assert driver[request_id] == follower[request_id], f"{request_id}: rank 0 and rank 1 differ"
    # Cancel reached the follower: the request ended CANCELLED there too, after the same tokens.
    assert follower["to-cancel"]["status"] == "CANCELLED"
    assert lockstep[0]["results"]["cancelled_status"] == "CANCELLED"
    # So did an ABORT pause.
    assert lockstep[0]["results"]["abort_cancelled"] == 1
    assert follower["aborted"]["status"] == lockstep[0]["results"]["aborted_status"] == "CANCELLED"
    # Requests reach the other ranks through the driver only.
    assert lockstep[1]["add_request_on_follower"] is None
    # Unseeded sampling too: both ranks drew the same tokens (the seed is the driver's).
    assert len(lockstep[0]["results"]["sampled"]) == 4


def test_weight_updates_reach_every_shard(lockstep: list[dict[str, Any]]) -> None:
    results = lockstep[0]["results"]
    prompts = lockstep[0]["prompts"]
    assert results["version_after_state_dict"] == 2
    in_flight = results["in_flight"]
    assert in_flight["status"] == "FINISHED" and in_flight["tokens"] == 30, in_flight
    assert in_flight["weight_version"] == 2 and in_flight["tokens_before_update"] >= 5
    new_model = build_model(1)
    for prompt, got in zip(prompts, results["greedy_after"], strict=True):
        want = reference_greedy(new_model, prompt, MAX_NEW_TOKENS)
        assert got == want, (
            f"after the update, prompt of {len(prompt)}:\n  tp=2:     {got}\n  generate: {want}"
        )
    assert "model.embed_tokens.weight" in results["bad_update_error"]
    assert results["greedy_after_bad_update"] == results["greedy_after"][:2], (
        "a rejected update changed outputs"
    )
    assert results["version_after_path"] == 3
    assert results["greedy_after_path"] == results["greedy_before"][:2], (
        "the folder update did not restore seed 0"
    )


def test_the_weights_checksum_of_a_sharded_model_is_the_unsharded_models(
    lockstep: list[dict[str, Any]],
) -> None:
    from engine.weights.checksum import weights_checksum

    results = lockstep[0]["results"]
    expected = weights_checksum(build_model(1).state_dict()).digest
    assert results["checksum_after_update"] == {"digest": expected, "weight_version": 2}
    assert results["prefix_blocks_reset"] > 0, "the greedy requests before it left prefix blocks"


def test_a_stopped_engine_starts_again_on_every_rank(lockstep: list[dict[str, Any]]) -> None:
    """The driver's stop ends every rank's loop; its start resumes them all, serving the same tokens
    (the folder update restored seed 0's weights, as before the stop)."""
    results = lockstep[0]["results"]
    assert results["running_while_stopped"] is False
    assert results["greedy_after_restart"] == results["greedy_before"][:2]
    assert all(rank["loop_error"] is None for rank in lockstep)


class _RecordingGroup:
    """Stands in for the gloo group: records what a stopped driver broadcasts, or fails like a lost rank."""

    def __init__(self, lost: bool = False) -> None:
        self.lost = lost
        self.sent: list[Any] = []

    def broadcast(self, value: Any) -> Any:
        if self.lost:
            raise RuntimeError("Connection closed by peer")
        self.sent.append(value)
        return value


def test_a_stopped_driver_beats_until_it_restarts_or_ends() -> None:
    from engine.loop.lockstep import StoppedDriverNews, StoppedHeartbeat

    for decision in (StoppedDriverNews.RESTART, StoppedDriverNews.END):
        group = _RecordingGroup()
        heartbeat = StoppedHeartbeat(group, interval_s=0.01)  # type: ignore[arg-type]
        time.sleep(0.2)
        heartbeat.end(decision)
        assert len(group.sent) >= 3 and set(group.sent[:-1]) == {StoppedDriverNews.STILL_STOPPED}, group.sent
        assert group.sent[-1] == decision


def test_a_rank_lost_while_stopped_makes_the_restart_fail_saying_so() -> None:
    from engine.loop.lockstep import StoppedDriverNews, StoppedHeartbeat

    heartbeat = StoppedHeartbeat(_RecordingGroup(lost=True), interval_s=0.01)  # type: ignore[arg-type]
    with pytest.raises(
        RuntimeError, match=r"lost while the engine was stopped .*closed by peer.*restart the processes"
    ):
        heartbeat.end(StoppedDriverNews.RESTART)


def test_a_weight_update_tick_names_its_tensors_and_leaves_their_bytes_to_follow() -> None:
    """A state dict pushed to a sharded model is not pickled into the tick: every rank would otherwise
    hold several copies of the whole model while it travels (the lockstep test above runs it for real)."""
    from concurrent.futures import Future

    from engine.loop.commands import UpdateWeights, WeightUpdate
    from engine.loop.lockstep import TensorBroadcast, TensorSpec, encode_commands, replayable

    weights = [("model.embed_tokens.weight", torch.zeros(4096, 1024)), ("model.norm.weight", torch.ones(8))]
    command = replayable(UpdateWeights(WeightUpdate(weights, "step-7"), Future()))
    assert isinstance(command, UpdateWeights)
    update = command.update
    assert command.result is None and update.label == "step-7"
    assert update.source == TensorBroadcast(
        (
            TensorSpec("model.embed_tokens.weight", torch.float32, (4096, 1024)),
            TensorSpec("model.norm.weight", torch.float32, (8,)),
        )
    )
    assert len(encode_commands([command])) < 2_000
    # Entries that are not (name, tensor) pairs still travel, so that every rank rejects them alike.
    bad = replayable(UpdateWeights(WeightUpdate([("model.norm.weight", [1.0])], None), None))
    assert isinstance(bad, UpdateWeights)
    assert bad.update.source == [("model.norm.weight", [1.0])]


@pytest.mark.parametrize("scenario", ["hang", "die"])
def test_a_lost_rank_fails_the_driver_within_the_timeout(
    scenario: str, saved_models: tuple[Path, Path], tmp_path: Path
) -> None:
    timeout_s = 4.0
    model_dir, _ = saved_models
    arguments = [
        "--scenario",
        scenario,
        "--model",
        str(model_dir),
        "--out",
        str(tmp_path),
        "--timeout",
        str(timeout_s),
    ]
    codes = launch_ranks(arguments, timeout_s=120, stop_after_rank0=True)
    assert codes[0] == 0, f"rank 0 exit code {codes[0]}"
    driver = json.loads((tmp_path / "rank0.json").read_text())
    results = driver["results"]
    assert results["status"] == "FAILED", results
    assert driver["loop_error"] is not None, "the driver's loop must report the lost rank"
    assert results["seconds_to_fail"] < timeout_s + 20, results
    assert driver["loop_ended"]


def test_batch_invariant_mode_gives_the_needle_the_same_bits_on_two_ranks(
    saved_models: tuple[Path, Path], tmp_path: Path
) -> None:
    """Batch-invariant mode under tensor parallelism (issue 33): the sharded linear layers run the mode's
    kernels on their shards, and two ranks' partial sums add once, so a needle alone and among twelve other
    prompts has the same tokens and logprobs, bit for bit."""
    model_dir, _ = saved_models
    needle = random_prompt(45, seed=4500)
    others = [random_prompt(length, seed=length) for length in (3, 9, 14, 20, 27, 33, 41, 50, 58, 66, 75, 90)]
    (tmp_path / "prompts.json").write_text(json.dumps([needle, *others]))
    arguments = ["--scenario", "batch_invariant", "--model", str(model_dir), "--out", str(tmp_path)]
    codes = launch_ranks(arguments, timeout_s=300)
    assert codes == [0, 0], f"rank exit codes {codes}"
    results = json.loads((tmp_path / "rank0.json").read_text())["results"]
    alone, batched = results["alone"], results["batched"]
    assert batched["tokens"] == alone["tokens"]
    assert torch.equal(torch.tensor(batched["logprobs"]), torch.tensor(alone["logprobs"])), (
        f"logprobs differ\n  alone:   {alone['logprobs']}\n  batched: {batched['logprobs']}"
    )


def test_quantized_shards_serve_the_unsharded_models_quantized_weights(tmp_path: Path) -> None:
    """`quantization` under tensor parallelism: each rank packs its shard of every linear layer and does
    the layer's communication itself (engine.quantization.sharding). Gathered, the shards are exactly the
    unsharded model quantized (same checksum), the ranks serve its greedy tokens, and a full-precision
    update is quantized shard by shard into what the unsharded update would give. The model ties its
    output layer to the input embedding, as SmolLM2 does: the update names only the embedding."""
    from safetensors.torch import save_model

    from engine.quantization.model import quantize_model
    from engine.weights.checksum import model_weights, weights_checksum
    from tests.helpers.engine_runs import dequantized_copy

    build_model(0, tie_word_embeddings=True).save_pretrained(tmp_path / "seed0")
    save_model(build_model(1, tie_word_embeddings=True), str(tmp_path / "seed1.safetensors"))
    prompts = [random_prompt(length, seed=length) for length in PROMPT_LENGTHS]
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    arguments = ["--scenario", "quantized", "--model", str(tmp_path / "seed0"), "--quantization", "int4"]
    arguments += ["--new-weights", str(tmp_path / "seed1.safetensors"), "--out", str(tmp_path)]
    codes = launch_ranks([*arguments, "--max-new-tokens", str(MAX_NEW_TOKENS)], timeout_s=300)
    assert codes == [0, 0], f"rank exit codes {codes}"
    reports = read_reports(tmp_path)
    styles = {"q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise", "o_proj": "rowwise"}
    styles |= {"gate_proj": "colwise", "up_proj": "colwise", "down_proj": "rowwise", "lm_head": "gathered"}
    for report in reports:
        layers = report["quantized_layers"]
        assert len(layers) == 7 * tiny_config("llama").num_hidden_layers + 1, layers
        assert all(style == styles[name.rpartition(".")[2]] for name, style in layers.items()), layers
    results = reports[0]["results"]
    for seed, moment in ((0, "before"), (1, "after")):
        quantized = build_model(seed, tie_word_embeddings=True)
        quantize_model(quantized, "int4")
        assert results[f"checksum_{moment}"] == weights_checksum(model_weights(quantized)).digest, moment
        reference = dequantized_copy(quantized, build_model(seed, tie_word_embeddings=True))
        for prompt, got in zip(prompts, results[f"greedy_{moment}"], strict=True):
            want = reference_greedy(reference, prompt, MAX_NEW_TOKENS)
            assert got == want, (
                f"{moment} the update, prompt of {len(prompt)}:\n  tp=2:     {got}\n  generate: {want}"
            )


def test_tp_size_must_divide_the_kv_heads() -> None:
    config = tiny_config("llama")  # 2 KV heads
    check_tensor_parallel_size(config, 2)
    with pytest.raises(
        ValueError, match=r"tensor-parallel size 3 must divide the model's num_key_value_heads \(2\)"
    ):
        check_tensor_parallel_size(config, 3)
