"""A toy RL loop against cbserve: rollouts -> one training step -> push the weights -> rollouts again.

    python examples/rl_loop.py                 # builds a tiny random llama, starts its own server
    python examples/rl_loop.py --target H:P --admin-target H:P --model-dir DIR   # a running server
    python examples/rl_loop.py --push grpc     # push through AdminClient.update_weights instead

The weights travel as RL frameworks send them: this process forms a weight-update group with the server
(it is rank 0; gloo here, NCCL between GPUs) and broadcasts each push in buckets (`WeightSyncGroup`).
`--push grpc` streams them through the admin API instead, the fallback when the trainer cannot reach the
server's ranks directly. Each rollout prints the weight_version that produced it, so tokens can be
attributed to weights.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time

import torch
from cbserve_client import AdminClient, Client, WeightSyncGroup
from transformers import AutoModelForCausalLM, LlamaConfig

TOKEN = "rl-loop-token"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)


def wait_ready(target: str, timeout: float = 120.0) -> None:
    deadline = time.time() + timeout
    while True:
        try:
            with Client(target, timeout=2) as client:
                client.model_info()
                return
        except Exception:
            if time.time() > deadline:
                raise
            time.sleep(0.5)


def rollouts(client: Client, prompts: list[list[int]], label: str) -> list[list[int]]:
    completions = []
    for index, prompt in enumerate(prompts):
        completion = client.generate(prompt, max_new_tokens=8, temperature=1.0, seed=index)
        tokens = list(completion.token_ids)
        print(f"[{label}] rollout {index}: tokens={tokens} weight_version={completion.weight_version}")
        completions.append(list(completion.token_ids))
    return completions


def train_step(model: torch.nn.Module, prompts: list[list[int]], completions: list[list[int]]) -> float:
    """One SGD step raising the log-likelihood of the rollouts (reward 1 for all, for the demo)."""
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    total = torch.zeros(())
    for prompt, completion in zip(prompts, completions, strict=True):
        ids = torch.tensor([prompt + completion])
        logits = model(ids).logits[0, len(prompt) - 1 : -1]
        total = total - torch.log_softmax(logits, -1).gather(1, torch.tensor(completion)[:, None]).mean()
    loss = total / len(prompts)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    model.eval()
    return float(loss.detach())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", help="generation address of a running server (else one is started)")
    parser.add_argument("--admin-target", help="admin address of that server")
    parser.add_argument("--model-dir", help="the server's model folder (to train the same weights)")
    parser.add_argument("--token", default=os.environ.get("CBSERVE_ADMIN_TOKEN", TOKEN))
    parser.add_argument("--iterations", type=int, default=2)
    parser.add_argument("--push", choices=("group", "grpc"), default="group", help="how weights travel")
    parser.add_argument(
        "--master-address", default="127.0.0.1", help="an address of this host the server can reach"
    )
    args = parser.parse_args()

    server: subprocess.Popen[bytes] | None = None
    workdir = tempfile.mkdtemp(prefix="cbserve-rl-")
    if args.target:
        if not args.admin_target or not args.model_dir:
            parser.error("--target needs --admin-target and --model-dir")
        model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
        target, admin_target = args.target, args.admin_target
    else:
        model = tiny_model()
        model.save_pretrained(workdir)
        port, admin_port = free_port(), free_port()
        target, admin_target = f"127.0.0.1:{port}", f"127.0.0.1:{admin_port}"
        env = dict(os.environ, CBSERVE_ADMIN_TOKEN=args.token)
        command = [sys.executable, "-m", "service", "serve", "--model", workdir]
        command += ["--port", str(port), "--admin-port", str(admin_port)]
        server = subprocess.Popen(command, env=env)
    try:
        wait_ready(target)
        prompts = [[1, 10 + index, 20 + index, 30 + index] for index in range(4)]
        with (
            Client(target, timeout=60) as client,
            AdminClient(admin_target, token=args.token, timeout=60) as admin,
            contextlib.ExitStack() as cleanup,
        ):
            group = None
            if args.push == "group":
                group = WeightSyncGroup.create(admin, master_address=args.master_address)
                cleanup.callback(group.close)
                print(f"weight-update group formed: {group.backend}, server ranks {group.server_ranks}")
            for iteration in range(args.iterations):
                completions = rollouts(client, prompts, f"iter {iteration}")
                loss = train_step(model, prompts, completions)
                version = f"step-{iteration + 1}"
                if group is not None:
                    (update,) = group.push(model.state_dict(), version=version)
                else:
                    update = admin.update_weights(dict(model.state_dict()), version=version)
                print(f"trained (loss {loss:.3f}); pushed weights -> weight_version {update.weight_version}")
            rollouts(client, prompts, "final")
            print("server weight_version:", admin.status().weight_version)
    finally:
        if server is not None:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()


if __name__ == "__main__":
    main()
