"""Parallel sampling (n > 1): one prompt computed once, n sequences forked from its KV blocks.

Each sequence must equal what a single request would produce (greedy: `model.generate`; seeded sampling:
a single request with the sequence's derived seed), its outputs come under its own id with its index, and
the prompt's full blocks are held once however many sequences share them.
"""

from __future__ import annotations

import pytest

from engine import ContinuousBatchingConfig, ContinuousBatchingManager, RequestStatus, generate_batch
from engine.engine_core import EngineCore
from engine.request import Request, sequence_request_id
from engine.sampling.params import MAX_SEED, SamplingParams, sequence_seed
from tests.helpers.engine_runs import engine_core
from tests.helpers.models import random_prompt, tiny_model
from tests.helpers.oracle import reference_greedy

FAMILIES = ("llama", "qwen3", "mistral", "gemma2")


def _config(**overrides: object) -> ContinuousBatchingConfig:
    settings: dict[str, object] = dict(
        page_size=8, num_blocks=256, max_batch_tokens=64, max_requests_per_batch=16
    )
    settings.update(overrides)
    return ContinuousBatchingConfig(**settings)  # type: ignore[arg-type]


def _run(
    manager: ContinuousBatchingManager, prompt: list[int], n: int, **sampling: object
) -> dict[int, object]:
    """Every sequence's final output, by index."""
    request_id = manager.add_request(prompt, eos_token_id=[], num_return_sequences=n, **sampling)
    assert request_id is not None
    outputs = {}
    for index in range(n):
        output = manager.get_result(sequence_request_id(request_id, index), timeout=120)
        while output is not None and not output.is_finished():
            output = manager.get_result(sequence_request_id(request_id, index), timeout=120)
        assert output is not None, f"sequence {index} never finished"
        outputs[index] = output
    return outputs


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("prompt_length", [1, 8, 19])
def test_greedy_sequences_each_equal_generate(family: str, prompt_length: int) -> None:
    """Greedy, every sequence is `model.generate`'s output, whatever the prompt's alignment to pages
    (a whole page, a partial last page, a single token) and the attention (full, sliding, hybrid)."""
    model = tiny_model(family)
    prompt = random_prompt(prompt_length, seed=prompt_length)
    manager = ContinuousBatchingManager(model, continuous_batching_config=_config())
    manager.start()
    try:
        outputs = _run(manager, prompt, n=4, max_new_tokens=12)
        stats = manager.stats()
    finally:
        manager.destroy()
    expected = reference_greedy(model, prompt, 12)
    for index, output in outputs.items():
        assert output.status == RequestStatus.FINISHED and output.index == index
        assert output.generated_tokens == expected, (
            f"{family}, sequence {index} of a {prompt_length}-token prompt differs from model.generate\n"
            f"  engine:   {output.generated_tokens}\n  generate: {expected}"
        )
    assert stats.forked_sequences == 3


def test_each_seeded_sequence_equals_a_single_request_with_its_derived_seed() -> None:
    model = tiny_model("llama")
    prompt = random_prompt(21, seed=5)
    sampling = dict(max_new_tokens=16, temperature=1.0, top_k=50, seed=1234)
    manager = ContinuousBatchingManager(model, continuous_batching_config=_config())
    manager.start()
    try:
        together = _run(manager, prompt, n=4, **sampling)
        alone = {
            index: _run(manager, prompt, n=1, **{**sampling, "seed": sequence_seed(1234, index)})[0]
            for index in range(4)
        }
    finally:
        manager.destroy()
    for index in range(4):
        assert together[index].generated_tokens == alone[index].generated_tokens, (
            f"sequence {index} (seed {sequence_seed(1234, index)}) differs from a single request\n"
            f"  n=4:   {together[index].generated_tokens}\n  alone: {alone[index].generated_tokens}"
        )
    distinct = {tuple(output.generated_tokens) for output in together.values()}
    assert len(distinct) > 1, "different seeds should (overwhelmingly likely) sample differently"


def test_derived_seeds_stay_in_torch_range() -> None:
    assert sequence_seed(7, 0) == 7 and sequence_seed(7, 3) == 10
    assert sequence_seed(None, 2) is None
    assert sequence_seed(MAX_SEED, 1) == -(2**64) + MAX_SEED + 1


def test_a_thousand_token_prompt_holds_its_blocks_once_for_eight_sequences() -> None:
    page_size = 16
    prompt = random_prompt(1000, seed=9)
    config = _config(page_size=page_size, num_blocks=600, max_batch_tokens=1024, allow_block_sharing=False)
    manager = ContinuousBatchingManager(tiny_model("llama"), continuous_batching_config=config)
    try:
        _check_blocks_held_once(engine_core(manager), prompt, page_size)
    finally:
        manager.destroy()


def _check_blocks_held_once(engine: EngineCore, prompt: list[int], page_size: int) -> None:
    """Driven step by step, loop stopped."""
    first = Request("parallel", prompt, SamplingParams(max_new_tokens=4, n=8, temperature=1.0, seed=3))
    first.pending_forks = [
        Request(
            sequence_request_id("parallel", index),
            prompt,
            SamplingParams(max_new_tokens=4, seed=3 + index),
            index=index,
        )
        for index in range(1, 8)
    ]
    sequences = [first, *first.pending_forks]
    assert engine.add_request(first)
    pool = engine.kv_cache_manager.block_pool
    engine.step()  # the prompt but its last token, on the first sequence alone
    assert first.num_computed_tokens == 999 and all(
        sequence.num_computed_tokens == 0 for sequence in sequences[1:]
    )
    engine.step()  # the fork, then every sequence computes the last prompt token and samples
    num_full_pages = 999 // page_size  # 62 pages of 16 shared; positions 992..999 in each sequence's own page
    tables = [engine.kv_cache_manager.block_tables[sequence.request_id] for sequence in sequences]
    shared = tables[0][:num_full_pages]
    assert all(table[:num_full_pages] == shared for table in tables)
    assert all(block.ref_count == 8 for block in shared)
    assert len({table[num_full_pages].block_id for table in tables}) == 8
    assert pool.num_used_blocks == num_full_pages + 8, (
        f"{pool.num_used_blocks} blocks used; the prompt's {num_full_pages} full pages once plus one partial "
        "page per sequence is {num_full_pages + 8}"
    )
    assert engine.scheduler.counters.forked_sequences == 7
    assert all(sequence.num_generated_tokens == 1 for sequence in sequences)
    while engine.has_unfinished_requests():
        engine.step()
    assert pool.num_used_blocks == 0


def test_sequences_are_cancelled_one_by_one_or_together() -> None:
    model = tiny_model("llama")
    manager = ContinuousBatchingManager(model, continuous_batching_config=_config())
    manager.start()
    try:
        with manager.pause():
            request_id = manager.add_request(random_prompt(12, 1), max_new_tokens=50, eos_token_id=[], n=3)
            manager.cancel_request(request_id, index=1)
        assert request_id is not None
        ids = [sequence_request_id(request_id, index) for index in range(3)]
        cancelled = manager.get_result(ids[1], timeout=60)
        assert cancelled.status == RequestStatus.CANCELLED and cancelled.index == 1
        for index in (0, 2):
            output = manager.get_result(ids[index], timeout=60)
            assert output.status == RequestStatus.FINISHED and len(output.generated_tokens) == 50
        request_id = manager.add_request(random_prompt(12, 2), max_new_tokens=500, eos_token_id=[], n=3)
        manager.cancel_request(request_id)
        ends = [manager.get_result(sequence_request_id(request_id, index), timeout=60) for index in range(3)]
        while not all(output.is_finished() for output in ends):
            ends = [
                output
                if output.is_finished()
                else manager.get_result(sequence_request_id(request_id, index), timeout=60)
                for index, output in enumerate(ends)
            ]
        assert all(output.status == RequestStatus.CANCELLED for output in ends)
        assert manager.stats().num_blocks_used == 0
    finally:
        manager.destroy()


def test_stop_token_ids_and_penalties_apply_to_each_sequence() -> None:
    """A sequence that samples a stop token ends alone; the others run to their length limit."""
    model = tiny_model("llama")
    prompt = random_prompt(10, seed=11)
    manager = ContinuousBatchingManager(model, continuous_batching_config=_config())
    manager.start()
    try:
        outputs = _run(
            manager, prompt, n=6, max_new_tokens=24, temperature=1.5, seed=77, repetition_penalty=1.3
        )
        stop_token = outputs[0].generated_tokens[5]
        stopped = _run(
            manager,
            prompt,
            n=6,
            max_new_tokens=24,
            temperature=1.5,
            seed=77,
            repetition_penalty=1.3,
            stop_token_ids=[stop_token],
        )
    finally:
        manager.destroy()
    for index in range(6):
        tokens = outputs[index].generated_tokens
        if stop_token in tokens:
            end = tokens.index(stop_token) + 1
            assert stopped[index].generated_tokens == tokens[:end]
            assert stopped[index].stop_reason == stop_token
        else:
            assert stopped[index].generated_tokens == tokens
            assert stopped[index].finish_reason == "length"


def test_generate_batch_returns_every_sequence_in_transformers_order() -> None:
    model = tiny_model("llama")
    prompts = [random_prompt(9, 1), random_prompt(14, 2)]
    results = generate_batch(
        model,
        prompts,
        continuous_batching_config=_config(),
        max_new_tokens=6,
        num_return_sequences=3,
        eos_token_id=[],
    )
    keys = list(results)
    first, second = keys[0], keys[3]
    assert list(results) == [
        first,
        f"{first}__child#0",
        f"{first}__child#1",
        second,
        f"{second}__child#0",
        f"{second}__child#1",
    ]
    for key, output in results.items():
        prompt = prompts[0] if key.startswith(first) and not key.startswith(second) else prompts[1]
        assert output.generated_tokens == reference_greedy(model, prompt, 6)


def test_n_out_of_bounds_names_the_parameter() -> None:
    manager = ContinuousBatchingManager(tiny_model("llama"), continuous_batching_config=_config())
    try:
        with pytest.raises(ValueError, match=r"^n must be an int in \[1, 128\]"):
            manager.add_request([5, 6], n=0)
        with pytest.raises(ValueError, match=r"^num_return_sequences must be an int in \[1, 128\]"):
            manager.add_request([5, 6], num_return_sequences=129)
        with pytest.raises(ValueError, match="name the same setting"):
            manager.add_request([5, 6], n=2, num_return_sequences=2)
        with pytest.raises(ValueError, match=r"^seed must be an int in"):
            manager.add_request([5, 6], seed=2**64)
    finally:
        manager.destroy()


@pytest.mark.parametrize(
    "label, overrides",
    [
        ("prefix caching on", dict(allow_block_sharing=True)),
        ("async batching", dict(use_async_batching=True)),
        ("chunked prompt", dict(max_batch_tokens=16)),
        ("scarce blocks: forked sequences preempted", dict(num_blocks=14, max_batch_tokens=32)),
        ("scarce blocks with CPU offload", dict(num_blocks=14, max_batch_tokens=32, cpu_offload_space=0.01)),
        ("two rows a batch: sequences left to compute their own prompt", dict(max_requests_per_batch=2)),
    ],
)
def test_greedy_sequences_equal_generate_under_every_scheduling_path(label: str, overrides: dict) -> None:
    model = tiny_model("llama")
    prompts = [random_prompt(length, seed=length) for length in (30, 17, 41)]
    manager = ContinuousBatchingManager(model, continuous_batching_config=_config(**overrides))
    manager.start()
    try:
        ids = [
            manager.add_request(prompt, eos_token_id=[], max_new_tokens=20, n=3, request_id=f"p{index}")
            for index, prompt in enumerate(prompts)
        ]
        outputs = {}
        for request_id in ids:
            for index in range(3):
                sequence_id = sequence_request_id(request_id, index)
                output = manager.get_result(sequence_id, timeout=120)
                while output is not None and not output.is_finished():
                    output = manager.get_result(sequence_id, timeout=120)
                outputs[sequence_id] = output
        stats = manager.stats()
    finally:
        manager.destroy()
    for request_id, prompt in zip(ids, prompts, strict=True):
        expected = reference_greedy(model, prompt, 20)
        for index in range(3):
            output = outputs[sequence_request_id(request_id, index)]
            assert output is not None and output.generated_tokens == expected, (
                f"{label}: sequence {index} of {request_id} differs from model.generate\n"
                f"  engine:   {output.generated_tokens if output else None}\n  generate: {expected}"
            )
    assert stats.num_blocks_used == 0


def test_a_prompt_served_from_the_prefix_cache_still_forks() -> None:
    """The second time, the prompt's 16 first tokens (two whole pages) come from the prefix cache: the first
    sequence computes the last token and samples alone, and the others fork from it a step later."""
    model = tiny_model("llama")
    prompt = random_prompt(17, seed=17)
    manager = ContinuousBatchingManager(model, continuous_batching_config=_config(allow_block_sharing=True))
    manager.start()
    try:
        _run(manager, prompt, n=1, max_new_tokens=4)
        outputs = _run(manager, prompt, n=3, max_new_tokens=10)
        stats = manager.stats()
    finally:
        manager.destroy()
    expected = reference_greedy(model, prompt, 10)
    assert outputs[0].num_cached_tokens == 16
    assert stats.forked_sequences == 2
    for index, output in outputs.items():
        assert output.generated_tokens == expected, (index, output.generated_tokens, expected)
