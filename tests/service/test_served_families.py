"""`cbserve serve --model FOLDER` serves a family as the engine does in process, or exits before SERVING
with the engine's one-line refusal (engine.families).

Gemma 2 has no SDPA attention in transformers, and the server loaded every model with SDPA, so a folder
the engine served in process could not be served at all; it now loads such a class with eager attention.
"""

from __future__ import annotations

import pytest
from cbserve_client import Client

from tests.helpers.families import tiny_family_model
from tests.helpers.models import random_prompt
from tests.helpers.oracle import reference_greedy
from tests.helpers.servers import ServerProcess

ENGINE_FLAGS = ("--num-blocks", "64", "--page-size", "16")
STARTUP_TIMEOUT_S = 180.0
CALL_TIMEOUT_S = 60.0
NEW_TOKENS = 12


# Gemma 2: alternating sliding and full layers, eager attention only; Qwen3-MoE: routed experts;
# DeepSeek V3: multi-head latent attention over a cache of latents; LFM2: short convolutions whose state
# lives in per-request slots; Falcon: attention in the model's own code, which an adapter of the engine's
# stands in for; Bloom: an adapter with ALiBi's bias, and a model forward that builds its bias from a 2-D
# mask the server's steps do not pass.
@pytest.mark.parametrize("model_type", ["gemma2", "qwen3_moe", "deepseek_v3", "falcon", "lfm2", "bloom"])
def test_a_served_family_gives_model_generates_tokens_through_the_server(model_type, tmp_path):
    model = tiny_family_model(model_type)
    model.save_pretrained(tmp_path / "model")
    prompts = [random_prompt(length, seed=length) for length in (6, 40)]  # 40: past the 24-token window
    expected = [reference_greedy(model, prompt, NEW_TOKENS) for prompt in prompts]
    server = ServerProcess(tmp_path / "model", tmp_path / "server.log", *ENGINE_FLAGS)
    try:
        server.wait_serving(timeout=STARTUP_TIMEOUT_S)
        with Client(server.target, stream_timeout=CALL_TIMEOUT_S) as client:
            served = [
                client.generate(prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True).token_ids
                for prompt in prompts
            ]
    finally:
        server.close()
    for prompt, tokens, reference in zip(prompts, served, expected, strict=True):
        assert tokens == reference, (
            f"{model_type}, prompt of {len(prompt)} tokens, served differs from model.generate\n"
            f"  server:   {tokens}\n  generate: {reference}"
        )


def test_a_refused_family_exits_before_serving_with_the_engines_reason(tmp_path):
    tiny_family_model("mamba").save_pretrained(tmp_path / "model")
    server = ServerProcess(tmp_path / "model", tmp_path / "server.log", *ENGINE_FLAGS)
    try:
        status = server.process.wait(timeout=STARTUP_TIMEOUT_S)
    finally:
        server.close()
    log = server.log_path.read_text(errors="replace")
    assert status != 0, log
    refusal = [line for line in log.splitlines() if "cannot serve MambaForCausalLM" in line]
    assert len(refusal) == 1, log
    assert "(model type 'mamba'): Mamba (selective state-space) layers" in refusal[0], refusal[0]
    assert "serving" not in log.replace("cannot serve", ""), log
