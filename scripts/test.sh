#!/usr/bin/env bash
# Run the test suite: creates .venv and installs llm-swarm with its test extras at the versions of
# requirements.lock (transformers 5) if needed. Extra arguments go to pytest, e.g.
#   scripts/test.sh -k spans -x
# `scripts/test.sh --compat [pytest args]` is the compatibility leg: the same checkout on the other
# supported transformers major (4.57, requirements-transformers4.lock), running the pure tests (but
# those marked `version_neutral`, whose code never touches transformers) and the swarm tests marked
# `compat` (real servers for each family whose code differs between the majors, speculation,
# adapters, the API and its clients). The packages whose versions differ between the two locks are installed into
# .compat-packages, which PYTHONPATH puts before .venv's own (for the test processes and every
# process they start), so the leg costs seconds to set up rather than a second full environment.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
source scripts/_system_packages.sh
ensure_venv test
ensure_system_packages
if [ "${1:-}" = "--compat" ]; then
  shift
  ensure_overlay .compat-packages requirements-transformers4.lock
  export PYTHONPATH="$PWD/.compat-packages${PYTHONPATH:+:$PYTHONPATH}"
  .venv/bin/python -c 'import transformers; print(f"compatibility leg: transformers {transformers.__version__}")'
  exec .venv/bin/python -m pytest -m "(not swarm and not version_neutral) or compat" "$@"
fi
.venv/bin/ruff check .
exec .venv/bin/python -m pytest "$@"
