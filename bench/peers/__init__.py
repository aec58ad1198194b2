"""cbserve against the engines a CPU user would pick instead, vLLM's CPU build and llama.cpp, side by side.

    python -m bench.peers setup     # installs the peers under <cbserve cache>/peers (skips what is there)
    python -m bench.peers run       # setup, then the workloads in alternating rounds: JSON on stdout,
                                    # bench/peers/RESULTS.md and bench/peers/peers.png

See bench/peers/README.md for what is measured and how the peers are built.
"""
