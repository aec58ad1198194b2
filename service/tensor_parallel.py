"""`cbserve serve --tp N`: one process per tensor-parallel rank; rank 0 serves gRPC, the others follow.

`launch` starts the N ranks the way `torchrun` does (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT), so `torchrun --nproc-per-node N -m service serve ...` works as well. The difference is
signals: `launch` hands SIGTERM and SIGINT to rank 0 alone, which drains, stops the engine on every rank
and exits; the followers then exit on their own. If any rank fails, the others are stopped.

`follow` is a non-driver rank: it loads its shard, runs the engine loop the driver's ticks dictate
(engine.parallel) and exits when that loop ends: 0 once the driver's engine is destroyed (a stop only
holds the loop until `Admin.Start`), 1 when the loop failed.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import time

import torch

from engine import (
    ContinuousBatchingConfig,
    ContinuousBatchingManager,
    call_on_steps_thread,
    default_num_threads,
    torchrun_environment,
)
from service.model_loading import load_pretrained

logger = logging.getLogger(__name__)

POLL_S = 0.2
PR_SET_PDEATHSIG = 1  # linux/prctl.h
# How long followers get to end after rank 0 exited before they are killed (they end with its loop).
FOLLOWER_EXIT_GRACE_S = 30.0


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _die_with_parent() -> None:
    """Runs in each rank before it starts: the kernel kills the rank if the launcher dies, even by
    SIGKILL, so no rank outlives it holding its port and memory (Linux; elsewhere a no-op)."""
    if sys.platform != "linux":
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def launch(serve_argv: list[str], tp_size: int) -> int:
    """Runs `cbserve serve <serve_argv>` as `tp_size` ranks; returns rank 0's exit status."""
    port = _free_port()
    ranks: list[subprocess.Popen[bytes]] = []
    for rank in range(tp_size):
        env = {**os.environ, **torchrun_environment(rank, tp_size, port)}
        command = [sys.executable, "-m", "service", "serve", *serve_argv]
        ranks.append(subprocess.Popen(command, env=env, preexec_fn=_die_with_parent))
    driver = ranks[0]

    def forward(signum: int, _frame: object) -> None:
        if driver.poll() is None:
            driver.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    try:
        while driver.poll() is None:
            failed = [process for process in ranks[1:] if process.poll() not in (None, 0)]
            if failed:
                rank, code = ranks.index(failed[0]), failed[0].returncode
                logger.error("rank %d exited with %s: stopping rank 0", rank, code)
                driver.terminate()
            time.sleep(POLL_S)
        deadline = time.monotonic() + FOLLOWER_EXIT_GRACE_S
        for process in ranks[1:]:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.error("rank %d did not end with rank 0: killing it", ranks.index(process))
                process.kill()
                process.wait()
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
                process.wait()
    codes = [process.returncode for process in ranks]
    return driver.returncode or next((code for code in codes if code), 0)


def follow(model_path: str, config: ContinuousBatchingConfig, dtype: str = "auto") -> int:
    """Runs a non-driver rank until the driver destroys the engine; 0 then, 1 if the loop failed."""
    # Signals are rank 0's to handle: it drains, then its stop ends this rank's loop too.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # On a thread that ends, as the driver's loading does (`CbserveServer.load` says why).
    model, tokenizer = call_on_steps_thread(
        lambda: load_pretrained(model_path, dtype=dtype),
        default_num_threads(torch.get_num_threads()),
        "cbserve-load",
    )
    # Every rank masks structured-output logits alike, so each needs the grammars and their tokenizer.
    manager = ContinuousBatchingManager(model, continuous_batching_config=config, tokenizer=tokenizer)
    manager.start()
    manager.join()
    error = manager.loop_error
    manager.destroy()
    if error is not None:
        logger.error("rank loop failed: %s", error)
        return 1
    return 0


def strip_tp_flag(argv: list[str]) -> list[str]:
    """`argv` of `cbserve serve` without its `--tp` flag (the ranks read their size from WORLD_SIZE)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--tp", type=int)
    _, rest = parser.parse_known_args(argv)
    return rest
