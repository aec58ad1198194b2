"""`cbserve serve --tp 2` on CPU: two gloo ranks behind one gRPC port, driven through the Python SDK."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
import pytest
import torch
from cbserve_client import AdminClient, Client, InvalidArgumentError
from transformers import AutoModelForCausalLM

from tests.helpers.models import random_prompt, tiny_config
from tests.helpers.oracle import reference_greedy
from tests.helpers.servers import ADMIN_TOKEN, NOT_SERVING, SERVING, ServerProcess, probe_health, wait_until

ENGINE_FLAGS = ("--tp", "2", "--num-blocks", "64", "--page-size", "16")
MAX_NEW_TOKENS = 12


def seeded_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = tiny_config("llama")
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32).eval()


def ranks_of(server: ServerProcess) -> list[psutil.Process]:
    return psutil.Process(server.pid).children()


def follower_of(server: ServerProcess) -> psutil.Process:
    (follower,) = [rank for rank in ranks_of(server) if rank.environ().get("RANK") == "1"]
    return follower


@pytest.fixture()
def model_dir(tmp_path: Path) -> Path:
    seeded_model(0).save_pretrained(tmp_path / "model")
    return tmp_path / "model"


def test_two_ranks_serve_generate_update_cancel_and_drain(model_dir: Path, tmp_path: Path) -> None:
    server = ServerProcess(model_dir, tmp_path / "server.log", *ENGINE_FLAGS)
    try:
        server.wait_serving(timeout=180)
        assert len(ranks_of(server)) == 2, "--tp 2 runs two rank processes"
        prompts = [random_prompt(length, seed=length) for length in (3, 20, 45)]
        with Client(server.target) as client, AdminClient(server.admin_target, token=ADMIN_TOKEN) as admin:
            before = seeded_model(0)
            for prompt in prompts:
                got = client.generate(prompt, max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True).token_ids
                want = reference_greedy(before, prompt, MAX_NEW_TOKENS)
                assert got == want, f"tp=2 over gRPC: {got}\nmodel.generate: {want}"

            cancelled = False
            with client.stream(prompts[0], max_new_tokens=400, ignore_eos=True) as stream:
                for chunk in stream:
                    if chunk.token_ids and not cancelled:
                        cancelled = client.cancel(stream.request_id)
                        assert cancelled, "a request in flight must be cancellable"
                    if chunk.finished:
                        break
            assert chunk.finish_reason == "cancelled"

            after = seeded_model(1)
            assert admin.update_weights(after.state_dict(), version="seed-1").weight_version == 2
            for prompt in prompts:
                completion = client.generate(prompt, max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True)
                want = reference_greedy(after, prompt, MAX_NEW_TOKENS)
                assert completion.token_ids == want, f"after the update: {completion.token_ids}\n{want}"
                assert completion.weight_versions == [2]

            with pytest.raises(InvalidArgumentError, match=r"tensor 'lm_head.weight': shape \[2, 2\]"):
                admin.update_weights({"lm_head.weight": torch.zeros(2, 2)})
            assert admin.status().weight_version == 2
            got = client.generate(prompts[1], max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True).token_ids
            assert got == reference_greedy(after, prompts[1], MAX_NEW_TOKENS), (
                "a rejected update changed outputs"
            )

        follower = follower_of(server)
        server.terminate()
        assert server.process.wait(timeout=60) == 0, server.log_tail()
        assert not follower.is_running(), "the follower rank must end with the driver"
    finally:
        server.close()


def test_a_killed_rank_turns_health_not_serving_and_ends_the_server(model_dir: Path, tmp_path: Path) -> None:
    server = ServerProcess(model_dir, tmp_path / "server.log", *ENGINE_FLAGS)
    try:
        server.wait_serving(timeout=180)
        follower = follower_of(server)
        os.kill(follower.pid, signal.SIGKILL)
        wait_until(lambda: probe_health(server.target) in (NOT_SERVING, None), timeout=60, what="NOT_SERVING")
        assert server.process.wait(timeout=60) != 0, "a lost rank is a failure of the whole server"
    finally:
        server.close()


def test_tp_that_does_not_divide_the_kv_heads_fails_at_start_naming_both(
    model_dir: Path, tmp_path: Path
) -> None:
    server = ServerProcess(model_dir, tmp_path / "server.log", "--tp", "3")
    try:
        assert server.process.wait(timeout=60) == 2
        log = server.log_tail()
        assert "--tp 3" in log and "num_key_value_heads (2)" in log, log
    finally:
        server.close()


def test_a_stopped_tp_engine_starts_again_and_ranks_do_not_outlive_a_killed_launcher(
    model_dir: Path, tmp_path: Path
) -> None:
    server = ServerProcess(model_dir, tmp_path / "server.log", *ENGINE_FLAGS)
    ranks: list[psutil.Process] = []
    try:
        server.wait_serving(timeout=180)
        ranks = ranks_of(server)
        assert len(ranks) == 2
        follower = follower_of(server)
        prompt = random_prompt(12, seed=12)
        want = reference_greedy(seeded_model(0), prompt, MAX_NEW_TOKENS)
        with Client(server.target) as client, AdminClient(server.admin_target, token=ADMIN_TOKEN) as admin:
            admin.stop()
            assert probe_health(server.target) == NOT_SERVING
            # Several heartbeats of the stopped driver (one a second), which the follower waits through.
            time.sleep(2.5)
            assert follower.is_running(), "a stop must leave the follower rank waiting for a start"
            assert admin.start() is True
            wait_until(lambda: probe_health(server.target) == SERVING, timeout=60, what="SERVING")
            got = client.generate(prompt, max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True).token_ids
            assert got == want, f"tp=2 after a restart: {got}\nmodel.generate: {want}"
        server.process.kill()
        server.process.wait(timeout=30)
        _, alive = psutil.wait_procs(ranks, timeout=30)
        assert not alive, f"ranks {[rank.pid for rank in alive]} outlived their launcher"
    finally:
        for rank in ranks:
            if rank.is_running():
                rank.kill()
        server.close()
