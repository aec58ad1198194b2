"""What a default `cbserve serve` start costs: seconds until its ports answer and until it is SERVING, the
first answer's latency, and the server's resident memory when SERVING and once its KV cache is backed.

Each round starts `cbserve serve` on the embedded SmolLM2-135M-Instruct with no flag but free ports, as the
README's Quick start does, and stops it with SIGTERM. `--fresh` points `$CBSERVE_CACHE_DIR` at an empty folder
first, so the round pays what a first start pays: converting the model and building the C kernels. Prints one
JSON line per round, then the median of each figure over the rounds.

    PYTHONPATH=. python bench/server_start.py --rounds 3
    PYTHONPATH=. python bench/server_start.py --rounds 1 --fresh
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from cbserve_client import Client

from bench.ports import free_ports

REPOSITORY = Path(__file__).resolve().parents[1]
POLL_S = 0.05
# The KV cache is backed by a thread at idle priority (`populate_kv_cache`): resident memory is taken as
# settled once it grew by less than this over SETTLE_S.
SETTLE_MIB = 8
SETTLE_S = 5.0
CHAT = [{"role": "user", "content": "What is the capital of France?"}]  # as `cbserve generate` asks


def _resident_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    match = re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE)
    return int(match.group(1)) / 1024 if match else 0.0


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


def _wait(condition: Any, timeout_s: float, what: str, server: subprocess.Popen[bytes]) -> float:
    """Seconds from now until `condition()` holds."""
    started = time.monotonic()
    while not condition():
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with {server.returncode} before {what}")
        if time.monotonic() - started > timeout_s:
            raise RuntimeError(f"no {what} within {timeout_s} s")
        time.sleep(POLL_S)
    return time.monotonic() - started


def one_round(cache_dir: str | None, log_path: Path) -> dict[str, Any]:
    port, admin_port = free_ports(2)
    environment = dict(os.environ)
    if cache_dir is not None:
        environment["CBSERVE_CACHE_DIR"] = cache_dir
    cbserve = str(Path(sys.executable).with_name("cbserve"))  # the virtual environment's, as a user runs it
    command = [cbserve, "serve", "--port", str(port), "--admin-port", str(admin_port)]
    with log_path.open("wb") as log:
        started = time.monotonic()
        server = subprocess.Popen(
            command, cwd=REPOSITORY, env=environment, stdout=log, stderr=subprocess.STDOUT
        )
    try:
        ports_open_s = _wait(lambda: _answers(port), 300, "open port", server)
        with Client(f"127.0.0.1:{port}") as client:
            _wait(lambda: "serving " in log_path.read_text(errors="replace"), 600, "SERVING", server)
            serving_s = time.monotonic() - started
            serving_mib = _resident_mib(server.pid)
            asked = time.monotonic()
            answer = client.generate(CHAT, max_new_tokens=16)
            first_answer_s = time.monotonic() - asked
        resident, settled_at = serving_mib, time.monotonic()
        while time.monotonic() - settled_at < SETTLE_S:
            time.sleep(0.5)
            now = _resident_mib(server.pid)
            if now - resident >= SETTLE_MIB:
                resident, settled_at = now, time.monotonic()
        log_text = log_path.read_text(errors="replace")
        kv_cache = re.search(r"KV cache[^\n]*", log_text)
        # engine.system.native_library logs each C kernel it builds (a first start on this machine).
        built = re.findall(r"building (\S+) with", log_text)
        return {
            "bench": "server_start",
            "fresh_cache": cache_dir is not None,
            "ports_open_s": round(ports_open_s, 2),
            "serving_s": round(serving_s, 2),
            "first_answer_s": round(first_answer_s, 2),
            "first_answer": answer.text,
            "rss_mib_at_serving": round(serving_mib),
            "rss_mib_settled": round(resident),
            "kv_cache_log_line": kv_cache.group(0) if kv_cache else None,
            "c_kernels_built": built,
            "load_average": os.getloadavg()[0],
        }
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--fresh", action="store_true", help="an empty $CBSERVE_CACHE_DIR each round")
    args = parser.parse_args()
    rounds = []
    with tempfile.TemporaryDirectory() as scratch:
        for number in range(args.rounds):
            cache_dir = tempfile.mkdtemp(dir=scratch) if args.fresh else None
            result = one_round(cache_dir, Path(scratch) / f"server-{number}.log")
            print(json.dumps(result), flush=True)
            rounds.append(result)
    figures = ("ports_open_s", "serving_s", "first_answer_s", "rss_mib_at_serving", "rss_mib_settled")
    summary = {figure: statistics.median(result[figure] for result in rounds) for figure in figures}
    print(json.dumps({"bench": "server_start", "rounds": len(rounds), "fresh_cache": args.fresh, **summary}))


if __name__ == "__main__":
    main()
