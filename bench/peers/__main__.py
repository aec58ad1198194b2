"""`python -m bench.peers {setup,run}`: see the package's docstring."""

from __future__ import annotations

# isort: off
# First, before torch loads libgomp: the floor measurement runs torch in this process with the server's
# OpenMP settings (service/openmp.py), as the other benchmarks do.
import service  # noqa: F401

# isort: on
import argparse
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from bench.peers.cache import PeerCache
from bench.peers.runner import DEFAULT_ENGINES, ENGINES, run, setup_peers

PACKAGE_DIR = Path(__file__).resolve().parent


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.peers", description=__doc__)
    parser.add_argument("--cache-dir", help="where the peers are installed (default: <cbserve cache>/peers)")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("setup", help="install the peers, skipping what is there")
    run_parser = commands.add_parser("run", help="setup, then run the workloads and write the report")
    run_parser.add_argument("--engines", nargs="+", choices=sorted(ENGINES), default=list(DEFAULT_ENGINES))
    run_parser.add_argument("--rounds", type=int, default=3)
    run_parser.add_argument("--chats", type=int, default=32, help="chat prompts sent at once")
    run_parser.add_argument("--max-new-tokens", type=int, default=128)
    run_parser.add_argument("--concurrent", type=int, default=64, help="requests of the concurrent workload")
    run_parser.add_argument("--concurrent-new-tokens", type=int, default=64)
    run_parser.add_argument(
        "--threads", type=int, default=2, help="the peers' compute threads, and the floor's"
    )
    run_parser.add_argument("--no-floor", action="store_true", help="skip the weight-reading floor")
    run_parser.add_argument(
        "--neighbour", action="store_true", help="run the rounds beside one busy process pinned to CPU 0"
    )
    run_parser.add_argument("--note", help="a sentence added under the table")
    run_parser.add_argument("--out", default=str(PACKAGE_DIR), help="folder of RESULTS.md and peers.png")
    args = parser.parse_args(argv)
    if args.command == "run":
        numbers = (args.rounds, args.chats, args.max_new_tokens, args.concurrent, args.concurrent_new_tokens)
        if min(numbers) < 1:
            parser.error(
                "--rounds, --chats, --max-new-tokens, --concurrent and --concurrent-new-tokens must be >= 1"
            )
    return args


def main(argv: Sequence[str] | None = None) -> None:
    # SIGTERM unwinds like Ctrl-C, so that the servers (each in a session of its own, which a terminal's
    # Ctrl-C does not reach) are stopped by the run's cleanup.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    args = parse_args(argv)
    if args.command == "setup":
        cache = PeerCache(Path(args.cache_dir)) if args.cache_dir else PeerCache.default()
        _, errors = setup_peers(cache, {"llama.cpp", "vllm"})
        sys.exit(1 if errors else 0)
    run(args)


if __name__ == "__main__":
    main()
