"""The embedded SmolLM2 through the gateway, as the README's gateway block runs it."""

from __future__ import annotations

from pathlib import Path

import openai

from tests.helpers.gateway import Gateway
from tests.helpers.servers import ServerProcess


def test_the_embedded_model_answers_a_chat_through_the_gateway(
    embedded_model_dir: str, tmp_path: Path
) -> None:
    replica = ServerProcess(embedded_model_dir, tmp_path / "replica.log")
    gateway: Gateway | None = None
    try:
        replica.wait_serving()
        gateway = Gateway([replica.target], tmp_path / "smg.log")
        gateway.wait_ready()
        client = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="unused", timeout=120)
        (model,) = client.models.list().data
        response = client.chat.completions.create(
            model=model.id,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=20,
            temperature=0,
        )
        answer = response.choices[0].message.content or ""
        assert "Paris" in answer, answer
        assert response.choices[0].finish_reason == "stop"
    finally:
        if gateway is not None:
            gateway.stop()
        replica.close()
