"""Peak arithmetic of one CPU core in fp32 and in bf16 (`cpu_peak.c`), to read bf16 figures against.

Builds `cpu_peak.c` with the machine's C compiler (`$CC`, else `cc`) and prints its JSON line with the
CPU's bf16 features added. Needs an x86 CPU with AVX-512 and `avx512_bf16`.

    python bench/cpu_peak.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("cpu_peak.c")


def cpu_flags() -> set[str]:
    with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def main() -> int:
    flags = cpu_flags()
    features = {name: name in flags for name in ("avx512f", "avx512_bf16", "amx_bf16", "amx_tile")}
    if not (features["avx512f"] and features["avx512_bf16"]):
        print(json.dumps({"error": "needs AVX-512 with avx512_bf16", **features}))
        return 1
    with tempfile.TemporaryDirectory() as folder:
        binary = os.path.join(folder, "cpu_peak")
        compiler = os.environ.get("CC") or "cc"
        subprocess.run([compiler, "-O2", "-mavx512f", "-mavx512bf16", str(SOURCE), "-o", binary], check=True)
        result = json.loads(subprocess.run([binary], capture_output=True, text=True, check=True).stdout)
    result.pop("checksum")
    print(json.dumps({**result, **features}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
