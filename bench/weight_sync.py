"""Seconds and GB/s to push a model's weights into a running `cbserve serve`: over the weight-update group
(one broadcast per bucket, `WeightSyncGroup.push`) and over gRPC (`AdminClient.update_weights`, chunks
with a sha256 each), in the same run, as an RL trainer pushes after every step.

    python -m bench.weight_sync                 # ~125M-parameter llama in fp32 (~0.5 GB), gloo, on the CPU
    python -m bench.weight_sync --ipc           # on a GPU: the server on it, gloo, and CUDA IPC from here
    python -m bench.weight_sync --backend nccl  # NCCL: the trainer and the server on different GPUs

NCCL refuses two ranks of one communicator on the same GPU, so on a one-GPU machine the group runs gloo
(host buffers, copied to the device as each bucket lands) and CUDA IPC measures the device-to-device path.

    python -m bench.weight_sync --busy-neighbour  # the same beside a process that keeps one core busy

On a small machine the push competes for the cores: `--busy-neighbour` measures it beside a pure-Python
loop pinned to the last CPU of this process's affinity mask, started before the server and stopped (by its
PID) at the end. The summary line gives the load averages at the start and at the end.

Pushes alternate between the paths for `--rounds` rounds, each with other weights than the one before, and
every push is checked (outside the timing): the server then answers with the pushed model's greedy tokens.
Prints one JSON object per path (median and every push's seconds) and a last one with the ratio of medians
and the machine's load.
The first push into a fresh server also pages its weights in (they are mapped from the safetensors file
until first written), whichever path it takes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from cbserve_client import AdminClient, Client, WeightSyncGroup
from cbserve_client._buckets import DEFAULT_BUCKET_BYTES
from transformers import AutoModelForCausalLM, LlamaConfig

from bench.serving_load import ServerProcess

TOKEN = "weight-sync-bench"
PROMPT = [5, 17, 42, 99, 7, 3, 250, 11]


def model_config(args: argparse.Namespace) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers,
        num_attention_heads=12,
        num_key_value_heads=4,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )


def seeded_model(config: LlamaConfig, seed: int, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    return model.to(device).eval()


def greedy(model: torch.nn.Module, num_tokens: int) -> list[int]:
    device = next(model.parameters()).device
    with torch.no_grad():
        output = model.generate(
            torch.tensor([PROMPT], device=device),
            max_new_tokens=num_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return [int(token) for token in output[0, len(PROMPT) :].tolist()]


def check_served(target: str, model: torch.nn.Module) -> bool:
    with Client(target, timeout=120) as client:
        served = client.generate(PROMPT, max_new_tokens=4, ignore_eos=True).token_ids
    return list(served) == greedy(model, 4)


def record(path: str, times: list[float], num_bytes: int, correct: bool, **extra: Any) -> dict[str, Any]:
    median = statistics.median(times)
    return {
        "path": path,
        "median_s": round(median, 3),
        "gb_per_s": round(num_bytes / median / 1e9, 3),
        "seconds": [round(seconds, 3) for seconds in times],
        "gigabytes": round(num_bytes / 1e9, 3),
        "serves_the_pushed_model": correct,
        **extra,
    }


def timed(push: Any, *args: Any, **kwargs: Any) -> float:
    started = time.perf_counter()
    push(*args, **kwargs)
    return time.perf_counter() - started


class BusyNeighbour:
    """A process that keeps one CPU busy (a pure-Python loop pinned to it) until `stop`."""

    def __init__(self) -> None:
        self.cpu = max(os.sched_getaffinity(0))
        self.process = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            os.sched_setaffinity(self.process.pid, {self.cpu})
        except OSError:
            self.stop()
            raise

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The records of `measure` (beside a busy neighbour when asked), then a summary: the ratio of the
    medians and the machine's load."""
    load_at_start = os.getloadavg()
    neighbour = BusyNeighbour() if args.busy_neighbour else None
    try:
        records = measure(args)
    finally:
        if neighbour is not None:
            neighbour.stop()
    grpc_s = records[0]["median_s"]
    records.append(
        {
            "summary": True,
            "group_speedup_over_grpc": round(grpc_s / records[1]["median_s"], 2),
            "busy_neighbour_cpu": None if neighbour is None else neighbour.cpu,
            "load_average_at_start": [round(load, 2) for load in load_at_start],
            "load_average_at_end": [round(load, 2) for load in os.getloadavg()],
            "cpu_count": os.cpu_count(),
        }
    )
    return records


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Pushes alternate between the paths, round after round, each with other weights than the last,
    and every push is followed by a check that the server serves them (outside the timing)."""
    config = model_config(args)
    # The trainer's tensors: on a GPU for NCCL (its second device, the server taking the first) and IPC.
    device = torch.device("cuda", 1) if args.backend == "nccl" else torch.device("cpu")
    records: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as folder:
        seeded_model(config, 0, torch.device("cpu")).save_pretrained(folder)
        server_args = argparse.Namespace(
            page_size=16, max_batch_tokens=256, num_blocks=64, threads=args.threads
        )
        os.environ["CBSERVE_ADMIN_TOKEN"] = TOKEN
        server = ServerProcess(folder, Path(folder) / "server.log", server_args)
        try:
            server.wait_serving()
            admin_target = f"127.0.0.1:{server.admin_port}"
            with AdminClient(admin_target, token=TOKEN, timeout=600) as admin:
                trained = [seeded_model(config, seed, device) for seed in (1, 2)]
                num_parameters = sum(parameter.numel() for parameter in trained[0].parameters())
                num_bytes = sum(
                    value.numel() * value.element_size() for value in trained[0].state_dict().values()
                )
                common = {"parameters": num_parameters, "backend": args.backend, "rounds": args.rounds}
                times: dict[str, list[float]] = {"grpc": [], "group": [], "cuda_ipc": []}
                correct = True
                created = time.perf_counter()
                with WeightSyncGroup.create(admin, master_address="127.0.0.1", backend=args.backend) as group:
                    formed_s = time.perf_counter() - created
                    bucket_bytes = args.bucket_mib << 20
                    for round_index in range(args.rounds):
                        model = trained[round_index % 2]
                        state = model.state_dict()
                        times["group"].append(timed(group.push, state, bucket_bytes=bucket_bytes))
                        correct = correct and check_served(server.target, model)
                        model = trained[(round_index + 1) % 2]
                        state = model.state_dict()
                        times["grpc"].append(timed(admin.update_weights, state))
                        correct = correct and check_served(server.target, model)
                        if args.ipc:
                            shared = seeded_model(
                                config, 1 + round_index % 2, torch.device("cuda", 0)
                            ).state_dict()
                            times["cuda_ipc"].append(timed(admin.update_weights_from_ipc, shared))
                            correct = correct and check_served(server.target, trained[round_index % 2])
                records.append(record("grpc", times["grpc"], num_bytes, correct, **common))
                records.append(
                    record(
                        "group",
                        times["group"],
                        num_bytes,
                        correct,
                        group_formed_s=round(formed_s, 3),
                        bucket_mib=args.bucket_mib,
                        **common,
                    )
                )
                if args.ipc:
                    records.append(record("cuda_ipc", times["cuda_ipc"], num_bytes, correct, **common))
        finally:
            server.stop()
    return records


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo", help="the group's backend")
    parser.add_argument("--ipc", action="store_true", help="also push through CUDA IPC handles (CUDA only)")
    parser.add_argument("--hidden-size", type=int, default=768)
    parser.add_argument("--intermediate-size", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument(
        "--bucket-mib",
        type=int,
        default=DEFAULT_BUCKET_BYTES >> 20,
        help="bucket bound of the group's pushes (default: the SDK's)",
    )
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the server")
    parser.add_argument("--rounds", type=int, default=5, help="pushes through each path (medians reported)")
    parser.add_argument(
        "--busy-neighbour", action="store_true", help="beside a process that keeps one CPU busy"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    for entry in run(parse_args(argv)):
        print(json.dumps(entry), flush=True)


if __name__ == "__main__":
    sys.exit(main())
