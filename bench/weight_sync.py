"""Seconds and GB/s to push a model's weights into a running `cbserve serve`: over the weight-update group
(one broadcast per bucket, `WeightSyncGroup.push`) and over gRPC (`AdminClient.update_weights`, chunks
with a sha256 each), in the same run, as an RL trainer pushes after every step.

    python bench/weight_sync.py                 # ~125M-parameter llama in fp32 (~0.5 GB), gloo, on the CPU
    python bench/weight_sync.py --ipc           # on a GPU: the server on it, gloo, and CUDA IPC from here
    python bench/weight_sync.py --backend nccl  # NCCL: the trainer and the server on different GPUs

NCCL refuses two ranks of one communicator on the same GPU, so on a one-GPU machine the group runs gloo
(host buffers, copied to the device as each bucket lands) and CUDA IPC measures the device-to-device path.

Every push is checked: the server then answers with the pushed model's greedy tokens. Prints one JSON
object per path and a last one with the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from cbserve_client import AdminClient, Client, WeightSyncGroup
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


def record(path: str, seconds: float, num_bytes: int, correct: bool, **extra: Any) -> dict[str, Any]:
    return {
        "path": path,
        "seconds": round(seconds, 3),
        "gb_per_s": round(num_bytes / seconds / 1e9, 3),
        "gigabytes": round(num_bytes / 1e9, 3),
        "serves_the_pushed_model": correct,
        **extra,
    }


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    config = model_config(args)
    # The trainer's tensors: on a GPU for NCCL (its second device, the server taking the first) and IPC.
    device = torch.device("cpu")
    if args.backend == "nccl":
        device = torch.device("cuda", 1)
    ipc_device = torch.device("cuda", 0)
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
                trained = [seeded_model(config, seed, device) for seed in (1, 2, 3)]
                num_parameters = sum(parameter.numel() for parameter in trained[0].parameters())
                num_bytes = sum(
                    value.numel() * value.element_size() for value in trained[0].state_dict().values()
                )
                common = {"parameters": num_parameters, "backend": args.backend}

                started = time.perf_counter()
                admin.update_weights(trained[0].state_dict(), version="grpc")
                records.append(
                    record(
                        "grpc",
                        time.perf_counter() - started,
                        num_bytes,
                        check_served(server.target, trained[0]),
                        **common,
                    )
                )

                created = time.perf_counter()
                with WeightSyncGroup.create(admin, master_address="127.0.0.1", backend=args.backend) as group:
                    formed_s = time.perf_counter() - created
                    for index, model in enumerate(trained[1:]):
                        started = time.perf_counter()
                        group.push(
                            model.state_dict(), version=f"group-{index}", bucket_bytes=args.bucket_mib << 20
                        )
                        seconds = time.perf_counter() - started
                        correct = check_served(server.target, model)
                        label = "group (first push)" if index == 0 else "group (warm)"
                        records.append(
                            record(
                                label,
                                seconds,
                                num_bytes,
                                correct,
                                group_formed_s=round(formed_s, 3),
                                **common,
                            )
                        )
                if args.ipc:
                    shared = seeded_model(config, 1, ipc_device).state_dict()
                    started = time.perf_counter()
                    admin.update_weights_from_ipc(shared, version="ipc")
                    records.append(
                        record(
                            "cuda_ipc",
                            time.perf_counter() - started,
                            num_bytes,
                            check_served(server.target, trained[0]),
                            **common,
                        )
                    )
        finally:
            server.stop()
    grpc_s = records[0]["seconds"]
    warm_s = records[2]["seconds"]
    records.append(
        {
            "summary": True,
            "group_warm_speedup_over_grpc": round(grpc_s / warm_s, 2),
            "group_first_speedup_over_grpc": round(grpc_s / records[1]["seconds"], 2),
            "load_average_1m": round(os.getloadavg()[0], 2),
            "cpu_count": os.cpu_count(),
        }
    )
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
    parser.add_argument("--bucket-mib", type=int, default=512, help="bucket bound of the group's pushes")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the server")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    for entry in run(parse_args(argv)):
        print(json.dumps(entry), flush=True)


if __name__ == "__main__":
    sys.exit(main())
