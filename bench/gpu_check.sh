#!/usr/bin/env bash
# The GPU check of issue 6: one prepared script for a machine with one GPU and no network.
#
#   wheels    installs the wheels carried in .whl/, if any (the H200 image needs none; see bench/README.md)
#   env       nvidia-smi, Python, torch and package versions, and which imports the check needs are missing
#   parity    tests/engine/test_greedy_parity.py with the tiny fp32 models on the GPU (CBSERVE_TEST_DEVICE)
#   paths     tests/engine/test_forward_paths.py and test_paged_attention_kernel.py on the GPU: decode and varlen
#             CUDA graphs (parity, warmup capture), static-shape compilation and the Triton attention kernel, less the
#             inductor compile test (its CPU run covers it)
#   async     tests/engine/test_async_batching.py on the GPU: steps launched ahead of their predecessor's tokens
#   quantization  tests/engine/test_quantization_gpu_formats.py on the GPU (issue 35): fp8 weights through
#             cuBLASLt's scaled matmul and int4 through tinygemm, their bounds, the engine against generate on the
#             same layers, and updates quantized into them
#   batch_invariant  tests/engine/test_batch_invariance.py on the GPU (issue 33): a needle alone and in random
#             batches, prefix hits, chunked prefill, preemption, n = 4, the trainer's forward, bitwise, through
#             the Triton matmul, row mean and fixed-tile attention; and the negative control
#   batch_invariance_probe  bench/batch_invariance.py --device cuda: which of the GPU's kernels give a row other
#             bits with the batch (cuBLAS, torch's reductions and softmaxes, the attention kernel's tiles)
#             and which of the mode's do not, then the engine end to end in both modes
#   bench     bench/offline_throughput.py: Qwen3-0.6B shapes (random weights), bf16, 256 requests, prompts
#             uniform in 16..256 tokens, 64 greedy new tokens; cbserve (with CUDA graphs of both paths and the attention
#             kernel when the paths step passed, unless GPU_CHECK_CUDA_GRAPHS=0; with async batching when the
#             async step passed), transformers_cb and static; cbserve on fp8 and int4 copies of the model when the
#             quantization step passed
#   sampling  tests/engine/test_sampling.py and test_penalties.py on the GPU, less the sampling logprobs test,
#             whose tensors stay on the CPU
#   cuda_ipc  tests/engine/test_cuda_ipc.py: weights copied from another process's CUDA tensors
#   weight_sync bench/weight_sync.py --ipc: a ~125M fp32 model pushed into a server on the GPU over gRPC, over a
#             gloo weight-update group and through CUDA IPC (NCCL needs a second GPU: one communicator refuses
#             two ranks on one device)
#
# Each step runs under `timeout`, within one overall budget, and $OUT/gpu_check.json is rewritten after every
# step: a step that fails, hangs or is killed leaves the results of the steps before it. $OUT/gpu_check.log
# holds every step's full output. Exit status: 0 when every step passed or was skipped.
#
#   OUT=/some/folder bash bench/gpu_check.sh                       # on the GPU machine, from the repo root
#   GPU_CHECK_DEVICE=cpu GPU_CHECK_SMALL=1 bash bench/gpu_check.sh  # dry run on a CPU, about 80 s on 2 cores
#
# Knobs (environment): OUT (default bench/results/gpu_check), GPU_CHECK_DEVICE (cuda), GPU_CHECK_DTYPE
# (bfloat16), GPU_CHECK_SMALL (0; 1 = tiny model, 8 requests, a few tests), GPU_CHECK_REPEATS (1),
# GPU_CHECK_BUDGET_S (450: steps are cut to fit it, and the check ends within about 15 s of it),
# GPU_CHECK_WHEELS (.whl), GPU_CHECK_CUDA_GRAPHS (1), GPU_CHECK_BATCH_INVARIANT (1; 0 skips its two steps),
# PYTHON (python3).
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO" || exit 2
OUT_DIR=${OUT:-$REPO/bench/results/gpu_check}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
DTYPE=${GPU_CHECK_DTYPE:-bfloat16}
SMALL=${GPU_CHECK_SMALL:-0}
REPEATS=${GPU_CHECK_REPEATS:-1}
BUDGET_S=${GPU_CHECK_BUDGET_S:-450}
WHEELS=${GPU_CHECK_WHEELS:-.whl}
CUDA_GRAPHS=${GPU_CHECK_CUDA_GRAPHS:-1}
BATCH_INVARIANT=${GPU_CHECK_BATCH_INVARIANT:-1}
PYTHON=${PYTHON:-python3}
# Seconds kept back at the end for the last merge, and the least a step is started with.
RESERVE_S=5
MIN_STEP_S=15

mkdir -p "$OUT_DIR" || exit 2
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX") || exit 2
LOG=$OUT_DIR/gpu_check.log
JSON=$OUT_DIR/gpu_check.json
: >"$LOG"
: >"$WORK/steps"
DEADLINE=$((SECONDS + BUDGET_S))
STARTED=$(date +%s.%N)

export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1

# Folds every step's status, log and structured output under $WORK into $JSON (stdlib only, so it runs even
# when the packages under test do not import). Written to a temporary file and renamed: a reader never sees
# half a file.
read -r -d '' MERGE_PY <<'PY'
import json
import os
import sys
import time
from xml.etree import ElementTree

work, json_path, device, dtype, small, budget_s, started, state = sys.argv[1:9]


def read(name):
    try:
        with open(os.path.join(work, name), encoding="utf-8", errors="replace") as file:
            return file.read()
    except OSError:
        return None


OUTCOMES = ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS")


def tail(text, limit):
    return text if len(text) <= limit else "..." + text[-limit:]


def counts_from_log(log):
    """Counts of the tests that finished, from pytest's `-v` lines ("path::test OUTCOME [ n%]")."""
    results = [line.split()[:2] for line in log.splitlines() if "::" in line and len(line.split()) > 1]
    results = [(test, outcome) for test, outcome in results if outcome in OUTCOMES]
    if not results:
        return None
    outcomes = [outcome for _, outcome in results]
    return {
        "incomplete": True,
        "tests": len(results),
        "passed": outcomes.count("PASSED"),
        "failures": outcomes.count("FAILED"),
        "errors": outcomes.count("ERROR"),
        "skipped": outcomes.count("SKIPPED"),
        "failed_tests": [test for test, outcome in results if outcome in ("FAILED", "ERROR")],
    }


def pytest_counts(name):
    """Counts from the step's junit xml, or from its log when pytest was stopped before writing the xml."""
    text = read(f"{name}.xml")
    if text is None:
        return counts_from_log(read(f"{name}.log") or "")
    try:
        root = ElementTree.fromstring(text)
    except ElementTree.ParseError as error:
        return {"error": f"unreadable junit xml: {error}"}
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    failed = []
    for suite in root.iter("testsuite"):
        for key in counts:
            counts[key] += int(suite.get(key, 0))
    for case in root.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(f"{case.get('classname')}::{case.get('name')}")
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    counts["failed_tests"] = failed
    return counts


def bench():
    text = read("bench.jsonl")
    if text is None:
        return None
    records = []
    for line in text.splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            pass
    engines = {}
    for record in records:
        if "error" in record:
            engines[record["engine"]] = {"error": record["error"], "tokens_per_s": None}
            continue
        if "tokens_per_s" not in record:
            continue
        parity = record.get("parity_vs_static")
        engines[record["engine"]] = {
            key: record.get(key)
            for key in ("tokens_per_s", "median_s", "wall_s", "mfu", "requests_with_exact_new_tokens",
                        "repeat_consistent", "parity_vs_static", "first_token_parity_vs_static")
        }
        engines[record["engine"]]["outputs_equal_to_static"] = (
            None if parity is None else f"{round(parity * record['requests'])}/{record['requests']}"
        )
    summary = next((record for record in records if record.get("summary")), None)
    breakdown = next((record for record in records if "step_breakdown_s" in record), None)
    return {"engines": engines, "summary": summary, "cbserve_step_breakdown": breakdown}


steps = []
for name in (read("steps") or "").split():
    status = dict(line.split("=", 1) for line in (read(f"{name}.status") or "").splitlines() if "=" in line)
    log = read(f"{name}.log") or ""
    step = {"name": name, "command": (read(f"{name}.cmd") or "").strip()}
    if "skipped" in status:
        step.update(status="skipped", reason=status["skipped"])
    elif "out_of_time" in status:
        step.update(status="out_of_time", reason=status["out_of_time"])
    elif "rc" not in status:
        step.update(status="running or killed", limit_s=int(status.get("limit_s", 0)))
    else:
        rc = int(status["rc"])
        step.update(
            status="passed" if rc == 0 else "timed_out" if rc in (124, 137) else "failed",
            rc=rc,
            seconds=round(float(status["ended"]) - float(status["started"]), 1),
            limit_s=int(status["limit_s"]),
        )
    step["log_tail"] = tail(log, 600 if step["status"] in ("passed", "skipped") else 4000)
    steps.append(step)

result = {
    "check": "bench/gpu_check.sh",
    "state": state,
    "device": device,
    "dtype": dtype,
    "small": small == "1",
    "budget_s": int(budget_s),
    "elapsed_s": round(time.time() - float(started), 1),
    "summary": {},
    "steps": steps,
    "env": json.loads(read("env.json") or "null"),
    "parity": pytest_counts("parity"),
    "paths": pytest_counts("paths"),
    "async": pytest_counts("async"),
    "quantization": pytest_counts("quantization"),
    "sampling": pytest_counts("sampling"),
    "cuda_ipc": pytest_counts("cuda_ipc"),
    "batch_invariant": pytest_counts("batch_invariant"),
    "batch_invariance_probe": [
        json.loads(line)
        for line in (read("batch_invariance.jsonl") or "").splitlines()
        if line.startswith("{")
    ],
    "bench": bench(),
    "weight_sync": [
        json.loads(line) for line in (read("weight_sync.jsonl") or "").splitlines() if line.startswith("{")
    ],
}
summary = result["summary"]
summary["steps"] = {step["name"]: step["status"] for step in steps}
summary["all_passed"] = state == "finished" and all(
    step["status"] in ("passed", "skipped") for step in steps
)
for name in ("parity", "paths", "async", "quantization", "sampling", "cuda_ipc", "batch_invariant"):
    counts = result[name]
    if counts and "tests" in counts:
        finished_tests = " (stopped early: of the tests that finished)" if counts.get("incomplete") else ""
        summary[name] = f"{counts['passed']}/{counts['tests']} passed{finished_tests}"
if result["bench"]:
    engines = result["bench"]["engines"]
    summary["tokens_per_s"] = {name: values["tokens_per_s"] for name, values in engines.items()}
    summary["outputs_equal_to_static"] = {
        name: values.get("outputs_equal_to_static") for name, values in engines.items() if name != "static"
    }
    summary["engine_errors"] = {name: values["error"] for name, values in engines.items() if "error" in values}
    if result["bench"]["summary"]:
        summary["cbserve_vs_transformers_cb"] = result["bench"]["summary"].get("cbserve_vs_transformers_cb")
        summary["cbserve_vs_static"] = result["bench"]["summary"].get("cbserve_vs_static")
        summary["cbserve_vs_cbserve_defaults"] = result["bench"]["summary"].get("cbserve_vs_cbserve_defaults")
        summary["quantized_speedup"] = result["bench"]["summary"].get("quantized_speedup")
probe = result["batch_invariance_probe"]
if probe:
    # What varies with the batch on this device, and whether the engine's needle kept its bits in each mode.
    summary["batch_invariance_varies"] = [
        " ".join(str(part) for part in (record["op"], record.get("library", ""), record.get("sliding_window", "")))
        + f": {record['varies']}"
        for record in probe
        if record.get("varies") and record["op"] != "engine"
    ]
    summary["batch_invariance_engine"] = {
        f"batch_invariant={record['batch_invariant']}": {
            key: record[key]
            for key in ("tokens_equal", "logprobs_bitwise_equal", "trainer_forward_bitwise_equal")
        }
        for record in probe
        if record["op"] == "engine"
    }
temporary = json_path + ".tmp"
with open(temporary, "w", encoding="utf-8") as file:
    json.dump(result, file, indent=1)
    file.write("\n")
os.replace(temporary, json_path)
PY

merge() {
  "$PYTHON" -c "$MERGE_PY" "$WORK" "$JSON" "$DEVICE" "$DTYPE" "$SMALL" "$BUDGET_S" "$STARTED" "$1" ||
    echo "gpu_check: could not write $JSON" >&2
}

# run_step NAME LIMIT_S COMMAND...: runs COMMAND under `timeout` for at most LIMIT_S seconds, less if the
# overall budget has less left, and records its status, command and output under $WORK.
run_step() {
  local name=$1 limit=$2
  shift 2
  local left=$((DEADLINE - SECONDS - RESERVE_S))
  ((left < limit)) && limit=$left
  echo "$name" >>"$WORK/steps"
  printf '%q ' "$@" >"$WORK/$name.cmd"
  if ((limit < MIN_STEP_S)); then
    echo "out_of_time=$((left > 0 ? left : 0)) s left of the ${BUDGET_S} s budget" >"$WORK/$name.status"
    echo "== $name: not run, out of time" | tee -a "$LOG"
    merge running
    return 1
  fi
  printf 'limit_s=%s\nstarted=%s\n' "$limit" "$(date +%s.%N)" >"$WORK/$name.status"
  merge running
  echo "== $name (at most ${limit} s): $*" | tee -a "$LOG"
  timeout --kill-after=10 "$limit" "$@" >"$WORK/$name.log" 2>&1
  local rc=$?
  printf 'rc=%s\nended=%s\n' "$rc" "$(date +%s.%N)" >>"$WORK/$name.status"
  cat "$WORK/$name.log" >>"$LOG"
  echo "== $name: exit status $rc" | tee -a "$LOG"
  merge running
  return "$rc"
}

skip_step() {
  echo "$1" >>"$WORK/steps"
  echo "skipped=$2" >"$WORK/$1.status"
  echo "== $1: skipped, $2" | tee -a "$LOG"
  merge running
}

# 1. Carried wheels: installed into a folder of their own that shadows the image's packages.
shopt -s nullglob
wheels=("$WHEELS"/*.whl)
shopt -u nullglob
if ((${#wheels[@]})); then
  site=$WORK/site
  run_step wheels 60 "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target "$site" "${wheels[@]}"
  export PYTHONPATH="$REPO:$site${PYTHONPATH#"$REPO"}"
else
  skip_step wheels "no wheels in $WHEELS/"
fi

# 2. Environment.
run_step env 60 "$PYTHON" - "$WORK/env.json" <<'PY'
import importlib
import importlib.metadata
import json
import os
import platform
import subprocess
import sys


def command(*argv):
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"unavailable: {error}"
    return (done.stdout + done.stderr).strip()


env = {
    "python": sys.version.split()[0],
    "executable": sys.executable,
    "platform": platform.platform(),
    "cpu_count": os.cpu_count(),
    "git_commit": command("git", "rev-parse", "HEAD"),
    "nvidia_smi": command(
        "nvidia-smi",
        "--query-gpu=name,driver_version,memory.total,memory.used,clocks.max.sm,temperature.gpu",
        "--format=csv,noheader",
    ),
    "packages": {},
    "missing_imports": {},
}
for package in ("torch", "transformers", "triton", "numpy", "psutil", "safetensors", "tqdm", "pytest",
                "pytest-timeout", "hypothesis", "accelerate"):
    try:
        env["packages"][package] = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        env["packages"][package] = None
# What the engine, the benchmark and the tests import.
for module in ("torch", "transformers", "numpy", "psutil", "safetensors", "tqdm", "pytest", "engine"):
    try:
        importlib.import_module(module)
    except Exception as error:
        env["missing_imports"][module] = f"{type(error).__name__}: {error}"
try:
    import torch

    env["torch_cuda"] = torch.version.cuda
    env["cuda_available"] = torch.cuda.is_available()
    if torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(0)
        env["gpu"] = {
            "name": properties.name,
            "count": torch.cuda.device_count(),
            "capability": f"{properties.major}.{properties.minor}",
            "memory_gib": round(properties.total_memory / 2**30, 1),
            "multiprocessors": properties.multi_processor_count,
            "bf16_supported": torch.cuda.is_bf16_supported(),
        }
except Exception as error:
    env["torch_error"] = f"{type(error).__name__}: {error}"
print(json.dumps(env, indent=1))
with open(sys.argv[1], "w", encoding="utf-8") as file:
    json.dump(env, file)
PY

# 3. Greedy parity on the device. In a small run, a few of the tests.
parity_select=()
paths_select=(-k "not inductor and not warns and not compiles_nothing")
sampling_select=(-k "not logprobs")
if [[ $SMALL == 1 ]]; then
  parity_select=(-k "generate_batch_returns or chunked_prefill")
  paths_select=(-k "padded_sizes or cuda_graphs or warmup or kernel_path_keeps")
  sampling_select=(-k "limits_of_sampling and not logprobs")
fi
run_step parity 120 env CBSERVE_TEST_DEVICE="$DEVICE" "$PYTHON" -m pytest tests/engine/test_greedy_parity.py \
  -v -p no:cacheprovider -o timeout=90 --junitxml="$WORK/parity.xml" "${parity_select[@]}"

# 4. Forward paths on the device: decode and varlen CUDA graphs, static-shape compilation, the attention kernel.
run_step paths 120 env CBSERVE_TEST_DEVICE="$DEVICE" "$PYTHON" -m pytest tests/engine/test_forward_paths.py \
  tests/engine/test_paged_attention_kernel.py -v -p no:cacheprovider -o timeout=80 --junitxml="$WORK/paths.xml" \
  "${paths_select[@]}"
paths_passed=$?

# 4b. Async batching on the device: steps launched ahead, tokens fed back on the device.
async_select=()
[[ $SMALL == 1 ]] && async_select=(-k "llama or eos or never_waits")
run_step async 60 env CBSERVE_TEST_DEVICE="$DEVICE" "$PYTHON" -m pytest tests/engine/test_async_batching.py \
  -v -p no:cacheprovider -o timeout=50 --junitxml="$WORK/async.xml" "${async_select[@]}"
async_passed=$?

# 4b'. Quantized weights on the device: fp8 (cuBLASLt's scaled matmul) and int4 (tinygemm).
run_step quantization 90 env CBSERVE_TEST_DEVICE="$DEVICE" "$PYTHON" -m pytest \
  tests/engine/test_quantization_gpu_formats.py -v -p no:cacheprovider -o timeout=80 \
  --junitxml="$WORK/quantization.xml"
quantization_passed=$?

# 4c. Batch-invariant mode on the device (issue 33): its tests, then what varies on this GPU and what does not.
if [[ $BATCH_INVARIANT == 1 ]]; then
  invariant_select=()
  probe_workload=(--others 31 --new-tokens 32)
  if [[ $SMALL == 1 ]]; then
    invariant_select=(-k "llama-1 or default_mode or cuda_kernels or trains and llama")
    probe_workload=(--others 7 --new-tokens 8)
  fi
  run_step batch_invariant 90 env CBSERVE_TEST_DEVICE="$DEVICE" "$PYTHON" -m pytest \
    tests/engine/test_batch_invariance.py -v -p no:cacheprovider -o timeout=80 \
    --junitxml="$WORK/batch_invariant.xml" "${invariant_select[@]}"
  run_step batch_invariance_probe 60 bash -c '"$@" > "$0"' "$WORK/batch_invariance.jsonl" "$PYTHON" \
    bench/batch_invariance.py --device "$DEVICE" --model tiny --batch-invariant "${probe_workload[@]}"
else
  skip_step batch_invariant "GPU_CHECK_BATCH_INVARIANT=0"
  skip_step batch_invariance_probe "GPU_CHECK_BATCH_INVARIANT=0"
fi

# 5. Offline throughput.
if [[ $SMALL == 1 ]]; then
  workload=(--model tiny --requests 8 --new-tokens 8 --max-prompt 64 --warmup-requests 2 --matmul-size 256)
else
  workload=(--model qwen3-0.6b --requests 256 --new-tokens 64 --min-prompt 16 --max-prompt 256
    --static-batch-size 64)
fi
# cbserve's GPU paths go into the benchmark only once their parity tests passed on this GPU.
graphs=()
[[ $CUDA_GRAPHS == 1 && $DEVICE == cuda && $paths_passed == 0 ]] && graphs=(--cuda-graphs --max-blocks-per-request 64)
[[ $DEVICE == cuda && $async_passed == 0 ]] && graphs+=(--async-batching)
# With opt-in paths on, cbserve also runs without them: their gain, measured in the same run, and a cbserve
# figure even if they fail.
engines=(cbserve transformers_cb static)
[[ ${#graphs[@]} -gt 0 ]] && engines+=(cbserve_defaults)
[[ $DEVICE == cuda && $quantization_passed == 0 ]] && engines+=(cbserve_fp8 cbserve_int4)
run_step bench 200 "$PYTHON" bench/offline_throughput.py --device "$DEVICE" --dtype "$DTYPE" \
  "${workload[@]}" "${graphs[@]}" --engines "${engines[@]}" --repeats "$REPEATS" --keep-going \
  --json-out "$WORK/bench.jsonl"

# 6. Sampling on the device.
run_step sampling 60 env CBSERVE_TEST_DEVICE="$DEVICE" "$PYTHON" -m pytest tests/engine/test_sampling.py \
  tests/engine/test_penalties.py \
  -v -p no:cacheprovider -o timeout=60 --junitxml="$WORK/sampling.xml" "${sampling_select[@]}"

# 7. Weight sync on the device: weights from another process's CUDA tensors, then the push benchmark.
run_step cuda_ipc 90 env CBSERVE_TEST_DEVICE="$DEVICE" "$PYTHON" -m pytest tests/engine/test_cuda_ipc.py \
  -v -p no:cacheprovider -o timeout=80 --junitxml="$WORK/cuda_ipc.xml"
if [[ $SMALL == 1 ]]; then
  sync_model=(--hidden-size 96 --intermediate-size 192 --layers 2 --vocab-size 256)  # 12 heads of 8
else
  sync_model=()
fi
sync_ipc=()
[[ $DEVICE == cuda ]] && sync_ipc=(--ipc)
run_step weight_sync 150 bash -c '"$@" > "$0"' "$WORK/weight_sync.jsonl" "$PYTHON" -m bench.weight_sync \
  "${sync_model[@]}" "${sync_ipc[@]}"

merge finished
rm -rf "$WORK"
echo "gpu_check: wrote $JSON"
"$PYTHON" -c 'import json, sys; print(json.dumps(json.load(open(sys.argv[1]))["summary"], indent=1))' "$JSON"
"$PYTHON" -c 'import json, sys; sys.exit(0 if json.load(open(sys.argv[1]))["summary"]["all_passed"] else 1)' "$JSON"
