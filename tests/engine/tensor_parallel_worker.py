"""One rank of a 2-rank tensor-parallel engine on CPU (gloo), for tests/engine/test_tensor_parallel.py.

Run by `launch_ranks` with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set. Every rank loads the model
sharded and runs a `ContinuousBatchingManager`; rank 0 drives a scenario, the other ranks follow. Each
rank writes `rank<N>.json` into --out: what its engine finished (status and tokens of every request), its
loop error, and on rank 0 the scenario's results.

Scenarios:
- lockstep: greedy batch, sampled requests (seeded and not), a cancel, an in-place update from a state
  dict while a request is in flight (KEEP), a rejected update, an ABORT pause, an update from a
  safetensors folder, a stop and a start again, stop.
- hang: rank 1 builds its engine and then never joins the loop; rank 0 must fail within the timeout.
- die: rank 1 exits abruptly while rank 0 generates; rank 0 must fail its request, not hang.
- batch_invariant: the needle alone, then among other prompts, in batch-invariant mode.
- quantized: the model quantized to --quantization (float inputs, the kernel's exact path) on every rank:
  greedy batch and weights checksum, an update from a state dict, the same again.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from engine import ContinuousBatchingConfig, ContinuousBatchingManager, GenerationOutput
from engine.parallel import load_sharded_model
from engine.quantization.model import quantized_layers
from engine.quantization.sharding import ShardedQuantizedLinear
from tests.helpers.engine_runs import engine_core


def collect(manager: ContinuousBatchingManager, ids: list[str | None]) -> dict[str, GenerationOutput]:
    outputs: dict[str, GenerationOutput] = {}
    for request_id in ids:
        assert request_id is not None
        output = manager.get_result(request_id, timeout=120)
        while output is not None and not output.is_finished():
            output = manager.get_result(request_id, timeout=120)
        assert output is not None, f"no final output for {request_id}"
        outputs[request_id] = output
    return outputs


def greedy(
    manager: ContinuousBatchingManager, prompts: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    ids = manager.add_requests(prompts, max_new_tokens=max_new_tokens)
    outputs = collect(manager, ids)
    return [outputs[request_id].generated_tokens for request_id in ids if request_id is not None]


def wait_for_tokens(manager: ContinuousBatchingManager, request_id: str, count: int) -> GenerationOutput:
    while True:
        output = manager.get_result(request_id, timeout=120)
        assert output is not None and not output.is_finished(), f"{request_id} ended early: {output}"
        if len(output.generated_tokens) >= count:
            return output


# How long the lockstep scenario keeps the engine stopped: several of the driver's heartbeats (one a
# second at most), which the other ranks must wait through without timing out.
STOPPED_S = 2.5


def drive_lockstep(manager: ContinuousBatchingManager, args: argparse.Namespace) -> dict[str, Any]:
    with open(os.path.join(args.out, "prompts.json"), encoding="utf-8") as handle:
        prompts: list[list[int]] = json.load(handle)
    results: dict[str, Any] = {"greedy_before": greedy(manager, prompts, args.max_new_tokens)}

    sampled = [
        manager.add_request(prompts[index], max_new_tokens=12, do_sample=True, temperature=1.0, **seed)
        for index, seed in enumerate([{}, {}, {"seed": 7}, {"seed": 8}])
    ]
    results["sampled"] = [output.generated_tokens for output in collect(manager, sampled).values()]

    cancelled = manager.add_request(prompts[0], request_id="to-cancel", max_new_tokens=400, streaming=True)
    assert cancelled is not None
    wait_for_tokens(manager, cancelled, 2)
    manager.cancel_request(cancelled)
    results["cancelled_status"] = collect(manager, [cancelled])[cancelled].status.name

    in_flight = manager.add_request(prompts[1], request_id="in-flight", max_new_tokens=30, streaming=True)
    assert in_flight is not None
    tokens_before_update = len(wait_for_tokens(manager, in_flight, 5).generated_tokens)
    results["version_after_state_dict"] = manager.update_weights(
        load_file(args.new_weights), version="seed-1"
    )
    final = collect(manager, [in_flight])[in_flight]
    results["in_flight"] = {
        "status": final.status.name,
        "tokens": len(final.generated_tokens),
        "tokens_before_update": tokens_before_update,
        "weight_version": final.weight_version,
    }
    results["greedy_after"] = greedy(manager, prompts, args.max_new_tokens)
    checksum = manager.weights_checksum()  # every rank gathers each sharded tensor whole
    results["checksum_after_update"] = {"digest": checksum.digest, "weight_version": checksum.weight_version}
    results["prefix_blocks_reset"] = manager.reset_prefix_cache().num_blocks

    try:
        manager.update_weights({"model.embed_tokens.weight": torch.zeros(3, 3)})
    except ValueError as exc:
        results["bad_update_error"] = str(exc)
    results["greedy_after_bad_update"] = greedy(manager, prompts[:2], args.max_new_tokens)

    aborted = manager.add_request(prompts[2], request_id="aborted", max_new_tokens=400, streaming=True)
    assert aborted is not None
    wait_for_tokens(manager, aborted, 2)
    with manager.pause(mode="abort") as handle:
        results["abort_cancelled"] = handle.cancelled
    results["aborted_status"] = collect(manager, [aborted])[aborted].status.name

    results["version_after_path"] = manager.update_weights(args.model)
    results["greedy_after_path"] = greedy(manager, prompts[:2], args.max_new_tokens)

    manager.stop(block=True, timeout=60)
    results["running_while_stopped"] = manager.is_running()
    time.sleep(STOPPED_S)
    manager.start()
    results["greedy_after_restart"] = greedy(manager, prompts[:2], args.max_new_tokens)
    return results


def drive_batch_invariant(manager: ContinuousBatchingManager, args: argparse.Namespace) -> dict[str, Any]:
    """The needle alone, then among twelve other prompts (batch-invariant mode): tokens and logprobs."""
    with open(os.path.join(args.out, "prompts.json"), encoding="utf-8") as handle:
        needle, *others = json.load(handle)
    settings = dict(max_new_tokens=args.max_new_tokens, eos_token_id=[], logprobs=True)
    alone = collect(manager, [manager.add_request(needle, **settings)])
    ids = [manager.add_request(prompt, **settings) for prompt in [*others[:6], needle, *others[6:]]]
    batched = collect(manager, ids)
    return {
        name: {"tokens": output.generated_tokens, "logprobs": output.logprobs}
        for name, output in (("alone", next(iter(alone.values()))), ("batched", batched[str(ids[6])]))
    }


def drive_quantized(manager: ContinuousBatchingManager, args: argparse.Namespace) -> dict[str, Any]:
    with open(os.path.join(args.out, "prompts.json"), encoding="utf-8") as handle:
        prompts: list[list[int]] = json.load(handle)
    results: dict[str, Any] = {
        "greedy_before": greedy(manager, prompts, args.max_new_tokens),
        "checksum_before": manager.weights_checksum().digest,
    }
    manager.update_weights(load_file(args.new_weights), version="seed-1")
    results["greedy_after"] = greedy(manager, prompts, args.max_new_tokens)
    results["checksum_after"] = manager.weights_checksum().digest
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    scenarios = ("lockstep", "hang", "die", "batch_invariant", "quantized")
    parser.add_argument("--scenario", choices=scenarios, required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--new-weights")
    parser.add_argument("--out", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--async-batching", action="store_true")
    parser.add_argument("--quantization", default="none")
    args = parser.parse_args()

    model = load_sharded_model(args.model, torch.float32, "sdpa")
    rank = dist.get_rank()
    config = ContinuousBatchingConfig(
        page_size=16,
        num_blocks=64,
        max_batch_tokens=128,
        cpu_group_timeout=args.timeout,
        use_async_batching=args.async_batching,
        batch_invariant=args.scenario == "batch_invariant",
        quantization=args.quantization,
        quantize_activations=False,
    )
    manager = ContinuousBatchingManager(model, continuous_batching_config=config)
    finished: dict[str, dict[str, Any]] = {}
    engine = engine_core(manager)  # joins the engine's set-up collectives
    loop = manager._loop
    assert loop is not None
    record_finish = loop._finish

    def recording_finish(request: Any) -> None:
        finished[request.request_id] = {"status": request.status.name, "tokens": request.generated_tokens}
        record_finish(request)

    loop._finish = recording_finish  # type: ignore[method-assign]
    report: dict[str, Any] = {"rank": rank, "tp_size": getattr(model, "tp_size", None)}

    if args.scenario == "hang" and rank != 0:
        time.sleep(3600)  # joined the engine's set-up collectives above, never joins the loop
    if args.scenario == "die" and rank != 0:
        manager.start()
        time.sleep(1.0)
        os._exit(3)

    manager.start()
    if rank != 0:
        report["add_request_on_follower"] = manager.add_request([5, 6, 7], max_new_tokens=2)
    if rank == 0:
        if args.scenario == "lockstep":
            report["results"] = drive_lockstep(manager, args)
        elif args.scenario == "batch_invariant":
            report["results"] = drive_batch_invariant(manager, args)
        elif args.scenario == "quantized":
            report["results"] = drive_quantized(manager, args)
        else:
            started = time.monotonic()
            request_id = manager.add_request([5, 6, 7, 8], max_new_tokens=900)
            assert request_id is not None
            output = collect(manager, [request_id])[request_id]
            report["results"] = {
                "status": output.status.name,
                "error": output.error,
                "seconds_to_fail": time.monotonic() - started,
                "running_after": manager.is_running(),
            }
        manager.stop(block=True, timeout=60)
    else:
        manager.join()
    report["kv_heads_cached"] = engine.kv_caches[0].shape.num_kv_heads
    report["async_batching"] = engine.async_batching
    report["placeholder_inputs"] = engine.runner.num_placeholder_inputs
    report["loop_error"] = manager.loop_error
    report["finished"] = finished
    report["quantized_layers"] = {
        name: layer.style.value if isinstance(layer, ShardedQuantizedLinear) else "unsharded"
        for name, layer in quantized_layers(model).items()
    }
    report["loop_ended"] = not manager.is_running()
    with open(os.path.join(args.out, f"rank{rank}.json"), "w", encoding="utf-8") as handle:
        json.dump(report, handle)
    if args.scenario in ("lockstep", "batch_invariant", "quantized"):
        manager.destroy()
        # Both ranks reach the teardown before either closes the group: a rank that closed its connections
        # while its peer still had gloo work in flight died in gloo's threads ("terminate called without an
        # active exception", SIGABRT) in two full-suite runs, one rank each time.
        dist.barrier()
        dist.destroy_process_group()
    else:
        os._exit(0)  # the peer is gone or hung: tearing the group down would wait for it


if __name__ == "__main__":
    main()
