"""Batch-invariant mode (`ContinuousBatchingConfig(batch_invariant=True)`): a request's tokens and
logprobs are bitwise equal whatever else is scheduled with it, and equal to what a trainer computes
under `engine.trainer_exact` (issue 33).

Modelled on vLLM's `tests/v1/determinism` and SGLang's deterministic test: a needle prompt alone, then
inside random batches of 8 to 64 other prompts, compared with `torch.equal` on the per-token logprobs;
variants with a prefix-cache hit, chunked prefill at several splits, preemption (recompute and offload),
async batching, n = 4 seeded sequences; a negative control showing that the default mode does differ (so
these tests can fail); and the trainer's forward of prompt + output, with a backward pass.
"""

from __future__ import annotations

import functools
import random
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from engine import (
    BatchInvariantUnsupported,
    ContinuousBatchingConfig,
    ContinuousBatchingManager,
    GenerationOutput,
    RequestStatus,
    generate_batch,
    sequence_logprobs,
    trainer_exact,
)
from engine.engine_core import EngineCore
from engine.request import sequence_request_id
from engine.runner import batch_invariant as batch_invariant_module
from engine.sampling.params import sequence_seed
from tests.helpers.models import TEST_DEVICE, VOCAB_SIZE, fresh_tiny_model, random_prompt, tiny_model

FAMILIES = ("llama", "qwen3", "mistral", "gemma2")
NEEDLE = random_prompt(45, seed=4500)
NEW_TOKENS = 16
SAMPLED = dict(do_sample=True, temperature=0.9, top_k=40, top_p=0.95, seed=2024)
pytestmark = pytest.mark.skipif(
    TEST_DEVICE.type == "cpu" and not torch.backends.mkldnn.is_available(),
    reason="batch-invariant mode on the CPU needs oneDNN",
)
# The oneDNN tests: the CPU's kernels, whatever device the engine tests run on.
CPU_KERNELS = pytest.mark.skipif(
    TEST_DEVICE.type != "cpu", reason=f"the CPU's kernels, and the engine runs on {TEST_DEVICE.type}"
)


def _config(**overrides: Any) -> ContinuousBatchingConfig:
    settings: dict[str, Any] = dict(page_size=8, num_blocks=512, max_batch_tokens=64, batch_invariant=True)
    settings.update(overrides)
    return ContinuousBatchingConfig(**settings)


def _generate(
    model: torch.nn.Module, prompts: list[list[int]], config: ContinuousBatchingConfig, **sampling: Any
) -> list[GenerationOutput]:
    """Every prompt's output (EOS ignored, logprobs on), all submitted at once."""
    settings = dict(max_new_tokens=NEW_TOKENS, eos_token_id=[], logprobs=True)
    settings.update(sampling)
    outputs = list(
        generate_batch(model, prompts, continuous_batching_config=config, warmup=False, **settings).values()
    )
    for output in outputs:
        assert output.status == RequestStatus.FINISHED, output
    return outputs


@functools.cache
def _alone(family: str, sampled: bool = False, new_tokens: int = NEW_TOKENS) -> GenerationOutput:
    """The needle by itself: its whole prompt in one step, then one decode row per step."""
    sampling = SAMPLED if sampled else {}
    config = _config(max_batch_tokens=256)
    return _generate(tiny_model(family), [NEEDLE], config, max_new_tokens=new_tokens, **sampling)[0]


def _assert_same_bits(expected: GenerationOutput, actual: GenerationOutput, label: str) -> None:
    """Tokens equal and logprobs `torch.equal`; on failure, both sides from the first difference."""
    assert actual.generated_tokens == expected.generated_tokens, (
        f"{label}: tokens differ\n  alone:   {expected.generated_tokens}\n"
        f"  batched: {actual.generated_tokens}"
    )
    alone, batched = torch.tensor(expected.logprobs), torch.tensor(actual.logprobs)
    if not torch.equal(alone, batched):
        first = int((alone != batched).nonzero()[0])
        pytest.fail(
            f"{label}: logprobs differ from token {first} on (largest difference "
            f"{(alone - batched).abs().max().item():.3g})\n  alone:   {expected.logprobs[first:]}\n"
            f"  batched: {actual.logprobs[first:]}"
        )


def _random_batch(seed: int, size: int | None = None) -> tuple[list[list[int]], int]:
    """`size` (else 8 to 64) other prompts of 1 to 80 tokens with the needle at a random position; the
    position."""
    rng = random.Random(seed)
    count = size if size is not None else rng.randint(8, 64)
    prompts = [random_prompt(rng.randint(1, 80), seed=rng.randrange(1 << 30)) for _ in range(count)]
    position = rng.randrange(count + 1)
    prompts.insert(position, NEEDLE)
    return prompts, position


@pytest.mark.parametrize(
    ("family", "seed", "size"),
    [("llama", 1, None), ("llama", 2, None), ("qwen3", 3, 8), ("mistral", 4, 8), ("gemma2", 5, 8)],
)
def test_needle_has_the_same_bits_alone_and_in_a_random_batch(
    family: str, seed: int, size: int | None
) -> None:
    """Greedy; the batch's step budget splits the needle's prompt wherever the others leave room. The
    llama batches are 8 to 64 prompts (16 and 63 here); the other families', 8."""
    prompts, position = _random_batch(seed, size)
    budget = random.Random(seed).choice([32, 64, 128])
    outputs = _generate(tiny_model(family), prompts, _config(max_batch_tokens=budget))
    _assert_same_bits(
        _alone(family), outputs[position], f"{family}, needle {position} of {len(prompts)}, budget {budget}"
    )


def test_seeded_sampling_has_the_same_bits_alone_and_in_a_random_batch() -> None:
    prompts, position = _random_batch(seed=6, size=16)
    outputs = _generate(tiny_model("llama"), prompts, _config(), **SAMPLED)
    _assert_same_bits(_alone("llama", sampled=True), outputs[position], "seeded sampling, llama")


def test_default_mode_gives_the_needle_other_bits_in_some_shared_step() -> None:
    """The negative control: without the mode the same comparisons fail, so the tests above can. The
    default mode's linear layers give a row the same bits in any batch too (the float32 kernel's panels,
    engine.runner.packed_linear), but its attention does not: a prompt shared with other requests runs in
    other tiles than alone. Which shared steps show it depends on the CPU the kernels were built for: on the
    2-core EPYC (AVX2), steps of two tokens shared with two other prompts did (the needle's prompt then runs
    in tiles of one or two queries, scoring their keys as a decode tile does); on an AVX-512 Xeon those gave
    the same bits, and a random batch of 16 (seed 1) gave other ones. So the control asserts that one of
    them differs."""
    model = tiny_model("llama")
    alone = _generate(model, [NEEDLE], _config(batch_invariant=False, max_batch_tokens=256))[0]
    prompts = [random_prompt(20, seed=7), NEEDLE, random_prompt(9, seed=8)]
    shared = [_generate(model, prompts, _config(batch_invariant=False, max_batch_tokens=2))[1]]
    for seed in range(4):
        batch, position = _random_batch(seed=seed, size=16)
        shared.append(_generate(model, batch, _config(batch_invariant=False))[position])
    differing = [output.logprobs != alone.logprobs for output in shared]
    assert any(differing), "the default mode gave the needle the same bits in every shared step tried"


def test_a_prefix_cache_hit_gives_the_same_bits() -> None:
    """The needle's first 40 tokens come from the cache another request filled."""
    manager = ContinuousBatchingManager(tiny_model("llama"), continuous_batching_config=_config())
    manager.start()
    try:
        settings = dict(max_new_tokens=NEW_TOKENS, eos_token_id=[], logprobs=True)
        first = manager.add_request(NEEDLE[:40] + random_prompt(30, seed=1), **settings)
        assert manager.get_result(first, timeout=120) is not None
        needle = manager.add_request(NEEDLE, **settings)
        output = manager.get_result(needle, timeout=120)
    finally:
        manager.destroy()
    assert output is not None and output.num_cached_tokens == 40, output
    _assert_same_bits(_alone("llama"), output, "prefix-cache hit of 40 tokens")


@pytest.mark.parametrize("max_batch_tokens", [7, 16, 33])
def test_chunked_prefill_at_any_split_gives_the_same_bits(max_batch_tokens: int) -> None:
    """The needle's prompt in chunks of `max_batch_tokens`, shared with two other requests."""
    prompts = [random_prompt(20, seed=7), NEEDLE, random_prompt(9, seed=8)]
    outputs = _generate(tiny_model("llama"), prompts, _config(max_batch_tokens=max_batch_tokens))
    _assert_same_bits(_alone("llama"), outputs[1], f"chunks of at most {max_batch_tokens} tokens")


@pytest.mark.parametrize("offload", [False, True], ids=["recompute", "offload"])
def test_preemption_gives_the_same_bits(offload: bool) -> None:
    """Six copies of the needle in a cache too small for all: the preempted ones are recomputed (or
    restored from the host), and every copy has the bits of the needle alone."""
    new_tokens = 24
    config = _config(
        num_blocks=34,
        max_batch_tokens=128,
        allow_block_sharing=False,
        cpu_offload_space=0.01 if offload else 0.0,
    )
    manager = ContinuousBatchingManager(tiny_model("llama"), continuous_batching_config=config)
    manager.start()
    try:
        settings = dict(max_new_tokens=new_tokens, eos_token_id=[], logprobs=True)
        ids = [manager.add_request(NEEDLE, **settings) for _ in range(6)]
        outputs = [manager.get_result(request_id, timeout=300) for request_id in ids]
        stats = manager.stats()
    finally:
        manager.destroy()
    assert stats.preemptions > 0, "the cache was meant to be too small to avoid preemption"
    assert (stats.offloaded_blocks > 0) == offload, stats
    expected = _alone("llama", new_tokens=new_tokens)
    for index, output in enumerate(outputs):
        assert output is not None
        _assert_same_bits(expected, output, f"copy {index}, {'offload' if offload else 'recompute'}")


@CPU_KERNELS
def test_unpacked_weights_give_the_packed_bits() -> None:
    """With `pack_cpu_weights=False` the mode's oneDNN calls on the plain weights serve every linear layer
    (one row padded to two): the bits of the packed engine's needle alone."""
    prompts, position = _random_batch(seed=12, size=8)
    outputs = _generate(tiny_model("llama"), prompts, _config(pack_cpu_weights=False))
    _assert_same_bits(_alone("llama"), outputs[position], "plain weights")


def test_async_batching_gives_the_same_bits() -> None:
    prompts, position = _random_batch(seed=9, size=12)
    outputs = _generate(tiny_model("llama"), prompts, _config(use_async_batching=True))
    _assert_same_bits(_alone("llama"), outputs[position], "async batching")


def test_each_of_four_sequences_has_the_bits_of_a_single_request_alone() -> None:
    """n = 4, seeded, among other requests: sequence i equals a request seeded `seed + i`, alone."""
    model = tiny_model("llama")
    manager = ContinuousBatchingManager(model, continuous_batching_config=_config())
    manager.start()
    try:
        settings = dict(max_new_tokens=NEW_TOKENS, eos_token_id=[], logprobs=True, **SAMPLED)
        others = [manager.add_request(random_prompt(length, seed=length), **settings) for length in (5, 60)]
        request_id = manager.add_request(NEEDLE, num_return_sequences=4, **settings)
        assert request_id is not None
        together = [
            manager.get_result(sequence_request_id(request_id, index), timeout=120) for index in range(4)
        ]
        for other in others:
            manager.get_result(other, timeout=120)
        alone = []
        for index in range(4):
            single = manager.add_request(
                NEEDLE, **{**settings, "seed": sequence_seed(SAMPLED["seed"], index)}
            )
            alone.append(manager.get_result(single, timeout=120))
    finally:
        manager.destroy()
    for index in range(4):
        assert together[index] is not None and alone[index] is not None
        _assert_same_bits(alone[index], together[index], f"sequence {index} of 4")
    assert len({tuple(output.generated_tokens) for output in together if output is not None}) > 1


@pytest.mark.parametrize("family", FAMILIES)
def test_trainer_forward_has_the_engine_bits_and_trains(family: str) -> None:
    """Three sequences of a batch, prompt + output, through `sequence_logprobs` on the trainer's own copy
    of the model: every logprob `torch.equal` to the engine's, and a backward pass reaches the weights."""
    prompts, position = _random_batch(seed=10, size=8)
    outputs = _generate(tiny_model(family), prompts, _config())
    chosen = [position, 0, len(prompts) - 1]
    sequences = [prompts[index] + outputs[index].generated_tokens for index in chosen]
    trainer = fresh_tiny_model(family).train()
    logprobs = sequence_logprobs(trainer, sequences, [len(prompts[index]) for index in chosen])
    for index, computed in zip(chosen, logprobs, strict=True):
        served = torch.tensor(outputs[index].logprobs)
        assert torch.equal(computed.detach().cpu(), served), (
            f"{family}, sequence {index}: trainer logprobs differ from the engine's by up to "
            f"{(computed.detach().cpu() - served).abs().max().item():.3g}"
        )
    torch.stack([values.sum() for values in logprobs]).sum().neg().backward()
    gradients = [parameter.grad for parameter in trainer.parameters() if parameter.requires_grad]
    assert all(gradient is not None and torch.isfinite(gradient).all() for gradient in gradients)
    assert any(gradient.abs().sum() > 0 for gradient in gradients if gradient is not None)


def test_trainer_gradients_equal_the_models_own_up_to_rounding() -> None:
    """The backward passes (plain matmuls, eager attention) compute the true gradient of the model."""
    model = fresh_tiny_model("qwen3")
    sequences = [random_prompt(30, seed=11), random_prompt(17, seed=12)]
    exact = torch.stack([values.sum() for values in sequence_logprobs(model, sequences, [5, 5])]).sum()
    exact.backward()
    exact_grads = [parameter.grad.clone() for parameter in model.parameters()]
    model.zero_grad()
    reference = torch.zeros(())
    for sequence in sequences:
        ids = torch.tensor([sequence], device=TEST_DEVICE)
        log_probs = torch.log_softmax(model(ids).logits[0, 4:-1].float(), dim=-1)
        reference = reference + log_probs.gather(1, ids[0, 5:].unsqueeze(1)).sum()
    reference.backward()
    for exact_grad, parameter in zip(exact_grads, model.parameters(), strict=True):
        torch.testing.assert_close(exact_grad, parameter.grad, rtol=1e-4, atol=1e-5)


def test_trainer_forward_on_the_served_model_itself() -> None:
    """A colocated trainer: the same model object, while the engine holds it and serves another request."""
    model = fresh_tiny_model("mistral")
    manager = ContinuousBatchingManager(model, continuous_batching_config=_config())
    manager.start()
    try:
        settings = dict(max_new_tokens=NEW_TOKENS, eos_token_id=[], logprobs=True)
        needle = manager.get_result(manager.add_request(NEEDLE, **settings), timeout=120)
        busy = manager.add_request(random_prompt(90, seed=13), max_new_tokens=64, eos_token_id=[])
        with torch.no_grad(), trainer_exact(model):
            logits = model(torch.tensor([NEEDLE + needle.generated_tokens], device=TEST_DEVICE)).logits[0]
        manager.get_result(busy, timeout=120)
    finally:
        manager.destroy()
    log_probs = torch.log_softmax(logits[len(NEEDLE) - 1 : -1].float(), dim=-1).cpu()
    computed = log_probs.gather(1, torch.tensor(needle.generated_tokens).unsqueeze(1)).squeeze(1)
    assert torch.equal(computed, torch.tensor(needle.logprobs))
    assert model.config._attn_implementation == "sdpa", "the engine must give the model its attention back"


def test_trainer_exact_refuses_a_padding_mask() -> None:
    model = fresh_tiny_model("llama")
    ids = torch.tensor([[5, 6, 7, 8], [0, 0, 9, 10]], device=TEST_DEVICE)
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]], device=TEST_DEVICE)
    with torch.no_grad(), trainer_exact(model), pytest.raises(ValueError, match="right-pad"):
        model(input_ids=ids, attention_mask=mask)
    assert model.config._attn_implementation == "sdpa"


@CPU_KERNELS
def test_packed_onednn_gives_every_row_its_bits_alone_and_the_blas_does_not() -> None:
    """The measured premise (bench/batch_invariance.py) at the tiny models' shapes."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(VOCAB_SIZE, 64, generator=generator)
    rows = torch.randn(70, 64, generator=generator)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    alone = torch.ops.mkldnn._linear_pointwise(rows[:1], packed, None, "none", [], "")
    blas_varies = False
    for count in (2, 3, 8, 17, 70):
        assert torch.equal(
            torch.ops.mkldnn._linear_pointwise(rows[:count], packed, None, "none", [], "")[:1], alone
        )
        assert torch.equal(batch_invariant_module.invariant_linear(rows[:count], weight)[:1], alone)
        blas_varies |= not torch.equal(F.linear(rows[:count], weight)[:1], F.linear(rows[:1], weight))
    assert torch.equal(batch_invariant_module.invariant_linear(rows[:1], weight), alone)
    assert blas_varies, "the BLAS gave every row its bits alone: the control no longer shows the cause"


@CPU_KERNELS
def test_a_machine_whose_kernels_vary_refuses_the_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """The startup check runs the model's shapes through the mode's kernels: here the BLAS stands in for
    the float32 panels."""
    monkeypatch.setattr(
        batch_invariant_module, "_panel_linear", lambda rows, weight, bias: F.linear(rows, weight, bias)
    )
    monkeypatch.setattr(batch_invariant_module, "_checked_shapes", set())
    with pytest.raises(BatchInvariantUnsupported, match="other bits among 2 rows than alone"):
        EngineCore(fresh_tiny_model("llama"), _config())


def test_a_table_width_too_small_for_the_longest_request_is_refused() -> None:
    with pytest.raises(ValueError, match=r"max_blocks_per_request=4 covers 32 tokens, .* at least 128"):
        EngineCore(fresh_tiny_model("llama"), _config(max_blocks_per_request=4))


def test_cuda_kernels_give_every_row_its_bits_alone() -> None:
    """The Triton matmul and row mean of the CUDA path (on the CPU, under Triton's interpreter): a row's
    bits alone and among 2 to 130 rows, in and across tiles, and the values of `F.linear` and `mean`."""
    pytest.importorskip("triton")
    from engine.runner.batch_invariant_cuda import matmul, row_mean

    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(70, 48, generator=generator).to(TEST_DEVICE)
    bias = torch.randn(70, generator=generator).to(TEST_DEVICE)
    rows = torch.randn(130, 48, generator=generator).to(TEST_DEVICE)
    alone = [matmul(rows[index : index + 1], weight, bias) for index in (0, 64)]
    means = [row_mean(rows[index : index + 1], keepdim=True) for index in (0, 64)]
    for count in (2, 65, 130):
        product, mean = matmul(rows[:count], weight, bias), row_mean(rows[:count], keepdim=True)
        assert torch.equal(product[:1], alone[0]) and torch.equal(mean[:1], means[0]), f"{count} rows"
        if count > 64:
            assert torch.equal(product[64:65], alone[1]) and torch.equal(mean[64:65], means[1]), (
                f"{count} rows"
            )
    torch.testing.assert_close(matmul(rows, weight, bias), F.linear(rows, weight, bias), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(row_mean(rows), rows.mean(-1))


# Three ranks' parts whose sum depends on the order of the additions in fp32: rank order gives
# (1e8 + 1) - 1e8 = 0, another order (1e8 - 1e8) + 1 = 1.
RANK_PARTS = (1e8, 1.0, -1e8)


def _all_reduce_on_rank(rank: int, init_file: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=len(RANK_PARTS))
    try:
        ordered = torch.full((4099,), RANK_PARTS[rank])
        with batch_invariant_module.all_reduce_in_rank_order():
            dist.all_reduce(ordered)
        plain = torch.full((3,), float(rank))
        dist.all_reduce(plain)  # outside the block: the collective as it is
        torch.save({"ordered": ordered, "plain": plain}, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_all_reduce_in_rank_order_gives_every_rank_the_rank_order_sum(tmp_path: Path) -> None:
    """Tensor parallelism over 3 or more ranks: the row-parallel layers' partial sums add in rank order."""
    # Forked, not spawned: a spawned rank imports this module's dependencies again (seconds each); a rank
    # runs no parallel region, so the parent's OpenMP team does not matter.
    mp.start_processes(
        _all_reduce_on_rank,
        args=(str(tmp_path / "init"), str(tmp_path)),
        nprocs=len(RANK_PARTS),
        join=True,
        start_method="fork",
    )
    expected = (torch.tensor(RANK_PARTS[0]) + RANK_PARTS[1]) + RANK_PARTS[2]
    for rank in range(len(RANK_PARTS)):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        assert torch.equal(result["ordered"], expected.expand(4099)), f"rank {rank}: {result['ordered'][:4]}"
        assert torch.equal(result["plain"], torch.full((3,), 3.0))


@CPU_KERNELS
def test_the_trainer_side_repacks_a_weight_its_optimizer_moved(monkeypatch: pytest.MonkeyPatch) -> None:
    """`invariant_linear` keeps a float32 weight's panels between calls, and packs them again once the
    weight is written in place (doubling it doubles every output exactly)."""
    packs: list[int] = []
    pack = batch_invariant_module.linear_kernel.float32_panels

    def counted(weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        packs.append(weight.shape[0])
        return pack(weight, out)

    monkeypatch.setattr(batch_invariant_module.linear_kernel, "float32_panels", counted)
    generator = torch.Generator().manual_seed(5)
    weight = torch.nn.Parameter(torch.randn(40, 64, generator=generator))
    rows = torch.randn(3, 64, generator=generator)
    with torch.no_grad():
        first = batch_invariant_module.invariant_linear(rows, weight)
        assert torch.equal(batch_invariant_module.invariant_linear(rows, weight), first)
        assert packs == [40], "the unchanged weight was packed again"
        weight.mul_(2)
        assert torch.equal(batch_invariant_module.invariant_linear(rows, weight), 2 * first)
    assert packs == [40, 40]
