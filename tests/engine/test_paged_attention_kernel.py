"""The kernel path: a kernel reading keys in place through block tables, for decode-only steps and steps
with prefill chunks alike. Every test runs for both kernels: cbserve's Triton kernel and its C kernel
for the CPU (engine.runner.paged_attention_cpu).

On the CPU the Triton kernel runs under Triton's interpreter; with CBSERVE_TEST_DEVICE=cuda
(bench/gpu_check.sh) it is compiled and run on the GPU, and the CPU kernel's cases are skipped.
"""

from __future__ import annotations

import os

import pytest
import torch

from engine import ContinuousBatchingConfig
from engine.runner.attention import PREFILL_QUERIES_PER_TILE
from tests.helpers.engine_runs import engine_core, generate_greedy, run_greedy
from tests.helpers.models import TEST_DEVICE, random_prompt, tiny_model
from tests.helpers.oracle import assert_greedy_parity

pytest.importorskip("triton")


@pytest.fixture(params=["triton", "cpu"])
def kernel_module(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> object:
    """The kernel's module. Triton's is compiled on a GPU and interpreted on the CPU (tests/conftest.py
    sets TRITON_INTERPRET=1 before triton is first imported); the CPU kernel is chosen for a positive
    max_blocks_per_request once the interpreter is off."""
    if request.param == "cpu":
        if TEST_DEVICE.type != "cpu":
            pytest.skip("the C kernel serves CPU tensors; this run is on " + TEST_DEVICE.type)
        from engine.runner import paged_attention_cpu

        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        if paged_attention_cpu.load(torch.float32) is None:
            pytest.fail("the CPU attention kernel did not build (is a C compiler installed? see the log)")
        return paged_attention_cpu
    if TEST_DEVICE.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.fail("on the CPU these tests need TRITON_INTERPRET=1 from tests/conftest.py")
    import engine.runner.paged_attention_kernel as module

    return module


def _reference(
    queries,
    key_cache,
    value_cache,
    tables,
    query_starts,
    seq_lens,
    page_size,
    scale,
    softcap,
    window,
    sinks=None,
    chunk=None,
    alibi_slopes=None,
):
    """Per request, query and head: gather the keys the query may see by position, softmax in fp32 (with
    the head's sink as one more score whose value is zero, as gpt-oss's eager attention computes it, and
    ALiBi's bias as Bloom adds it, slope * key position)."""
    num_heads = queries.shape[1]
    group = num_heads // key_cache.shape[1]
    output = torch.zeros_like(queries)
    for request in range(seq_lens.shape[0]):
        first_row, end_row = int(query_starts[request]), int(query_starts[request + 1])
        context = int(seq_lens[request]) - (end_row - first_row)
        for index, row in enumerate(range(first_row, end_row)):
            position = context + index
            first = 0 if window is None else max(0, position - window + 1)
            if chunk is not None:
                first = max(first, position - position % chunk)
            positions = torch.arange(first, position + 1, device=queries.device)
            slots = tables[request].long()[positions // page_size] * page_size + positions % page_size
            keys, values = key_cache[slots].float(), value_cache[slots].float()
            for head in range(num_heads):
                scores = keys[:, head // group] @ queries[row, head].float() * scale
                if softcap is not None:
                    scores = torch.tanh(scores / softcap) * softcap
                if alibi_slopes is not None:
                    scores = scores + alibi_slopes[head].float() * positions.float()
                if sinks is not None:
                    probabilities = torch.softmax(torch.cat([scores, sinks[head : head + 1].float()]), 0)[:-1]
                else:
                    probabilities = torch.softmax(scores, 0)
                attended = probabilities @ values[:, head // group]
                output[row, head] = attended.to(queries.dtype)
    return output


# (context, new queries) of each request: decode rows, a prompt's first chunk, later chunks of long
# prompts, chunks longer than a tile and shorter than one.
MIXED_STEP = [(10, 1), (0, 37), (40, 5), (70, 1), (3, 20), (150, 16)]
DECODE_STEP = [(0, 1), (6, 1), (32, 1), (63, 1), (149, 1)]
# One request alone, on 4 threads: fewer tiles than threads and more keys than MIN_KEYS_TO_SPLIT, so the
# CPU kernel splits each tile's keys into parts (4 for the decode tile, 2 for each of the prefill chunk's
# tiles) and merges them.
STEPS = {
    "mixed": (MIXED_STEP, PREFILL_QUERIES_PER_TILE, 2),
    "decode": (DECODE_STEP, 1, 2),
    "one_decode": ([(149, 1)], 1, 4),
    "one_prefill": ([(150, 20)], PREFILL_QUERIES_PER_TILE, 4),
}


ATTENTION_SHAPES = pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "page_size", "softcap", "window"),
    [
        (4, 4, 16, 4, None, None),  # no grouping, pages smaller than a key tile
        (8, 2, 64, 16, None, None),  # 4 query heads per KV head
        (6, 2, 24, 16, None, 10),  # head_dim not a power of two; windows shorter than a chunk
        (4, 2, 16, 8, 50.0, 24),  # Gemma 2's softcapping with its sliding window
        (4, 2, 32, 64, None, None),  # pages larger than a key tile
        (4, 2, 18, 16, None, None),  # head_dim not a multiple of the CPU kernel's vector or partial sums
    ],
)


@ATTENTION_SHAPES
@pytest.mark.parametrize("step", ["mixed", "decode"])
def test_kernel_matches_a_gathered_softmax(
    kernel_module, step, num_heads, num_kv_heads, head_dim, page_size, softcap, window, monkeypatch
) -> None:
    _check_against_a_gathered_softmax(
        kernel_module, step, num_heads, num_kv_heads, head_dim, page_size, softcap, window, monkeypatch
    )


@ATTENTION_SHAPES
@pytest.mark.parametrize("step", ["one_decode", "one_prefill"])
def test_the_cpu_kernel_splitting_a_lone_tiles_keys_matches_a_gathered_softmax(
    step, num_heads, num_kv_heads, head_dim, page_size, softcap, window, monkeypatch
) -> None:
    """The C kernel's split over threads (the Triton kernel has none), on CPU tensors whatever the run's
    test device."""
    from engine.runner import paged_attention_cpu

    _check_against_a_gathered_softmax(
        paged_attention_cpu, step, num_heads, num_kv_heads, head_dim, page_size, softcap, window, monkeypatch,
        device=torch.device("cpu"),
    )  # fmt: skip


def _check_against_a_gathered_softmax(
    kernel_module, step, num_heads, num_kv_heads, head_dim, page_size, softcap, window, monkeypatch,
    device=TEST_DEVICE, with_sinks=False, chunk=None, alibi_slopes=None,
) -> None:  # fmt: skip
    generator = torch.Generator().manual_seed(num_heads * 1000 + head_dim + page_size)
    shape, queries_per_tile, threads = STEPS[step]
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    seq_lens = torch.tensor([context + count for context, count in shape])
    counts = [count for _, count in shape]
    query_starts = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()])
    num_blocks = 64
    key_cache = torch.randn(num_blocks * page_size, num_kv_heads, head_dim, generator=generator)
    value_cache = torch.randn(num_blocks * page_size, num_kv_heads, head_dim, generator=generator)
    width = -(-int(seq_lens.max()) // page_size) + 2  # wider than needed: padding entries are never read
    tables = torch.stack([torch.randperm(num_blocks - 1, generator=generator)[:width] + 1 for _ in shape])
    tile_requests, tile_offsets = [], []
    for request, count in enumerate(counts):
        for offset in range(0, count, queries_per_tile):
            tile_requests.append(request)
            tile_offsets.append(offset)
    # Two padding tiles, and three packed rows no request owns (a padded step's shape): both stay zero.
    # (A single request keeps its tiles alone.)
    if len(shape) > 1:
        tile_requests += [-1, -1]
        tile_offsets += [0, 0]
    num_rows = int(query_starts[-1]) + 3
    queries = torch.randn(num_rows, num_heads, head_dim, generator=generator)
    scale = head_dim**-0.5
    tensors = [queries, key_cache, value_cache, tables.int(), query_starts.int(), seq_lens.int()]
    device_tensors = [tensor.to(device) for tensor in tensors]
    tiles = [
        torch.tensor(values, dtype=torch.int32, device=device) for values in (tile_requests, tile_offsets)
    ]
    # Sinks from -1 to 3: against scores of about unit size, each takes a real share of the mass.
    sinks = (torch.rand(num_heads, generator=generator) * 4 - 1).to(device) if with_sinks else None
    output = kernel_module.paged_attention(
        *device_tensors, *tiles, queries_per_tile, page_size, scale, softcap, window, has_unowned_rows=True,
        sinks=sinks, attention_chunk=chunk, alibi_slopes=alibi_slopes,
    )  # fmt: skip
    expected = _reference(*device_tensors, page_size, scale, softcap, window, sinks, chunk, alibi_slopes)
    torch.testing.assert_close(output, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("step", ["mixed", "decode"])
@pytest.mark.parametrize("window", [None, 10], ids=["full", "sliding"])
def test_kernel_with_attention_sinks_matches_a_softmax_with_a_sink_column(
    kernel_module, step, window, monkeypatch
):
    """gpt-oss: a learned logit per query head in every softmax, with grouped heads and its sliding layers."""
    _check_against_a_gathered_softmax(
        kernel_module, step, 8, 2, 16, 8, None, window, monkeypatch, with_sinks=True
    )


@pytest.mark.parametrize("step", ["mixed", "decode"])
@pytest.mark.parametrize("chunk", [8, 48], ids=["chunk-8", "chunk-48"])
def test_kernel_with_chunked_attention_matches_a_softmax_over_each_querys_chunk(
    kernel_module, step, chunk, monkeypatch
):
    """Llama 4's chunked layers: a query sees its own chunk's keys only, chunks shorter and longer than a
    tile or a page."""
    _check_against_a_gathered_softmax(kernel_module, step, 8, 2, 16, 8, None, None, monkeypatch, chunk=chunk)


# Bloom's slopes for 8 heads (2^-1 .. 2^-8) and for 6, not a power of two (4 from 2^-2, 2 between them).
ALIBI_SLOPES = {
    8: torch.tensor([2.0**-power for power in range(1, 9)]),
    6: torch.tensor([2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8, 2.0**-1, 2.0**-3]),
}


@pytest.mark.parametrize("step", ["mixed", "decode"])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"), [(8, 2, 16), (6, 6, 24)], ids=["grouped", "six_heads"]
)
def test_kernel_with_alibi_matches_a_softmax_with_the_models_position_bias(
    kernel_module, step, num_heads, num_kv_heads, head_dim, monkeypatch
):
    """Bloom, MPT, Falcon's ALiBi: the kernel adds slope * (key - query position), the softmax of which is
    the model's with slope * key position, over contexts long enough (150 keys) that the bias decides
    which keys count."""
    _check_against_a_gathered_softmax(
        kernel_module, step, num_heads, num_kv_heads, head_dim, 8, None, None, monkeypatch,
        alibi_slopes=ALIBI_SLOPES[num_heads].to(TEST_DEVICE),
    )  # fmt: skip


@pytest.mark.parametrize("step", ["one_decode", "one_prefill"])
def test_the_cpu_kernel_with_alibi_splitting_a_tiles_keys_matches_a_gathered_softmax(step, monkeypatch):
    """Each part of a split tile adds the bias of its own keys' positions."""
    from engine.runner import paged_attention_cpu

    _check_against_a_gathered_softmax(
        paged_attention_cpu, step, 8, 2, 16, 8, None, None, monkeypatch, device=torch.device("cpu"),
        alibi_slopes=ALIBI_SLOPES[8],
    )  # fmt: skip


@pytest.mark.parametrize("step", ["one_decode", "one_prefill"])
def test_the_cpu_kernel_adds_sinks_once_when_it_splits_a_tiles_keys(step, monkeypatch):
    """The split tile's parts merge before the sink is added: added per part, it would count several times."""
    from engine.runner import paged_attention_cpu

    _check_against_a_gathered_softmax(
        paged_attention_cpu,
        step,
        8,
        2,
        16,
        8,
        None,
        None,
        monkeypatch,
        device=torch.device("cpu"),
        with_sinks=True,
    )


PROMPT_LENGTHS = (5, 9, 16, 17, 40, 90)
NEW_TOKENS = (30, 9, 33, 12, 25, 18)


def _generate_counting_kernel_calls(kernel_module, monkeypatch, model, config, prompts=None):
    """Greedy generation asserted equal to model.generate; returns the queries-per-tile of every kernel
    call (1: a decode-only step, more: a step with prefill chunks)."""
    calls = []
    original = kernel_module.paged_attention

    def counting(*args, **kwargs):
        calls.append(args[8])
        return original(*args, **kwargs)

    monkeypatch.setattr(kernel_module, "paged_attention", counting)
    if prompts is None:
        prompts = [random_prompt(length, seed=700 + length) for length in PROMPT_LENGTHS]
    new_tokens = NEW_TOKENS[: len(prompts)]
    generated, _ = generate_greedy(model, config, prompts, new_tokens)
    assert_greedy_parity(model, prompts, new_tokens, generated, "kernel path")
    return calls


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral", "gemma2"])
def test_kernel_path_keeps_parity(kernel_module, monkeypatch, family: str) -> None:
    """Full, sliding (Mistral) and hybrid (Gemma 2: both groups, softcapping) attention; a 48-token budget
    chunks the long prompts, so steps mix chunks with decode rows."""
    config = ContinuousBatchingConfig(
        page_size=8, num_blocks=160, max_batch_tokens=48, max_blocks_per_request=32
    )
    calls = _generate_counting_kernel_calls(kernel_module, monkeypatch, tiny_model(family), config)
    assert 1 in calls, "no decode-only step used the kernel"
    assert any(tile > 1 for tile in calls), "no step with prefill chunks used the kernel"


def test_requests_sharing_a_prefix_in_one_step_read_blocks_that_step_writes(
    kernel_module, monkeypatch
) -> None:
    """Prefix caching: every layer writes all new keys before the kernel reads any, so requests admitted
    together may share the prefix blocks they fill."""
    shared = random_prompt(24, seed=5)
    prompts = [shared + random_prompt(length, seed=50 + length) for length in (3, 8, 13)]
    config = ContinuousBatchingConfig(
        page_size=8, num_blocks=160, max_batch_tokens=256, max_blocks_per_request=32, allow_block_sharing=True
    )
    calls = _generate_counting_kernel_calls(kernel_module, monkeypatch, tiny_model("llama"), config, prompts)
    assert any(tile > 1 for tile in calls)


# Below the 48-token budget of the test below, so that some of its steps are too large to pad.
MAX_PADDED_TOKENS = 40


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2"])
def test_padded_steps_with_prefill_chunks_keep_parity(kernel_module, family: str) -> None:
    """The shapes varlen CUDA graphs replay, run eagerly: padding tokens that belong to no request,
    padding requests that own no tokens, tables max_blocks_per_request wide, padding tiles, and logits
    rows that are never sampled must leave every real row as it was."""
    from engine import init_continuous_batching
    from engine.runner.padding import Padding

    model = tiny_model(family)
    config = ContinuousBatchingConfig(
        page_size=8, num_blocks=160, max_batch_tokens=48, max_blocks_per_request=32
    )
    # 48-token steps while the long prompt is chunked (too large to pad), then its last chunk of 22 with
    # three decode rows (25 tokens, padded to 32).
    prompts = [random_prompt(length, seed=700 + length) for length in (3, 12, 30, 70)]
    new_tokens = NEW_TOKENS[: len(prompts)]
    manager = init_continuous_batching(model, continuous_batching_config=config)
    try:
        runner = engine_core(manager).runner
        runner.forward_paths.padding = Padding(
            4, 16, 16, decode=False, varlen=True, varlen_max_tokens=MAX_PADDED_TOKENS
        )
        padded_steps = []
        original_forward = runner.forward

        def forward(inputs):
            if not inputs.is_decode_only:
                num_tokens = inputs.input_ids.shape[1] - inputs.num_padding_rows
                padded_steps.append((num_tokens, inputs.is_padded, inputs.num_padding_rows))
            return original_forward(inputs)

        runner.forward = forward
        manager.start()
        generated = run_greedy(manager, prompts, new_tokens)
    finally:
        manager.destroy()
    # Steps of up to MAX_PADDED_TOKENS tokens are padded, larger ones (up to the 48-token budget) are not.
    assert all(is_padded == (tokens <= MAX_PADDED_TOKENS) for tokens, is_padded, _ in padded_steps), (
        padded_steps
    )
    assert any(padding > 0 for _, _, padding in padded_steps), "no step needed padding"
    assert any(not is_padded for _, is_padded, _ in padded_steps), "no step was too large to pad"
    assert_greedy_parity(model, prompts, new_tokens, generated, f"{family}, padded varlen steps")


def test_requests_wider_than_max_blocks_per_request_gather_instead(kernel_module, monkeypatch) -> None:
    # Every prompt spans at least two 4-token pages, more than the one block the kernel may read.
    config = ContinuousBatchingConfig(
        page_size=4, num_blocks=400, max_batch_tokens=48, max_blocks_per_request=1
    )
    calls = _generate_counting_kernel_calls(kernel_module, monkeypatch, tiny_model("llama"), config)
    assert calls == []


def test_triton_kernel_runs_on_the_cpu_only_interpreted_and_asked_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without the interpreter, or without a positive width, the CPU gets its C kernel instead (see
    tests/engine/test_paged_attention_cpu.py); width 0 turns every kernel off."""
    from engine.runner import paged_attention_cpu
    from engine.runner.forward_paths import load_attention_kernel
    from engine.runner.paged_attention_kernel import paged_attention

    cpu = torch.device("cpu")
    asked = ContinuousBatchingConfig(max_blocks_per_request=16)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert load_attention_kernel(asked, cpu, torch.float32) == (paged_attention, 16)
    assert load_attention_kernel(ContinuousBatchingConfig(max_blocks_per_request=0), cpu, torch.float32) == (
        None,
        0,
    )
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert load_attention_kernel(asked, cpu, torch.float32) == (paged_attention_cpu.paged_attention, 16)
