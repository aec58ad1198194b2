"""The SDK against a real in-process gRPC server with FAKE servicers (no engine)."""

from __future__ import annotations

import asyncio
import pathlib
import re
import time

import pytest
from cbserve_client import (
    AdminClient,
    AsyncClient,
    CancelledError,
    Client,
    DeadlineExceededError,
    InvalidArgumentError,
    NotFoundError,
    UnauthenticatedError,
)

from tests.helpers.sdk_fakes import ADMIN_TOKEN, FakeServer


def test_generate(fake_server: FakeServer) -> None:
    with Client(fake_server.target) as client:
        completion = client.generate("Hi", max_new_tokens=3, temperature=0.0, logprobs=True)
    assert completion.token_ids == [101, 102, 103]
    assert completion.text == "Hello wörld"
    assert completion.finish_reason == "eos"
    assert completion.usage is not None and completion.usage.generated_tokens == 3
    assert completion.weight_version == 1
    assert completion.logprobs is not None and len(completion.logprobs) == 3
    assert completion.logprobs[0].token_id == 101 and completion.logprobs[0].top[0].token_id == 7
    assert completion.timings is not None and completion.timings.queue_time_s == 0.25
    (sent,) = fake_server.recorder.added
    assert sent.text == "Hi" and sent.request_id == completion.request_id
    assert sent.sampling.HasField("temperature") and sent.sampling.temperature == 0.0
    assert not sent.sampling.HasField("top_k")


def test_generate_with_token_ids_and_chat(fake_server: FakeServer) -> None:
    with Client(fake_server.target) as client:
        client.generate([1, 2, 3], record_timestamps=True)
        client.generate([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    ids, chat = fake_server.recorder.added
    assert list(ids.token_ids.ids) == [1, 2, 3] and ids.record_timestamps
    assert chat.messages.messages[0].content == "Hi" and chat.messages.add_generation_prompt


def test_stream_yields_chunks_in_order(fake_server: FakeServer) -> None:
    with Client(fake_server.target) as client, client.stream("Hi", request_id="abc") as stream:
        chunks = list(stream)
    assert stream.request_id == "abc"
    assert [c.status for c in chunks] == ["queued", "decoding", "decoding", "finished"]
    assert [c.token_index for c in chunks[1:]] == [0, 1, 2]
    assert "".join(c.text or "" for c in chunks) == "Hello wörld"
    assert chunks[-1].finish_reason == "eos" and all(c.finish_reason is None for c in chunks[:-1])


def test_closing_a_stream_early_cancels_the_rpc(fake_server: FakeServer) -> None:
    with Client(fake_server.target) as client:
        stream = client.stream("slow")
        for i, _chunk in enumerate(stream):
            if i == 3:
                break
        stream.close()
        assert fake_server.recorder.stream_cancelled.wait(5), "the server did not see the cancellation"
        with pytest.raises(CancelledError):
            next(stream)


def test_rejected_request_raises(fake_server: FakeServer) -> None:
    with Client(fake_server.target) as client:
        with pytest.raises(InvalidArgumentError, match="max_new_tokens"):
            client.generate("reject")
        with pytest.raises(InvalidArgumentError):
            list(client.stream("reject"))


def test_request_failing_while_running_returns_an_error_completion(fake_server: FakeServer) -> None:
    with Client(fake_server.target) as client:
        completion = client.generate("crash")
    assert completion.finish_reason == "error"
    assert completion.error == "CUDA error: device-side assert"
    assert completion.token_ids == [101]


def test_submit_results_and_resume(fake_server: FakeServer) -> None:
    with Client(fake_server.target) as client:
        request_id = client.submit("Hi", max_new_tokens=3)
        assert fake_server.recorder.added[-1].request_id == request_id
        chunks = list(client.results(request_id))
        assert [t for c in chunks for t in c.token_ids] == [101, 102, 103]
        resumed = list(client.results(request_id, from_index=2))
        assert [(c.token_index, c.token_ids) for c in resumed] == [(2, (103,))]
        with pytest.raises(NotFoundError):
            list(client.results("nope"))
        # a caller-chosen id is kept as is
        assert client.submit([5, 6], request_id="mine") == "mine"


def test_cancel(fake_server: FakeServer) -> None:
    with Client(fake_server.target) as client:
        request_id = client.submit("Hi")
        assert client.cancel(request_id) is True
        assert client.cancel(request_id) is False  # idempotent
        with pytest.raises(NotFoundError):
            client.cancel("never-seen")
    assert fake_server.recorder.cancelled_ids == [request_id, request_id]


def test_model_info_and_client_token(fake_server: FakeServer) -> None:
    with Client(fake_server.target, token="user-token") as client:
        info = client.model_info()
    assert info.model_name == "tiny-llama" and info.vocab_size == 32000
    assert info.eos_token_ids == (2,) and info.has_tokenizer and info.has_chat_template
    assert fake_server.recorder.metadata[-1]["authorization"] == "Bearer user-token"


def test_trace_context_is_propagated(fake_server: FakeServer) -> None:
    from opentelemetry import trace

    context = trace.SpanContext(
        trace_id=0x0AF7651916CD43DD8448EB211C80319C,
        span_id=0xB7AD6B7169203331,
        is_remote=False,
        trace_flags=trace.TraceFlags(trace.TraceFlags.SAMPLED),
    )
    with Client(fake_server.target) as client:
        client.model_info()
        assert "traceparent" not in fake_server.recorder.metadata[-1]
        with trace.use_span(trace.NonRecordingSpan(context)):
            client.model_info()
    assert fake_server.recorder.metadata[-1]["traceparent"] == (
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    )


def test_async_client(fake_server: FakeServer) -> None:
    async def main() -> None:
        async with AsyncClient(fake_server.target, token="t") as client:
            completion = await client.generate("Hi")
            assert completion.text == "Hello wörld" and completion.finish_reason == "eos"
            chunks = [c async for c in client.stream([1, 2])]
            assert chunks[-1].finished and chunks[-1].token_index == 2
            request_id = await client.submit("Hi")
            resumed = [c async for c in client.results(request_id, from_index=1)]
            assert [c.token_ids for c in resumed] == [(102,), (103,)]
            assert await client.cancel(request_id) is True
            assert (await client.model_info()).max_context_length == 2048
            with pytest.raises(InvalidArgumentError):
                await client.generate("reject")
            with pytest.raises(NotFoundError):
                await client.cancel("nope")
            stream = client.stream("slow")
            async for chunk in stream:
                if chunk.token_ids:
                    break
            stream.cancel()
            with pytest.raises(CancelledError):
                await stream.__anext__()
        assert fake_server.recorder.metadata[-1]["authorization"] == "Bearer t"

    asyncio.run(main())
    assert fake_server.recorder.stream_cancelled.wait(5)


def test_admin_token_goes_over_the_wire(fake_server: FakeServer) -> None:
    with AdminClient(fake_server.target, ADMIN_TOKEN) as admin:
        status = admin.status()
        assert status.running and status.kv_blocks_total == 64 and status.preemptions == 2
        assert status.counters == {"spec_decode_accepted": 4.0}
        assert admin.start() is False  # already running
        assert admin.stop(hard=True).failed_requests == 3
    assert all(m["authorization"] == f"Bearer {ADMIN_TOKEN}" for m in fake_server.recorder.metadata)
    with AdminClient(fake_server.target, "wrong") as admin, pytest.raises(UnauthenticatedError):
        admin.status()
    with AdminClient(fake_server.target, None) as admin, pytest.raises(UnauthenticatedError):
        admin.status()


def test_admin_pause_is_held_while_the_block_runs(fake_server: FakeServer) -> None:
    rec = fake_server.recorder
    with AdminClient(fake_server.target, ADMIN_TOKEN) as admin:
        with admin.paused(mode="wait", lease_s=30) as info:
            assert info.paused and info.holders == 1
            time.sleep(0.2)
            assert not rec.pause_released.is_set()
        assert rec.pause_released.wait(5), "leaving the block did not release the pause"
    (request,) = rec.pause_requests
    assert request.lease_s == 30.0
    with (
        AdminClient(fake_server.target, "wrong") as admin,
        pytest.raises(UnauthenticatedError),
        admin.paused(),
    ):
        pass


def test_admin_pause_released_on_error_and_bounded_wait(fake_server: FakeServer) -> None:
    rec = fake_server.recorder
    with AdminClient(fake_server.target, ADMIN_TOKEN) as admin:
        with pytest.raises(RuntimeError, match="trainer crashed"), admin.paused():
            raise RuntimeError("trainer crashed")
        assert rec.pause_released.wait(5)
        rec.pause_released.clear()
        started = time.monotonic()
        with pytest.raises(DeadlineExceededError), admin.paused(lease_s=999, timeout=0.3):
            pass
        assert time.monotonic() - started < 5
        assert rec.pause_released.wait(5)


def test_admin_update_weights(fake_server: FakeServer) -> None:
    state = {
        "model.embed.weight": ("F32", (4, 8), bytes(range(128))),
        "lm_head.bias": ("BF16", (3,), b"\x01\x02\x03\x04\x05\x06"),
    }
    with AdminClient(fake_server.target, ADMIN_TOKEN) as admin:
        result = admin.update_weights(state, version="step-42", chunk_size=50)
        assert result.weight_version == 2 and result.tensors_updated == 2
        assert result.version_label == "step-42"
        received = fake_server.recorder.weights
        assert received["model.embed.weight"] == ("F32", (4, 8), bytes(range(128)))
        assert received["lm_head.bias"] == ("BF16", (3,), b"\x01\x02\x03\x04\x05\x06")
        admin.update_weights("/ckpt/model.safetensors")
        assert "/ckpt/model.safetensors" in received
        # a client-side failure while streaming surfaces as itself, not as a gRPC error
        with pytest.raises(ValueError, match="unsupported dtype"):
            admin.update_weights({"x": ("complex64", (1,), b"\x00" * 8)})


def test_readme_quick_start_runs_as_written(
    fake_server: FakeServer, capsys: pytest.CaptureFixture[str]
) -> None:
    readme = (pathlib.Path(__file__).resolve().parents[2] / "sdk" / "python" / "README.md").read_text()
    match = re.search(r"## Quick start.*?```python\n(.*?)```", readme, re.S)
    assert match, "README.md lost its quick start"
    code = match.group(1)
    assert "localhost:50051" in code
    exec(compile(code.replace("localhost:50051", fake_server.target), "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert "tiny-llama 1" in out and "Hello wörld eos" in out
