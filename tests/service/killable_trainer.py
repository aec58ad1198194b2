"""Trainers to kill at chosen moments of a weight push: a host process that forks one trainer per push.

    python killable_trainer.py ADMIN_TARGET TOKEN

Importing torch and building a model takes seconds; forking a process that has done so takes
milliseconds, so the test kills as many trainers as it likes. The host reads one command per line on
stdin:

    push SEED BUCKET_BYTES GROUP_TIMEOUT_S PAUSE_AT

and forks a trainer that forms a gloo weight-update group with the server (it is rank 0), announces
`trainer_model(SEED)`'s state dict in buckets of at most BUCKET_BYTES, and broadcasts them, printing
one line per event on the shared stdout, each prefixed with its pid:

    PID started | PID joined | PID ready | PID sending K | PID sent K | PID done VERSION | PID failed ...

Every bucket is packed before its "sending" line, so the line comes just before its bytes go on the
wire: a test that kills on it kills the trainer while the server receives. With PAUSE_AT ("-" for none)
naming an event, the trainer stops itself with SIGSTOP right after printing it. SIGUSR1 makes a trainer
write its threads' stacks to stderr.

The host builds models with one torch thread and never opens a gRPC channel: a forked child would
inherit neither safely.
"""

from __future__ import annotations

import faulthandler
import functools
import os
import signal
import sys
import threading
from datetime import timedelta

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, LlamaConfig

# Embeddings and head of 16,000 x 256 fp32 (16 MB each, 56 MB in all): a bucket holding one takes long
# enough to send that a kill on its "sending" line lands while its bytes are on the wire.
TRAINER_CONFIG = LlamaConfig(
    vocab_size=16000,
    hidden_size=256,
    intermediate_size=1024,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)


@functools.cache
def trainer_model(seed: int) -> torch.nn.Module:
    """The model a trainer of `seed` pushes (the server starts from seed 0)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(TRAINER_CONFIG, attn_implementation="sdpa", dtype=torch.float32)
    return model.eval()


def print_line(text: str) -> None:
    """One line on the shared stdout in one write: a line of fewer than PIPE_BUF bytes then reaches the pipe
    whole or not at all. print() under PYTHONUNBUFFERED writes the text and its newline apart, so a trainer
    killed between the two left half a line, the next trainer's "PID started" was appended to it, and the
    test read the dead trainer's pid from the joined line and waited for it forever."""
    os.write(sys.stdout.fileno(), (text.replace("\n", " ") + "\n").encode())


def say(event: str, pause_at: str) -> None:
    print_line(f"{os.getpid()} {event}")
    if event.split(" ")[0] == pause_at:
        os.kill(os.getpid(), signal.SIGSTOP)


def push(
    admin_target: str, token: str, seed: int, bucket_bytes: int, timeout_s: float, pause_at: str
) -> None:
    """One trainer's life: form the group, push every tensor, leave."""
    from cbserve_client import AdminClient, plan_buckets

    state = trainer_model(seed).state_dict()
    say("started", pause_at)
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, timeout=timeout, wait_for_workers=False)
    with AdminClient(admin_target, token) as admin:
        joined = threading.Thread(
            target=admin.init_weights_update_group,
            args=("127.0.0.1", store.port, 1, 2),
            kwargs={"backend": "gloo", "group_timeout_s": timeout_s},
        )
        joined.start()
        group = dist.ProcessGroupGloo(dist.PrefixStore("weights", store), 0, 2, timeout)
        group.broadcast(torch.zeros(1, dtype=torch.uint8), 0).wait()
        joined.join()
        say("joined", pause_at)
        specs = [
            (name, str(value.dtype), tuple(value.shape), value.numel() * value.element_size())
            for name, value in state.items()
        ]
        buckets = plan_buckets(specs, bucket_bytes=bucket_bytes)
        transfer = admin.start_update_weights_from_distributed(buckets, version=f"seed-{seed}")
        transfer.wait_ready()
        say("ready", pause_at)
        for index, bucket in enumerate(buckets, start=1):
            buffer = torch.zeros(bucket.num_bytes, dtype=torch.uint8)
            for entry in bucket.tensors:
                data = state[entry.name].contiguous().reshape(-1).view(torch.uint8)
                buffer[entry.byte_offset : entry.byte_offset + entry.num_bytes] = data
            say(f"sending {index}", pause_at)
            group.broadcast(buffer, 0).wait()
            say(f"sent {index}", pause_at)
        update = transfer.wait_done()
        admin.destroy_weights_update_group()
        say(f"done {update.weight_version}", pause_at)


def main(admin_target: str, token: str) -> None:
    torch.set_num_threads(1)  # no OpenMP team in the host: a forked child could not use it
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # trainers that end are reaped at once
    trainer_model(0)
    print_line("host ready")
    for line in sys.stdin:
        _, seed, bucket_bytes, timeout_s, pause_at = line.split()
        trainer_model(int(seed))
        child = os.fork()
        if child == 0:
            # A test that waits on this trainer too long asks it where it is stuck (on stderr).
            faulthandler.register(signal.SIGUSR1, all_threads=True)
            try:
                push(admin_target, token, int(seed), int(bucket_bytes), float(timeout_s), pause_at)
            except BaseException as exc:
                print_line(f"{os.getpid()} failed {type(exc).__name__}: {exc}")
                os._exit(1)
            os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
