"""The decode fast path: cbserve's Triton kernel reading keys in place through block tables.

On the CPU the kernel runs under Triton's interpreter; with CBSERVE_TEST_DEVICE=cuda (bench/gpu_check.sh)
it is compiled and run on the GPU.
"""

from __future__ import annotations

import os

import pytest
import torch

from engine import ContinuousBatchingConfig
from tests.conftest import TEST_DEVICE, assert_greedy_parity, generate_greedy, random_prompt, tiny_model

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def kernel_module() -> object:
    """The kernel module: compiled on a GPU, interpreted on the CPU (tests/conftest.py sets
    TRITON_INTERPRET=1 before triton is first imported)."""
    if TEST_DEVICE.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.fail("on the CPU these tests need TRITON_INTERPRET=1 from tests/conftest.py")
    import engine.runner.paged_decode_kernel as module

    return module


def _reference(queries, key_cache, value_cache, tables, seq_lens, firsts, page_size, scale, softcap):
    """Per row and head: gather the row's keys by position, softmax in fp32."""
    num_rows, num_heads, _ = queries.shape
    group = num_heads // key_cache.shape[1]
    output = torch.empty_like(queries)
    for row in range(num_rows):
        positions = torch.arange(int(firsts[row]), int(seq_lens[row]), device=queries.device)
        slots = tables[row].long()[positions // page_size] * page_size + positions % page_size
        keys, values = key_cache[slots].float(), value_cache[slots].float()
        for head in range(num_heads):
            scores = keys[:, head // group] @ queries[row, head].float() * scale
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            output[row, head] = (torch.softmax(scores, 0) @ values[:, head // group]).to(queries.dtype)
    return output


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "page_size", "softcap", "sliding"),
    [
        (4, 4, 16, 4, None, False),  # no grouping, pages smaller than a tile
        (8, 2, 64, 16, None, False),  # 4 query heads per KV head
        (6, 2, 24, 16, None, True),  # head_dim not a power of two; rows start mid-context
        (4, 2, 16, 8, 50.0, True),  # Gemma 2's softcapping
        (4, 2, 32, 64, None, False),  # pages larger than a tile
    ],
)
def test_kernel_matches_a_gathered_softmax(
    kernel_module, num_heads, num_kv_heads, head_dim, page_size, softcap, sliding
) -> None:
    generator = torch.Generator().manual_seed(num_heads * 1000 + head_dim + page_size)
    num_blocks, num_rows = 48, 5
    key_cache = torch.randn(num_blocks * page_size, num_kv_heads, head_dim, generator=generator)
    value_cache = torch.randn(num_blocks * page_size, num_kv_heads, head_dim, generator=generator)
    seq_lens = torch.tensor([1, 7, 33, 64, 150])[:num_rows]
    firsts = torch.tensor([0, 3, 10, 0, 120]) if sliding else torch.zeros(num_rows, dtype=torch.long)
    width = -(-int(seq_lens.max()) // page_size) + 2  # wider than needed: padding entries are never read
    tables = torch.stack(
        [torch.randperm(num_blocks - 1, generator=generator)[:width] + 1 for _ in range(num_rows)]
    )
    queries = torch.randn(num_rows, num_heads, head_dim, generator=generator)
    scale = head_dim**-0.5
    tensors = [queries, key_cache, value_cache, tables.int(), seq_lens.int(), firsts.int()]
    device_tensors = [tensor.to(TEST_DEVICE) for tensor in tensors]
    output = kernel_module.paged_decode_attention(*device_tensors, page_size, scale, softcap)
    expected = _reference(*device_tensors, page_size, scale, softcap)
    torch.testing.assert_close(output, expected, atol=2e-5, rtol=2e-5)


PROMPT_LENGTHS = (5, 9, 16, 17, 40, 90)
NEW_TOKENS = (30, 9, 33, 12, 25, 18)


def _generate_counting_kernel_calls(kernel_module, monkeypatch, model, config):
    calls = []
    original = kernel_module.paged_decode_attention

    def counting(*args, **kwargs):
        calls.append(args[0].shape[0])
        return original(*args, **kwargs)

    monkeypatch.setattr(kernel_module, "paged_decode_attention", counting)
    prompts = [random_prompt(length, seed=700 + length) for length in PROMPT_LENGTHS]
    generated, _ = generate_greedy(model, config, prompts, NEW_TOKENS)
    assert_greedy_parity(model, prompts, NEW_TOKENS, generated, "decode fast path")
    return calls


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral", "gemma2"])
def test_decode_fast_path_keeps_parity(kernel_module, monkeypatch, family: str) -> None:
    """Full, sliding (Mistral) and hybrid (Gemma 2: both groups, softcapping) attention."""
    config = ContinuousBatchingConfig(
        page_size=8, num_blocks=160, max_batch_tokens=48, max_blocks_per_request=32
    )
    calls = _generate_counting_kernel_calls(kernel_module, monkeypatch, tiny_model(family), config)
    assert calls, "no decode step used the fast path"


def test_requests_wider_than_max_blocks_per_request_gather_instead(kernel_module, monkeypatch) -> None:
    # Every prompt spans at least two 4-token pages, more than the one block the fast path may read.
    config = ContinuousBatchingConfig(
        page_size=4, num_blocks=400, max_batch_tokens=48, max_blocks_per_request=1
    )
    calls = _generate_counting_kernel_calls(kernel_module, monkeypatch, tiny_model("llama"), config)
    assert calls == []


@pytest.mark.skipif(TEST_DEVICE.type == "cuda", reason="checks the warning on a device without CUDA")
def test_fast_path_asked_for_on_the_cpu_without_the_interpreter_warns(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from engine.runner.forward_paths import load_decode_kernel

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with caplog.at_level("WARNING", logger="engine.runner.forward_paths"):
        kernel = load_decode_kernel(ContinuousBatchingConfig(max_blocks_per_request=16), torch.device("cpu"))
    assert kernel is None
    assert "the decode fast path needs CUDA" in caplog.text
    assert load_decode_kernel(ContinuousBatchingConfig(), torch.device("cpu")) is None
