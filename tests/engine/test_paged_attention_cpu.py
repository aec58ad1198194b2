"""The CPU's C attention kernel: what the shared kernel tests (test_paged_attention_kernel.py) do not cover,
namely bf16 caches, being the CPU's default, and the fallback to the gather path when it cannot be built."""

from __future__ import annotations

import logging

import pytest
import torch

from engine import ContinuousBatchingConfig
from engine.runner import paged_attention_cpu
from engine.system import native_library
from tests.helpers.engine_runs import generate_greedy
from tests.helpers.models import TEST_DEVICE, random_prompt, tiny_model
from tests.helpers.oracle import assert_greedy_parity

# The tests that go through the engine need its test models on the CPU, where the C kernel serves them;
# the kernel's own tests take CPU tensors on any machine.
ENGINE_ON_THE_CPU = pytest.mark.skipif(
    TEST_DEVICE.type != "cpu", reason=f"the engine serves the test models on {TEST_DEVICE.type}"
)

PROMPT_LENGTHS = (3, 17, 40, 90)
NEW_TOKENS = (12, 20, 7, 16)


@pytest.fixture
def compiled(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel, built once for the session; the Triton interpreter off, so the CPU takes its C kernel."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if paged_attention_cpu.load(torch.float32) is None:
        pytest.fail("the CPU attention kernel did not build (is a C compiler installed? see the log)")


def _generate(monkeypatch: pytest.MonkeyPatch, config: ContinuousBatchingConfig) -> list[int]:
    """Greedy generation asserted equal to model.generate; returns queries-per-tile of each kernel call."""
    calls: list[int] = []
    original = paged_attention_cpu.paged_attention

    def counting(*args, **kwargs):
        calls.append(args[8])
        return original(*args, **kwargs)

    monkeypatch.setattr(paged_attention_cpu, "paged_attention", counting)
    model = tiny_model("llama")
    prompts = [random_prompt(length, seed=900 + length) for length in PROMPT_LENGTHS]
    generated, _ = generate_greedy(model, config, prompts, NEW_TOKENS)
    assert_greedy_parity(model, prompts, NEW_TOKENS, generated, "CPU attention")
    return calls


@ENGINE_ON_THE_CPU
def test_the_cpu_attends_through_the_kernel_by_default(compiled, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _generate(monkeypatch, ContinuousBatchingConfig(page_size=8, num_blocks=64))
    assert 1 in calls, "no decode-only step ran the kernel"
    assert any(queries > 1 for queries in calls), "no step with prefill chunks ran the kernel"


@ENGINE_ON_THE_CPU
def test_max_blocks_per_request_zero_keeps_the_gather_path(compiled, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _generate(
        monkeypatch, ContinuousBatchingConfig(page_size=8, num_blocks=64, max_blocks_per_request=0)
    )
    assert calls == []


@ENGINE_ON_THE_CPU
def test_without_a_compiler_steps_gather_and_say_why(
    compiled, monkeypatch: pytest.MonkeyPatch, tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(native_library, "_loaded", {})
    monkeypatch.setenv("CBSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler")
    with caplog.at_level(logging.WARNING, logger="engine.runner.paged_attention_cpu"):
        calls = _generate(monkeypatch, ContinuousBatchingConfig(page_size=8, num_blocks=64))
    assert calls == []
    assert "the CPU attention kernel is unavailable (no C compiler: 'no-such-compiler'" in caplog.text
    assert not (tmp_path / "kernels").exists() or not any((tmp_path / "kernels").iterdir())


def test_a_fresh_cache_builds_the_library_once(compiled, monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setattr(native_library, "_loaded", {})
    monkeypatch.setenv("CBSERVE_CACHE_DIR", str(tmp_path))
    assert paged_attention_cpu.load(torch.bfloat16) is not None
    built = list((tmp_path / "kernels").iterdir())
    assert [path.suffix for path in built] == [".so"], built  # no partial file left behind
    modified = built[0].stat().st_mtime_ns
    monkeypatch.setattr(native_library, "_loaded", {})
    assert paged_attention_cpu.load(torch.float32) is not None
    assert list((tmp_path / "kernels").iterdir()) == built
    assert built[0].stat().st_mtime_ns == modified


def test_half_precision_caches_gather(compiled, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="engine.runner.paged_attention_cpu"):
        assert paged_attention_cpu.load(torch.float16) is None
    assert "takes float32 and bfloat16, not torch.float16" in caplog.text


@pytest.mark.parametrize("step", ["mixed", "decode"])
def test_bfloat16_caches_match_an_fp32_softmax_of_the_same_values(compiled, step) -> None:
    """bf16 in, bf16 out; scores, softmax and sums in fp32, so the result is the fp32 one rounded once."""
    generator = torch.Generator().manual_seed(7)
    shape = [(10, 1), (0, 37), (40, 5), (150, 16)] if step == "mixed" else [(0, 1), (33, 1), (149, 1)]
    queries_per_tile = 16 if step == "mixed" else 1
    num_heads, num_kv_heads, head_dim, page_size, num_blocks = 6, 2, 40, 8, 64
    counts = [count for _, count in shape]
    seq_lens = torch.tensor([context + count for context, count in shape], dtype=torch.int32)
    query_starts = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    width = -(-int(seq_lens.max()) // page_size)
    tables = torch.stack(
        [torch.randperm(num_blocks - 1, generator=generator)[:width] + 1 for _ in shape]
    ).int()
    tile_requests, tile_offsets = [], []
    for request, count in enumerate(counts):
        offsets = range(0, count, queries_per_tile)
        tile_requests += [request] * len(offsets)
        tile_offsets += list(offsets)
    tiles = [torch.tensor(values, dtype=torch.int32) for values in (tile_requests, tile_offsets)]
    caches = [
        torch.randn(num_blocks * page_size, num_kv_heads, head_dim, generator=generator).bfloat16()
        for _ in range(2)
    ]
    queries = torch.randn(int(query_starts[-1]), num_heads, head_dim, generator=generator).bfloat16()
    scale = head_dim**-0.5

    def attend(*tensors: torch.Tensor) -> torch.Tensor:
        return paged_attention_cpu.paged_attention(
            *tensors, tables, query_starts, seq_lens, *tiles, queries_per_tile, page_size, scale, None, None
        )

    output = attend(queries, *caches)
    assert output.dtype == torch.bfloat16
    expected = attend(queries.float(), *(cache.float() for cache in caches))
    torch.testing.assert_close(output.float(), expected, atol=1e-2, rtol=1e-2)


def _one_sequence_three_ways(fixed_order: bool, sliding_window: int | None) -> dict[str, torch.Tensor]:
    """One 100-token sequence's attention (9 heads over 3 KV heads, as SmolLM2) computed as one prefill
    chunk, as two chunks split at 37, and one query at a time in decode tiles."""
    generator = torch.Generator().manual_seed(3)
    length, page_size, num_heads, num_kv_heads, head_dim = 100, 16, 9, 3, 64
    num_pages = -(-length // page_size)
    keys = torch.randn(num_pages * page_size, num_kv_heads, head_dim, generator=generator)
    values = torch.randn(num_pages * page_size, num_kv_heads, head_dim, generator=generator)
    queries = torch.randn(length, num_heads, head_dim, generator=generator)
    table = torch.arange(num_pages, dtype=torch.int32).unsqueeze(0)

    def chunk(start: int, end: int, queries_per_tile: int) -> torch.Tensor:
        tiles = list(range(0, end - start, queries_per_tile))
        return paged_attention_cpu.attend_in_place(
            queries[start:end].contiguous(),
            keys,
            values,
            table,
            torch.tensor([0, end - start], dtype=torch.int32),
            torch.tensor([end], dtype=torch.int32),
            torch.zeros(len(tiles), dtype=torch.int32),
            torch.tensor(tiles, dtype=torch.int32),
            queries_per_tile,
            page_size,
            head_dim**-0.5,
            None,
            sliding_window,
            fixed_order=fixed_order,
        )

    return {
        "one chunk": chunk(0, length, 16),
        "two chunks": torch.cat([chunk(0, 37, 16), chunk(37, length, 16)]),
        "decode tiles": torch.cat([chunk(position, position + 1, 1) for position in range(length)]),
    }


@pytest.mark.parametrize("sliding_window", [None, 24], ids=["full", "sliding"])
def test_fixed_order_gives_each_query_the_same_bits_whatever_tile_serves_it(compiled, sliding_window) -> None:
    """Batch-invariant mode (engine.runner.batch_invariant): the split of a sequence into chunks and tiles
    does not change a query's bits; without `fixed_order`, a decode tile rounds differently (the control)."""
    fixed = _one_sequence_three_ways(True, sliding_window)
    for name in ("two chunks", "decode tiles"):
        difference = (fixed[name] - fixed["one chunk"]).abs().max().item()
        assert torch.equal(fixed[name], fixed["one chunk"]), f"{name}: differs by up to {difference:.3g}"
    default = _one_sequence_three_ways(False, sliding_window)
    assert not torch.equal(default["decode tiles"], default["one chunk"])
    torch.testing.assert_close(fixed["one chunk"], default["one chunk"])
