"""A trainer that dies in the middle of a push: it forms a weight-update group with one server, announces
two buckets, broadcasts the first, prints "sent 1 of 2" and waits to be killed.

    python dying_trainer.py ADMIN_TARGET TOKEN PORT SEED
"""

from __future__ import annotations

import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from cbserve_client import AdminClient, plan_buckets

from tests.conftest import seeded_tiny_llama

TIMEOUT_S = 5.0


def main(admin_target: str, token: str, port: int, seed: int) -> None:
    state = seeded_tiny_llama(seed).state_dict()
    timeout = timedelta(seconds=TIMEOUT_S)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=timeout, wait_for_workers=False)
    with AdminClient(admin_target, token) as admin:
        joined = threading.Thread(
            target=admin.init_weights_update_group,
            args=("127.0.0.1", port, 1, 2),
            kwargs={"backend": "gloo", "group_timeout_s": TIMEOUT_S},
        )
        joined.start()
        group = dist.ProcessGroupGloo(dist.PrefixStore("weights", store), 0, 2, timeout)
        group.broadcast(torch.zeros(1, dtype=torch.uint8), 0).wait()
        joined.join()
        names = list(state)
        specs = [
            (name, str(value.dtype), tuple(value.shape), value.numel() * value.element_size())
            for name, value in state.items()
        ]
        first_bytes = sum(spec[3] for spec in specs[:2]) + 16
        buckets = plan_buckets(specs, bucket_bytes=first_bytes)
        transfer = admin.start_update_weights_from_distributed(buckets, version="never-finished")
        transfer.wait_ready()
        first = buckets[0]
        buffer = torch.zeros(first.num_bytes, dtype=torch.uint8)
        for entry in first.tensors:
            data = state[entry.name].contiguous().reshape(-1).view(torch.uint8)
            buffer[entry.byte_offset : entry.byte_offset + entry.num_bytes] = data
        group.broadcast(buffer, 0).wait()
        print(f"sent 1 of {len(buckets)} ({names[0]}...)", flush=True)
        while True:
            time.sleep(60)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
