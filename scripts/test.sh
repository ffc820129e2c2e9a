#!/usr/bin/env bash
# Run the test suite: creates .venv and installs llm-swarm with its test extras if needed.
# Extra arguments go to pytest, e.g. scripts/test.sh -k spans -x
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
source scripts/_system_packages.sh
ensure_venv test
ensure_system_packages
.venv/bin/ruff check .
exec .venv/bin/python -m pytest "$@"
