"""Seconds and GB/s to push a model's weights into a running `cbserve serve`: over the weight-update group
(one broadcast per bucket, `WeightSyncGroup.push`) and over gRPC (`AdminClient.update_weights`, chunks
with a sha256 each), in the same run, as an RL trainer pushes after every step; and the trainer's whole
call, `push_and_verify` over the group (the push, then the server's digest against the trainer's own),
phase by phase.

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

    python -m bench.weight_sync --checksum                          # GetWeightsChecksum, embedded model
    python -m bench.weight_sync --checksum --baseline-tree /tmp/old  # the same, alternating with a server
                                                                     # of another checkout (git archive)

`--checksum` measures the checksum a trainer asks for after a push, on the embedded SmolLM2-135M-Instruct
(float32, 0.5 GB): the call's seconds, and the longest gap between two tokens of a request streaming
beside it (generation waits while the engine digests its weights), against the longest gap of the same
stream without a checksum. With `--baseline-tree` a second server runs from that folder (its own engine,
service and SDK), and the rounds alternate between the two.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from cbserve_client import AdminClient, AdminFleet, Client, PushReport, WeightSyncGroup, push_and_verify
from cbserve_client._buckets import DEFAULT_BUCKET_BYTES
from transformers import AutoModelForCausalLM, LlamaConfig

from bench.serving_load import ServerProcess
from service.default_model import ensure_default_model

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
            with (
                AdminClient(admin_target, token=TOKEN, timeout=600) as admin,
                AdminFleet([admin_target], TOKEN, timeout=600) as fleet,
            ):
                trained = [seeded_model(config, seed, device) for seed in (1, 2)]
                num_parameters = sum(parameter.numel() for parameter in trained[0].parameters())
                num_bytes = sum(
                    value.numel() * value.element_size() for value in trained[0].state_dict().values()
                )
                common = {"parameters": num_parameters, "backend": args.backend, "rounds": args.rounds}
                times: dict[str, list[float]] = {"grpc": [], "group": [], "cuda_ipc": []}
                verified: list[PushReport] = []
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
                        model = trained[round_index % 2]
                        verified.append(push_and_verify(fleet, model.state_dict(), group=group))
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
                records.append(
                    record(
                        "push_and_verify",
                        [report.total_s for report in verified],
                        num_bytes,
                        correct,
                        **{
                            f"{phase}_median": round(
                                statistics.median(getattr(report, phase) for report in verified), 3
                            )
                            for phase in ("push_s", "trainer_checksum_s", "servers_checksum_s")
                        },
                        **common,
                    )
                )
                if args.ipc:
                    records.append(record("cuda_ipc", times["cuda_ipc"], num_bytes, correct, **common))
        finally:
            server.stop()
    return records


class StreamBeside:
    """A greedy request streaming many tokens, with the time each token arrived."""

    def __init__(self, target: str, num_tokens: int) -> None:
        self.arrivals: list[float] = []
        self._client = Client(target, timeout=600)
        self._thread = threading.Thread(target=self._read, args=(num_tokens,), daemon=True)
        self._thread.start()

    def _read(self, num_tokens: int) -> None:
        for _chunk in self._client.stream(PROMPT, max_new_tokens=num_tokens, ignore_eos=True, timeout=600):
            self.arrivals.append(time.perf_counter())

    def wait_tokens(self, count: int) -> None:
        while len(self.arrivals) < count and self._thread.is_alive():
            time.sleep(0.005)

    def longest_gap(self, start: float, end: float) -> float:
        """The longest wait for a token between `start` and `end` (a wait cut by either counts to it)."""
        times = [start, *(arrival for arrival in self.arrivals if start < arrival < end), end]
        return max(later - earlier for earlier, later in itertools.pairwise(times))

    def close(self) -> None:
        self._thread.join()
        self._client.close()


def checksum_round(server: ServerProcess) -> dict[str, float]:
    """One GetWeightsChecksum beside a streaming request: the call's seconds, the stream's longest gap
    while it ran, and the stream's longest gap over as long a window before it, with no checksum."""
    with AdminClient(f"127.0.0.1:{server.admin_port}", token=TOKEN, timeout=600) as admin:
        stream = StreamBeside(server.target, num_tokens=300)
        try:
            stream.wait_tokens(20)
            quiet_start = time.perf_counter()
            stream.wait_tokens(60)
            started = time.perf_counter()
            admin.weights_checksum()
            ended = time.perf_counter()
            seconds = ended - started
            stream.wait_tokens(len(stream.arrivals) + 5)
            return {
                "checksum_s": seconds,
                "stall_s": stream.longest_gap(started, ended + 1e-3),
                "quiet_gap_s": stream.longest_gap(quiet_start, started),
            }
        finally:
            stream.close()


def checksum_server(model_dir: str, tree: Path | None, log_path: Path, threads: int) -> ServerProcess:
    """`cbserve serve` of this checkout, or of `tree` (its engine, service and SDK first on the path)."""
    server_args = argparse.Namespace(page_size=16, max_batch_tokens=256, num_blocks=256, threads=threads)
    if tree is None:
        return ServerProcess(model_dir, log_path, server_args)
    # PYTHONSAFEPATH: `python -m` then leaves out its working folder (this checkout), so the tree's
    # packages on PYTHONPATH come before this checkout's, which the editable installs map.
    tree_path = {
        "PYTHONPATH": os.pathsep.join([str(tree), str(tree / "sdk" / "python")]),
        "PYTHONSAFEPATH": "1",
    }
    saved = {name: os.environ.get(name) for name in tree_path}
    os.environ.update(tree_path)
    try:
        server = ServerProcess(model_dir, log_path, server_args)
    finally:
        for name, value in saved.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value
    return server


def measure_checksum(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Rounds alternate between this checkout's server and the baseline's, when there is one."""
    model_dir = ensure_default_model()
    os.environ["CBSERVE_ADMIN_TOKEN"] = TOKEN
    num_bytes = sum(path.stat().st_size for path in Path(model_dir).glob("*.safetensors"))
    trees = {"this_tree": None} | ({"baseline": Path(args.baseline_tree)} if args.baseline_tree else {})
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    algorithms: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as folder:
        servers: dict[str, ServerProcess] = {}
        try:
            for name, tree in trees.items():
                servers[name] = checksum_server(model_dir, tree, Path(folder) / f"{name}.log", args.threads)
            for name, server in servers.items():
                server.wait_serving()
                with AdminClient(f"127.0.0.1:{server.admin_port}", token=TOKEN, timeout=600) as admin:
                    algorithms[name] = admin.weights_checksum().algorithm  # pages the weights in, untimed
            for _ in range(args.rounds):
                for name, server in servers.items():
                    rounds[name].append(checksum_round(server))
        finally:
            for server in servers.values():
                server.stop()
    records: list[dict[str, Any]] = []
    for name, measured in rounds.items():
        medians = {key: round(statistics.median(r[key] for r in measured), 4) for key in measured[0]}
        records.append(
            {
                "path": f"checksum_{name}",
                "algorithm": algorithms[name],
                "model_bytes": num_bytes,
                "rounds": args.rounds,
                **{f"median_{key}": value for key, value in medians.items()},
                "checksum_gb_per_s": round(num_bytes / medians["checksum_s"] / 1e9, 2),
                "checksum_s": [round(r["checksum_s"], 4) for r in measured],
                "stall_s": [round(r["stall_s"], 4) for r in measured],
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
    parser.add_argument(
        "--checksum", action="store_true", help="measure GetWeightsChecksum on the embedded model instead"
    )
    parser.add_argument(
        "--baseline-tree",
        help="with --checksum: a checkout (git archive) whose server alternates with this one",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    for entry in measure_checksum(args) if args.checksum else run(args):
        print(json.dumps(entry), flush=True)


if __name__ == "__main__":
    sys.exit(main())
