"""OpenMP settings the server runs with: libgomp's own spin between parallel regions, never throttled.

torch on Linux runs its CPU ops on libgomp. A thread waiting for the next parallel region spins for a while
(300,000 iterations by default) before it sleeps, but once the process holds more OpenMP threads than
cores, libgomp cuts that spin to 1,000 iterations. The engine steps on a thread of its own with a team as
large as the machine, so a server always holds more: every small op of a step (norms, rotary, residual
adds: hundreds of parallel regions per step) then pays a sleeping worker's wake-up. Measured on a 2-core
CPU: a 74k-element multiply took 80-120 us throttled against 9-12 us spinning, and the embedded SmolLM2
generated 164 tokens/s spinning against 123 throttled (`bench/embedded_model.py`, 2026-12-02).

`OMP_WAIT_POLICY=ACTIVE` makes libgomp spin whatever the thread count, and `GOMP_SPINCOUNT` bounds that
spin at libgomp's own default, so a worker of an idle engine still sleeps within milliseconds. libgomp
reads both when it loads, so they are set before anything imports torch: the `service` package applies
them on import (its entry points import nothing else first), and its subprocesses (tensor-parallel ranks)
inherit them. A value the environment already holds is kept.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

OPENMP_DEFAULTS = {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "300000"}


def apply_openmp_defaults(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Sets each of `OPENMP_DEFAULTS` that `environ` lacks; returns the ones it set."""
    applied = {name: value for name, value in OPENMP_DEFAULTS.items() if name not in environ}
    environ.update(applied)
    return applied
