#!/usr/bin/env bash
# The project's one test command (README "Run the tests"): install, lint, type-check, test.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --quiet --disable-pip-version-check -e sdk/python -e ".[dev]"
npm ci --prefix proto --silent --no-audit --no-fund
python3 -m ruff check engine service tests sdk/python
python3 -m ruff format --check engine service tests sdk/python
python3 -m mypy engine service
python3 -m mypy --strict sdk/python/cbserve_client
# pytest exits 5 when it collected nothing; that is a failure here, as is any other non-zero status.
python3 -m pytest -q -p no:cacheprovider "$@"
