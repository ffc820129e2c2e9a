#!/usr/bin/env bash
# Run the test suite: creates .venv and installs llm-swarm with its test extras at the versions of
# requirements.lock (transformers 5) if needed. Extra arguments go to pytest, e.g.
#   scripts/test.sh -k spans -x
# `scripts/test.sh --compat [pytest args]` is the compatibility leg: the same checkout on the other
# supported transformers major (4.57, requirements-transformers4.lock) in its own .venv-compat, running
# the pure tests and the swarm tests marked `compat` (one per family through real servers,
# speculation, adapters, the API and its clients).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
source scripts/_system_packages.sh
if [ "${1:-}" = "--compat" ]; then
  shift
  ensure_venv test .venv-compat requirements-transformers4.lock
  ensure_system_packages
  .venv-compat/bin/python -c 'import transformers; print(f"compatibility leg: transformers {transformers.__version__}")'
  exec .venv-compat/bin/python -m pytest -m "not swarm or compat" "$@"
fi
ensure_venv test
ensure_system_packages
.venv/bin/ruff check .
exec .venv/bin/python -m pytest "$@"
